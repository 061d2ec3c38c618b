"""The entry points tell a user's mistake in one line and exit 2; a bug in clip_jax keeps its traceback."""

import json
import os
import re
import subprocess
import sys
import tarfile

import pytest

from clip_jax.data import check, make_shards
from clip_jax.errors import InvalidInput
from clip_jax.evaluation import zeroshot
from clip_jax.interop import similarity, weight_files
from clip_jax.runtime import storage, xla_gpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_CONFIG = os.path.join(REPO, "tests", "train_config.py")  # loads in a moment, writes nothing

# (module, the function main hands the work to, argv, exit status for a user error)
CLIS = [
    (weight_files, "model_source", ["src.npz", "dst.npz", "--model", "ViT-B-32"], 2),
    (similarity, "create_model", [], 2),
    (zeroshot, "run", ["--model", "ViT-B-32", "--demo"], 2),
    (make_shards, "fashion_mnist_samples", ["fashion-mnist", "--out", "out"], 1),
    (check, "run", ["shards/{0..1}.tar"], 1),
]


def raising(error):
    def fail(*args, **kwargs):
        raise error

    return fail


@pytest.mark.parametrize("module, inner, argv, status", CLIS, ids=[c[0].__name__ for c in CLIS])
def test_a_user_error_is_one_line_and_an_internal_error_keeps_its_traceback(module, inner, argv, status, monkeypatch,
                                                                            capsys):
    monkeypatch.setattr(module, inner, raising(InvalidInput("the value you gave is wrong")))
    assert module.main(argv) == status
    assert capsys.readouterr().err == "error: the value you gave is wrong\n"

    monkeypatch.setattr(module, inner, raising(ValueError("a bug inside clip_jax")))
    with pytest.raises(ValueError, match="a bug inside clip_jax"):
        module.main(argv)


def run_cli(module, *args):
    env = dict(os.environ, CLIP_JAX_TEST_CONFIG=json.dumps({}))
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("module", ["clip_jax.train", "clip_jax.plan"])
def test_a_mistyped_config_override_names_the_closest_field(module):
    done = run_cli(module, f"--config={TRAIN_CONFIG}", "--config.lrr=1")
    assert done.returncode == 2
    assert done.stderr == "error: --config.lrr: no such config field; did you mean 'lr'?\n"


@pytest.mark.subprocess
@pytest.mark.parametrize("module, defaults, fields", [
    ("clip_jax.train", "clip_jax.run_config import default_config",
     "c.batchsize = 128\n    c.aug_cfg.scael = (0.9, 1.0)"),
    ("clip_jax.finetune", "clip_jax.training.finetune_config import default_finetune_config as default_config",
     "c.epocs = 3"),
])
def test_a_misspelled_field_in_a_config_file_is_named_before_anything_is_built(module, defaults, fields, tmp_path):
    config_file = tmp_path / "my_config.py"
    config_file.write_text(f"from {defaults}\ndef get_config():\n    c = default_config()\n    {fields}\n"
                           f"    c.logs = {str(tmp_path / 'logs')!r}\n    return c\n")
    done = run_cli(module, f"--config={config_file}")
    assert done.returncode == 2, done.stderr
    expected = {"clip_jax.train": "aug_cfg.scael, which is no config field (did you mean 'aug_cfg.scale'?); batchsize, "
                                  "which is no config field (did you mean 'batch_size'?)",  # in the config's order
                "clip_jax.finetune": "epocs, which is no config field (did you mean 'epochs'?)"}[module]
    assert done.stderr == f"error: --config={config_file} sets {expected}: fix the name in the file\n"
    assert not (tmp_path / "logs").exists()


@pytest.mark.subprocess
@pytest.mark.parametrize("module, config, owner", [("clip_jax.train", "demo_finetune.py", "clip_jax.finetune"),
                                                   ("clip_jax.finetune", "demo.py", "clip_jax.train")])
def test_the_other_commands_config_is_one_line_naming_that_command(module, config, owner):
    path = os.path.join(REPO, "configs", config)
    done = run_cli(module, f"--config={path}")
    assert done.returncode == 2
    assert done.stderr == (f"error: --config={path} is a config of python -m {owner}: run it with python -m {owner} "
                           f"--config={path}\n")


@pytest.mark.subprocess
@pytest.mark.slow
def test_an_override_of_the_wrong_type_is_one_line():
    done = run_cli("clip_jax.train", f"--config={TRAIN_CONFIG}", "--config.lr=abc")
    assert done.returncode == 2
    assert done.stderr == "error: --config.lr=abc: could not convert string to float: 'abc'\n"


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_missing_config_file_is_one_line():
    done = run_cli("clip_jax.train", "--config=no/such/config.py", "--config.lr=1")
    assert done.returncode == 2
    assert done.stderr == "error: --config=no/such/config.py: no such config file\n"


def without_gpu_settings(**settings):
    """This environment without what the test session sets for deviceless XLA:GPU (conftest), as a user has it."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", xla_gpu.SKIP_CHECK_ENV)}
    return {**env, **settings}


needs_cuda_plugin_without_gpu = pytest.mark.skipif(
    not xla_gpu.cuda_plugin_installed() or xla_gpu.nvidia_gpu_present(),
    reason="the CUDA plugin's start-up failure shows only where the plugin is installed and there is no GPU")


@pytest.mark.subprocess
@pytest.mark.slow
@needs_cuda_plugin_without_gpu
def test_a_command_on_a_machine_without_a_gpu_prints_nothing_from_the_cuda_plugin(tmp_path):
    # The trainer counts the devices (JAX starts its backends, the CUDA plugin's check fails) before it checks the
    # config: a bad field then ends the run in a moment, with its own line and nothing else.
    done = train_cli({"precision": "amp", "logs": str(tmp_path), "train_data": "/data/{0..1}.tar"},
                     env=without_gpu_settings())
    assert "Jax plugin configuration error" not in done.stderr and "cuInit" not in done.stderr
    assert done.returncode == 2
    assert done.stderr == ("error: bad config: precision='amp': choose one of ('fp32', 'bf16', 'pure_bf16', 'fp16', "
                           "'fp8'); did you mean 'fp16'? (OpenCLIP's 'amp' is float16 mixed precision)\n")


@pytest.mark.subprocess
@pytest.mark.slow
@needs_cuda_plugin_without_gpu
def test_a_gpu_asked_for_keeps_the_cuda_plugins_message():
    start = "from clip_jax.runtime import xla_gpu; xla_gpu.quiet_cuda_plugin(); import jax; jax.devices()"
    done = subprocess.run([sys.executable, "-c", start], cwd=REPO, env=without_gpu_settings(JAX_PLATFORMS="cuda"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "Jax plugin configuration error" in done.stderr and "cuInit" in done.stderr


# The README's inference snippet up to its first use of JAX (which starts the backends), on a model small enough
# for the moment: what a user's script does after `import clip_jax`.
SNIPPET = ("import clip_jax\n"
           "model, params, _, eval_transform = clip_jax.create_model_and_transforms({'embed_dim': 32, 'vision_cfg': "
           "{'image_size': 32, 'layers': 1, 'width': 64, 'patch_size': 8, 'head_width': 32}, 'text_cfg': "
           "{'context_length': 77, 'vocab_size': 49408, 'width': 32, 'heads': 2, 'layers': 1}})\n"
           "print('loaded')\n")
GPU_PRESENT = "import clip_jax.cuda_plugin\nclip_jax.cuda_plugin.nvidia_gpu_present = lambda: True\n"


@pytest.mark.subprocess
@pytest.mark.slow
@needs_cuda_plugin_without_gpu
def test_importing_clip_jax_on_a_machine_without_a_gpu_prints_nothing_from_the_cuda_plugin():
    done = subprocess.run([sys.executable, "-c", SNIPPET], cwd=REPO, env=without_gpu_settings(),
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "loaded\n", "")


@pytest.mark.subprocess
@pytest.mark.slow
@needs_cuda_plugin_without_gpu
@pytest.mark.parametrize("settings, start", [({"JAX_PLATFORMS": "cuda,cpu"}, ""), ({}, GPU_PRESENT)],
                         ids=["JAX_PLATFORMS set", "a GPU present"])
def test_importing_clip_jax_keeps_the_cuda_plugins_message_where_a_gpu_is_asked_for_or_present(settings, start):
    done = subprocess.run([sys.executable, "-c", start + SNIPPET], cwd=REPO, env=without_gpu_settings(**settings),
                          capture_output=True, text=True, timeout=120)
    assert "Jax plugin configuration error" in done.stderr and "cuInit" in done.stderr


def train_cli(fields, *, env=None):
    """`python -m clip_jax.train` on tests/train_config.py with these config fields."""
    env = dict(env or os.environ, CLIP_JAX_TEST_CONFIG=json.dumps(fields))
    return subprocess.run([sys.executable, "-m", "clip_jax.train", f"--config={TRAIN_CONFIG}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_logs_folder_that_cannot_be_written_is_one_line_naming_it_before_anything_is_built(tmp_path,
                                                                                             unwritable_folder):
    folder = unwritable_folder
    logs = os.path.join(folder, "logs")
    done = train_cli({"logs": logs, "name": "run", "model": "configs/models/demo-tiny.json",
                      "train_data": str(tmp_path / "no-shards-{0..1}.tar")})  # read after the check
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"error: cannot write the run directory {logs}/run: {folder} is not writable (")
    assert done.stderr.endswith("give --config.logs a folder you can write to\n")
    assert not os.path.exists(logs)


def test_a_writable_logs_folder_passes_the_check_and_is_left_as_it_was(tmp_path):
    (tmp_path / "mine.txt").write_text("a user's file")
    assert storage.unwritable(str(tmp_path / "logs" / "run")) is None  # to be made: probed in tmp_path
    assert storage.unwritable(str(tmp_path)) is None
    assert sorted(os.listdir(tmp_path)) == ["mine.txt"]


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_model_file_that_is_not_json_is_one_line_naming_the_file_and_line(tmp_path):
    model = tmp_path / "model.json"
    model.write_text('{\n  "embed_dim": 32,\n  "vision_cfg": {"image_size": 28,}\n}\n')  # a trailing comma
    done = train_cli({"logs": str(tmp_path / "logs"), "name": "run", "model": str(model),
                      "train_data": str(tmp_path / "no-shards-{0..1}.tar")})  # read after the model
    assert done.returncode == 2
    assert done.stderr == (f"error: model config file {model} is not valid JSON: Expecting property name enclosed in "
                           "double quotes: line 3 column 35 (char 55)\n")
    assert not (tmp_path / "logs").exists()


def run_without(packages, module, *args, env=None):
    """`python -m MODULE ARGS` in a process that cannot import `packages`, as where they are not installed."""
    code = ("import runpy, sys\n"
            "class NotInstalled:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            f"        if name.split('.')[0] in {tuple(packages)!r}:\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, NotInstalled())\n"
            f"sys.argv = [{module!r}, *sys.argv[1:]]\n"
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("package, command, message", [
    ("matplotlib", ["clip_jax.report", "{tmp}/run"],
     "the run report (its PNG) needs the matplotlib package, which is not installed: "
     "pip install 'clipjax-train[report]'"),
    ("wandb", ["clip_jax.train", f"--config={TRAIN_CONFIG}"],
     "bad config: report_to=wandb needs the wandb package, which is not installed: pip install 'clipjax-train[wandb]'"),
    ("torch", ["clip_jax.convert", "{tmp}/open_clip.pt", "{tmp}/params.npz", "--model", "ViT-B-32"],
     "reading {tmp}/open_clip.pt needs the torch package, which is not installed: pip install torch; or give the "
     "weights as .safetensors"),
], ids=["report-matplotlib", "train-wandb", "convert-torch"])
def test_a_missing_optional_package_is_one_line_naming_what_to_install(package, command, message, tmp_path):
    (tmp_path / "open_clip.pt").write_bytes(b"")
    env = dict(os.environ, CLIP_JAX_TEST_CONFIG=json.dumps(
        {"report_to": "wandb", "logs": str(tmp_path / "logs"), "name": "run", "train_data": "/data/{0..1}.tar"}))
    done = run_without([package], *[arg.format(tmp=tmp_path) for arg in command], env=env)
    assert done.returncode == 2
    assert done.stderr == f"error: {message.format(tmp=tmp_path)}\n"
    assert os.listdir(tmp_path) == ["open_clip.pt"]  # nothing written


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_data_set_with_no_usable_shard_is_one_line_counting_shards_by_reason(tmp_path, trainer_model_file):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("0", "1"):
        (data / f"{name}.tar").write_bytes(b"\x07" * 3000)  # not a tar: header checksum mismatch
    (data / "2.tar").write_bytes(b"")  # no end-of-archive marker
    with tarfile.open(data / "3.tar", "w"):
        pass  # a valid tar without members
    logs = tmp_path / "logs"
    done = train_cli({"logs": str(logs), "name": "run", "model": trainer_model_file,
                      "train_data": f"{data}/{{0..3}}.tar",
                      "train_num_samples": 64, "batch_size": 1, "workers": 0, "epochs": 1, "warmup": 1,
                      "dataset_resampled": False, "zeroshot_frequency": 0, "report_to": "tensorboard"})
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr.startswith("error: ") and "gave no usable sample (4 distinct of the data set's 4: " \
        "corrupt_shard 2, empty_shard 1, truncated_shard 1;" in done.stderr
    assert not logs.exists()  # the run made logs/run and wrote into it: taken back, as it never started


def private_tmpfs_shell():
    """The command prefix that runs a shell in a mount namespace of its own (where a tmpfs can be mounted), or None
    where the kernel allows none to this user."""
    for prefix in (["unshare", "-m"], ["unshare", "-rm"]):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0:
                return prefix
        except FileNotFoundError:
            return None
    return None


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_full_run_directory_is_told_once_exit_1_and_the_last_checkpoint_stays_complete(tmp_path,
                                                                                         fashion_mnist_shards):
    from clip_jax.runtime.checkpoints import latest_complete_step

    prefix = private_tmpfs_shell()
    if prefix is None:
        pytest.skip("no mount namespace for a small tmpfs on this machine (unshare -m / -rm refused)")
    pattern, model = fashion_mnist_shards(512)
    disk = tmp_path / "disk"
    disk.mkdir()
    fields = {"logs": str(disk / "logs"), "name": "run", "model": model, "train_data": pattern,
              "train_num_samples": 512, "batch_size": 8, "workers": 0, "epochs": 1, "warmup": 1,
              "dataset_resampled": False, "zeroshot_frequency": 0, "report_to": "tensorboard", "save_every_steps": 2,
              "log_every_n_steps": 2, "precision": "fp32"}  # TensorBoard's writer thread meets the full disk too
    # 8 steps of 8 x 8 devices; a checkpoint takes ~6.5 MB: those of steps 2 and 4 fit in 15 MB, 6 does not
    env = dict(os.environ, CLIP_JAX_TEST_CONFIG=json.dumps(fields))
    script = (f"mount -t tmpfs -o size=15m tmpfs {disk} && {sys.executable} -m clip_jax.train "
              f"--config={TRAIN_CONFIG}; status=$?; cp -r {disk}/logs {tmp_path}/kept; exit $status")
    done = subprocess.run([*prefix, "sh", "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    checkpoints = tmp_path / "kept" / "run" / "checkpoints"
    # (an OSError's "[Errno 28] " first where a plain write, TensorBoard's or the metrics', met the full disk first)
    told = re.findall(r"error: the storage of (\S+) is full: saving checkpoint (\d+) failed \((?:\[Errno 28\] )?"
                      r"No space left on device"
                      r"[^;]*; checkpoint (\d+) is complete and untouched\. Free space there \(or move the run "
                      r"directory to a larger disk\) and continue with --config\.resume=latest", done.stderr)
    assert len(told) == 1, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1, done.stderr[-3000:]  # the line alone: no writer thread's traceback
    where, failed, kept = told[0]
    assert where == f"{disk}/logs/run/checkpoints" and int(kept) < int(failed), told
    # 15 MB hold two checkpoints, not three; the one the line names is the newest complete one
    assert int(kept) in (2, 4) and latest_complete_step(str(checkpoints)) == int(kept), told
