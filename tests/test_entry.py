"""Every command ends through one entry (clip_jax/runtime/entry.py): a user error in one line (exit 2, the data tools 1), a
run that failed 1, Ctrl-C in one line with exit 130 and no half-written file, at once even during an XLA compile.

The Ctrl-C tests send real SIGINTs at named moments through the test seam CLIP_JAX_TEST_SIGINT_AT (the command
signals itself there): before the work ("start"), mid-work ("batch", "write") in-process, and during the first XLA
compile ("compile") in a process of its own, since that one ends the process."""

import ast
import glob
import os
import signal
import subprocess
import sys

import pytest
from test_clip_benchmark import CLASSES, TEMPLATES, classification_samples, write_dataset
from test_embed import image_bytes, write_export

from clip_jax.data import check as data_check
from clip_jax.data import make_shards
from clip_jax.errors import InvalidInput, RunFailed
from clip_jax.evaluation import benchmark_cli, clip_score, embed, zeroshot
from clip_jax.interop import export, guide, similarity, weight_files
from clip_jax.ops import report
from clip_jax.plan import __main__ as plan_command
from clip_jax.runtime import entry, stop_signals
from clip_jax.training import command as train_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEAM = stop_signals.TEST_SIGINT_AT
CLEAN = ("Traceback", "KeyboardInterrupt", "Segmentation", "core dumped")

# every command's main, with arguments naming a file that is not there (a user error), and its user-error status
COMMANDS = {
    "convert": (weight_files.main, ["missing.pt", "out.npz", "--model", "ViT-B-32"], 2),
    "export": (export.main, ["missing-run", "out"], 2),
    "guide": (guide.main, ["--checkpoint", "missing", "--prompt", "a cat", "--output", "cat.png"], 2),
    "similarity": (similarity.main, ["--checkpoint", "missing", "--images", "missing.jpg", "--labels", "a,b"], 2),
    "report": (report.main, ["missing-run"], 2),
    "score": (clip_score.main, ["--checkpoint", "missing", "--images", "missing", "--output", "s.csv"], 2),
    "benchmark": (benchmark_cli.main, ["eval", "--dataset", "wds/x", "--dataset_root", "missing", "--pretrained",
                                       "missing"], 2),
    "embed": (embed.main, ["--input_dataset", "missing", "--output_folder", "out", "--clip_model", "missing"], 2),
    "zeroshot": (zeroshot.main, ["--checkpoint", "missing", "--demo"], 2),
    "data.check": (data_check.main, ["missing/{00000..00001}.tar"], 1),
    "data.make_shards": (make_shards.main, ["folder", "--images", "missing", "--out", "out"], 1),
}


def test_every_command_main_goes_through_the_entry():
    mains = []
    for path in glob.glob(os.path.join(REPO, "clip_jax", "**", "*.py"), recursive=True):
        for node in ast.parse(open(path).read()).body:
            if isinstance(node, ast.FunctionDef) and node.name == "main":
                mains.append((os.path.relpath(path, REPO), [ast.unparse(d) for d in node.decorator_list]))
    assert len(mains) >= 13
    assert [path for path, decorators in mains if not any(d.startswith("entry.command") for d in decorators)] == []
    for main in (plan_command.main, train_command.main, *(main for main, _, _ in COMMANDS.values())):
        assert main.__wrapped__  # functools.wraps of entry.command


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_user_error_is_one_line_and_its_status(name, tmp_path, monkeypatch, capsys):
    main, argv, status = COMMANDS[name]
    monkeypatch.chdir(tmp_path)
    assert main(argv) == status
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "missing" in err, err


@pytest.mark.parametrize("name", list(COMMANDS))
def test_ctrl_c_before_the_work_is_one_line_and_130(name, tmp_path, monkeypatch, capsys):
    main, argv, _ = COMMANDS[name]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(SEAM, "start")
    found = signal.getsignal(signal.SIGINT)  # Python's own, or SIG_IGN where the shell started us in the background
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.startswith("stopped (Ctrl-C) ") and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == []
    assert signal.getsignal(signal.SIGINT) is found  # left as found


def test_the_absl_commands_stop_and_refuse_in_one_line_too(monkeypatch, capsys):
    assert plan_command.main(["plan", "extra"]) == 2
    assert capsys.readouterr().err == "error: unexpected arguments ['extra']\n"
    assert train_command.main(["train", "extra"]) == 2
    assert capsys.readouterr().err.startswith("error: unexpected arguments ['extra']; settings go in")
    monkeypatch.setenv(SEAM, "start")
    assert plan_command.main(["plan"]) == 130
    assert capsys.readouterr().err == "stopped (Ctrl-C) before the plan was made\n"


def test_how_a_command_ends(tmp_path, capsys):
    @entry.command(stopped="before the thing was written")
    def fails(error):
        raise error

    assert fails(RunFailed("the disk is full")) == 1
    assert capsys.readouterr().err == "error: the disk is full\n"
    assert fails(InvalidInput("--x 3: give 1 or 2")) == 2
    assert capsys.readouterr().err == "error: --x 3: give 1 or 2\n"
    assert entry.command(user_error=1)(fails.__wrapped__)(InvalidInput("bad")) == 1  # the data tools'
    assert capsys.readouterr().err == "error: bad\n"
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        fails(ZeroDivisionError())

    done, staged = tmp_path / "done.bin", tmp_path / "staged.bin"

    @entry.command(stopped="with the finished file kept")
    def writes():
        done.write_bytes(b"whole")
        with stop_signals.unfinished(str(staged)):
            staged.write_bytes(b"ha")
            signal.raise_signal(signal.SIGINT)
            staged.write_bytes(b"half")

    assert writes() == 130
    assert capsys.readouterr().err == "stopped (Ctrl-C) with the finished file kept\n"
    assert os.listdir(tmp_path) == ["done.bin"]


# ---------------------------------------------------------------------------------------------------------------
# Real SIGINTs to embed, zeroshot and benchmark eval


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("entry")
    images = root / "images"
    images.mkdir()
    for i in range(6):
        (images / f"{i}.jpg").write_bytes(image_bytes(i))
        (images / f"{i}.txt").write_text(f"picture {i}")
    write_dataset(root / "collection" / "vtab" / "fashion", classification_samples(), class_names=CLASSES,
                  templates=TEMPLATES)
    return {"model": write_export(root / "model", seed=0), "images": str(images),
            "collection": str(root / "collection")}


def command_line(name, inputs, out) -> list[str]:
    """`python -m clip_jax.NAME` arguments writing into `out`: 3 parts of 2 images (embed), 2 batches or more."""
    if name == "embed":
        return ["--input_dataset", inputs["images"], "--output_folder", str(out), "--clip_model", inputs["model"],
                "--batch_size", "2", "--write_batch_size", "2", "--num_prepro_workers", "1"]
    if name == "zeroshot":
        return ["--checkpoint", inputs["model"], "--demo", "--limit", "16", "--batch-size", "8", "--no-progress",
                "--output", str(out / "zeroshot.json")]
    return ["eval", "--dataset", "wds/vtab/fashion", "--dataset_root", inputs["collection"], "--pretrained",
            inputs["model"], "--batch_size", "4", "--output", str(out / "{dataset}.json")]


MAINS = {"embed": embed.main, "zeroshot": zeroshot.main, "benchmark": benchmark_cli.main}


def files_in(folder) -> list[str]:
    return sorted(os.path.relpath(p, folder) for p in glob.glob(f"{folder}/**", recursive=True)
                  if os.path.isfile(p) and not os.path.basename(p).startswith(".clip_jax"))


@pytest.mark.parametrize("name", list(MAINS))
def test_ctrl_c_mid_work_stops_in_one_line_with_no_half_written_file(name, inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(SEAM, "write:5" if name == "embed" else "batch:2")  # embed: part 2's first file staged
    assert MAINS[name](command_line(name, inputs, tmp_path)) == 130
    err = capsys.readouterr().err  # embed's progress lines, then the stop's
    assert err.splitlines()[-1].startswith("stopped (Ctrl-C) ") and err.count("stopped") == 1, err
    assert not any(word in err for word in CLEAN), err
    assert not glob.glob(f"{tmp_path}/**/.clip_jax-partial-*", recursive=True)
    if name != "embed":
        assert files_in(tmp_path) == []
        return
    assert files_in(tmp_path) == ["img_emb/img_emb_0.npy", "metadata/metadata_0.parquet", "text_emb/text_emb_0.npy"]
    monkeypatch.delenv(SEAM)
    assert embed.main(command_line(name, inputs, tmp_path)) == 0  # the part written is kept, the rest made
    assert "into 2 parts of 3 (1 written before kept)" in capsys.readouterr().out
    assert len(files_in(tmp_path)) == 9


def test_ctrl_c_during_the_compile_ends_the_process_at_once(inputs, tmp_path):
    """The three commands at once, each in a process of its own signalling itself inside JAX's first compile."""
    env = {**os.environ, SEAM: "compile", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    env.pop("JAX_COMPILATION_CACHE_DIR")  # a real compile, not the test session's cached programs
    modules = {"embed": "clip_jax.embed", "zeroshot": "clip_jax.zeroshot", "benchmark": "clip_jax.benchmark"}
    runs = {}
    for name, module in modules.items():
        (tmp_path / name).mkdir()
        runs[name] = subprocess.Popen([sys.executable, "-m", module, *command_line(name, inputs, tmp_path / name)],
                                      cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
    for name, process in runs.items():
        out, err = process.communicate(timeout=120)
        assert process.returncode == 130, (name, process.returncode, out, err)
        assert err.splitlines()[-1].startswith("stopped (Ctrl-C) ") and not any(w in out + err for w in CLEAN), err
        assert files_in(tmp_path / name) == []  # no part, no result, nothing half-written
        assert not glob.glob(f"{tmp_path / name}/**/.clip_jax-partial-*", recursive=True)


HELD_IN_A_COMPILE = '''
import os, signal, sys, threading
from clip_jax.runtime import entry

ready = threading.Event()
compiler = {"ready": ready}  # a function whose code is JAX's compiler's, which holds the main thread in a read
exec(compile("def compile_for_minutes(read_end):\\n"
             "    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])  # no handler runs in this thread\\n"
             "    ready.set()\\n"
             "    os.read(read_end, 1)  # never returns: nothing writes\\n",
             os.path.join("site-packages", "jax", "_src", "compiler.py"), "exec"), {**compiler, "os": os,
                                                                                  "signal": signal}, compiler)
read_end, _ = os.pipe()
threading.Thread(target=lambda: (ready.wait(), os.kill(os.getpid(), signal.SIGINT)), daemon=True).start()


@entry.command(stopped="during a compile")
def main():
    compiler["compile_for_minutes"](read_end)


sys.exit(main())
'''


def test_a_main_thread_held_in_native_code_by_a_compile_is_ended_by_the_watcher(tmp_path):
    """No Python handler can run while the main thread is in native code (here a read that never returns, with
    SIGINT blocked in that thread): the watcher thread ends the process, which would otherwise wait for ever."""
    done = subprocess.run([sys.executable, "-c", HELD_IN_A_COMPILE], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])})
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "stopped (Ctrl-C) during a compile\n")
