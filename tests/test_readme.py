"""What the README writes in Python works as written: every `clip_jax.X.Y(...)` it calls resolves after
`import clip_jax`, in a fresh interpreter (the test session has long imported everything), and its ```python
blocks run, in order, in one fresh interpreter (tests/readme_blocks.py), given named fixtures for their inputs; the
commands of its recipe for one's own data run as written, up to the first step."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_calls() -> list[str]:
    """The dotted names the README calls: `clip_jax.models.init_variables(...)`, `clip_jax.create_model(...)`."""
    with open(os.path.join(REPO, "README.md")) as f:
        return sorted(set(re.findall(r"\b(clip_jax(?:\.[A-Za-z_]\w*)+)\(", f.read())))


def test_the_readme_says_where_python_comes_from_before_its_first_bare_python_command():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    bare = re.search(r"(?<![/\w])python -m clip_jax", text)
    told = text.find("source .venv/bin/activate")
    assert bare and 0 <= told < bare.start(), "the first bare `python -m` comes before the word on .venv"


def test_the_readme_calls_the_names_this_test_expects():
    names = readme_calls()
    for name in ("clip_jax.text.clip_tokenizer.tokenize", "clip_jax.interop.convert.from_open_clip",
                 "clip_jax.models.init_variables", "clip_jax.create_model"):
        assert name in names


@pytest.mark.subprocess
@pytest.mark.slow
def test_every_name_the_readme_calls_resolves_after_import_clip_jax():
    names = readme_calls()
    code = ("import sys\nimport clip_jax\n"
            "light = 'jax' not in sys.modules\n"
            f"for name in {names!r}:\n"
            "    assert callable(eval(name)), name\n"
            "try:\n"
            "    clip_jax.interop.no_such_module\n"
            "except AttributeError as e:\n"
            "    print(light, e)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # `import clip_jax` alone stays light; an unknown name is still an AttributeError
    assert done.stdout == "True module 'clip_jax.interop' has no attribute 'no_such_module'\n"


# The README's models at the size of the blocks' 224 px images, small enough for two CPU cores: a ViT and a ResNet
# (each stage, the attention pool, the text tower), as OpenCLIP model-config dicts, which create_model takes as well.
SMALL_VIT = {"embed_dim": 16,
             "vision_cfg": {"image_size": 224, "patch_size": 32, "width": 32, "layers": 1, "head_width": 16},
             "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
SMALL_RN = {"embed_dim": 16,
            "vision_cfg": {"image_size": 224, "layers": [1, 1, 1, 1], "width": 8, "head_width": 16},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}

# The README's inputs, each made without binding any other name (so a block that forgets an import still fails).
README_FIXTURES = {
    "images": "images = __import__('numpy').random.default_rng(0).normal(size=(2, 224, 224, 3)).astype('float32')",
    "tokens": "tokens = __import__('clip_jax').tokenize(['a photo of a dog', 'a photo of a cat'])",
    "state_dict": "state_dict = {k: v.numpy() for k, v in "
                  f"__import__('open_clip').CLIP(**{SMALL_RN!r}).state_dict().items()}}",
    "c": "c = __import__('clip_jax.run_config').run_config.default_config()",
}


def readme_substitutions(shards: str) -> list[list[str]]:
    """What the README's blocks write that this machine cannot run as is: LAION's shards, a global batch of 86,016
    224 px images (50 GB), six data workers on two cores; and, to keep the test short, ViT-L-14 and RN50 (a minute
    of initialising and applying on the CPU) become small models of the same kinds."""
    return [["/data/laion2B-en/{00000..23295}.tar", shards], ["86_016", "16"], ["workers=6", "workers=1"],
            ['create_model("ViT-L-14")', f"create_model({SMALL_VIT!r})"], ['"RN50"', repr(SMALL_RN)]]


@pytest.fixture
def readme_inputs(tmp_path):
    """The folder the README's relative paths name: `exported/` (an export of a tiny model), `photo.jpg`; and
    Fashion-MNIST shards written by clip_jax for the data block."""
    import jax
    from PIL import Image

    import clip_jax
    from clip_jax.data import make_shards
    from clip_jax.interop.export import export_open_clip

    model = clip_jax.create_model(TINY_EXPORT)
    export_open_clip(clip_jax.init_params(model, jax.random.key(0)), model.config, str(tmp_path / "exported"),
                     mean=(0.5,) * 3, std=(0.5,) * 3)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(tmp_path / "photo.jpg")
    paths = make_shards.write_shards(make_shards.fashion_mnist_samples("train", limit=64), str(tmp_path / "shards"), 32)
    return tmp_path, make_shards.shard_pattern(paths)


TINY_EXPORT = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 1, "head_width": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_readme_python_blocks_run_as_written_in_one_fresh_interpreter(readme_inputs):
    folder, shards = readme_inputs
    (folder / "fixtures.json").write_text(json.dumps({"fixtures": README_FIXTURES,
                                                      "substitutions": readme_substitutions(shards)}))
    runner = os.path.join(REPO, "tests", "readme_blocks.py")
    # the session's XLA flags (cheapest code generation): with the small models, compiling is most of the time
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, runner, os.path.join(REPO, "README.md"), "fixtures.json"], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    ran = [line for line in done.stdout.splitlines() if line.startswith("block at README.md:")]
    with open(os.path.join(REPO, "README.md")) as f:
        assert len(ran) == f.read().count("```python") >= 5
    assert done.stdout.endswith("all blocks ran\n")


def test_a_block_that_reads_a_name_nothing_defines_fails_naming_its_line(tmp_path):
    import readme_blocks

    readme = tmp_path / "README.md"
    readme.write_text("text\n\n```python\nx = [k for k in range(3)]\nprint(len(x), y)\n```\n")
    with pytest.raises(SystemExit, match=r"README.md:5 reads 'y', which no earlier block defines"):
        readme_blocks.run(str(readme), fixtures={}, substitutions=[])
    readme_blocks.run(str(readme), fixtures={"y": "y = 'given'"}, substitutions=[])
    with pytest.raises(SystemExit, match="no README block writes 'z' any more"):
        readme_blocks.run(str(readme), fixtures={}, substitutions=[["z", "w"]])


def own_data_commands() -> list[list[str]]:
    """The commands of the README's "Training on your own data", each split into its arguments."""
    with open(os.path.join(REPO, "README.md")) as f:
        section = f.read().split("\n## Training on your own data\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("\n```", 1)[0].replace("\\\n", " ")
    return [shlex.split(line) for line in block.splitlines() if line.strip() and not line.startswith("#")]


def write_photos(folder, count: int) -> None:
    """What the recipe starts from: photos/ with a caption beside each image, and captions.tsv (OpenCLIP's csv
    layout) naming the same pairs."""
    from PIL import Image

    (folder / "photos").mkdir()
    rows = ["filepath\ttitle"]
    for i in range(count):
        colour = ("red", "green", "blue")[i % 3]
        Image.new("RGB", (12, 10), colour).save(folder / "photos" / f"{i:04d}.jpg")
        (folder / "photos" / f"{i:04d}.txt").write_text(f"a {colour} square")
        rows.append(f"photos/{i:04d}.jpg\ta {colour} square")
    (folder / "captions.tsv").write_text("\n".join(rows) + "\n")


def substituted(arg: str, instead: dict[str, str]) -> str:
    """`arg` (a path, or `--config.FIELD=path`) with a path the test cannot use as written replaced."""
    flag, equals, value = arg.rpartition("=")
    return flag + equals + instead.get(value, value)


def train_config(argv: list[str]):
    """The config `python -m clip_jax.train ARGV` trains with (the file loaded, the overrides applied, locked)."""
    from absl import flags
    from ml_collections import config_flags

    argv = ["clip_jax.train", *argv]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "training config file", flag_values=values, lock_config=True,
                                    sys_argv=argv)  # where it reads the overrides (else sys.argv)
    values(argv)
    return values.config


def steps_on_one_device(config) -> int:
    """The run's steps on one CPU device, checked as the trainer checks the config, its data and its learning-rate
    schedule before it builds the step."""
    from clip_jax import data
    from clip_jax.optim.adamw import warmup_cosine_schedule
    from clip_jax.training.config_checks import check_config
    from clip_jax.training.schedule import make_schedule

    check_config(config, num_devices=1)
    shards = data.resolve_train_shards(data.TrainDataConfig.from_run_config(config))
    total = make_schedule(config, 1, shards).total_steps
    warmup_cosine_schedule(config.lr, config.warmup, total)
    return total


@pytest.mark.subprocess
def test_the_readme_recipe_for_your_own_data_runs_as_written_up_to_the_first_step(tmp_path, monkeypatch):
    """From a folder holding what the commands name (photos/, captions.tsv; the shards of /data/my-shards/ become
    two without *_stats.json): the shard tools run, and each training command's config loads, finds its data and
    fits its schedule (the training itself: the demo, tests/test_train.py)."""
    from clip_jax.run_config import default_config

    commands = own_data_commands()
    python = ".venv/bin/python", "-m"
    assert [command[:3] for command in commands] == [[*python, "clip_jax.data.make_shards"],
                                                     [*python, "clip_jax.data.check"]] + [[*python, "clip_jax.train"]] * 3
    write_photos(tmp_path, 330)  # > 320: 10 epochs of 64 images a step outlast the 50 warmup steps
    made, checked = (subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, capture_output=True, text=True,
                                    timeout=120) for command in commands[:2])
    assert made.returncode == 0 and checked.returncode == 0, made.stderr + checked.stderr
    assert made.stdout == "wrote 1 shards to data/photos: data/photos/00000.tar\n"
    assert re.search(r"^samples +330 good, 0 skipped$", checked.stdout, re.M), checked.stdout
    (tmp_path / "my-shards").mkdir()
    for name in ("00000.tar", "00001.tar"):
        shutil.copy(tmp_path / "data" / "photos" / "00000.tar", tmp_path / "my-shards" / name)
    monkeypatch.chdir(tmp_path)
    instead = {"configs/my_data.py": os.path.join(REPO, "configs", "my_data.py"),
               "/data/my-shards/{00000..00099}.tar": str(tmp_path / "my-shards" / "{00000..00001}.tar")}
    configs = [train_config([substituted(arg, instead) for arg in command[3:]]) for command in commands[2:]]
    assert [c.name for c in configs] == ["photos", "csv", "shards"]
    assert all(set(c.keys()) == set(default_config().keys()) and c.make_train_data == "" for c in configs)
    assert [steps_on_one_device(c) for c in configs] == [60, 60, 10 * -(-100_000 // 64)]


def offline_benchmark_commands() -> list[list[str]]:
    """The README's commands that write the CLIP_benchmark dataset at hand without a download and evaluate on it."""
    with open(os.path.join(REPO, "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)\n```", f.read(), re.S)
    (block,) = [block for block in blocks if "clip_jax.benchmark fashion-mnist" in block]
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines()
            if line.strip() and not line.startswith("#")]


def test_the_readme_writes_the_benchmark_dataset_at_hand_offline_and_evaluates_the_demo_on_it(tmp_path, monkeypatch,
                                                                                                capsys):
    """Run as written from a folder holding `logs/demo` (here a tiny export) and Fashion-MNIST cut to 20 images a
    split: the first command writes the folder the fine-tuning demo writes, the second scores a model on it."""
    import runpy

    import jax

    import clip_jax
    from clip_jax.data import fashion_mnist
    from clip_jax.evaluation import benchmark_cli
    from clip_jax.interop.export import export_open_clip

    write, evaluate = offline_benchmark_commands()
    assert write[:4] == ["python", "-m", "clip_jax.benchmark", "fashion-mnist"]
    assert evaluate[:4] == ["python", "-m", "clip_jax.benchmark", "eval"]
    finetune_data = runpy.run_path(os.path.join(REPO, "configs", "demo_finetune.py"))["get_config"]().data
    assert os.path.normpath(os.path.join(REPO, write[4])) == os.path.normpath(finetune_data)

    model = clip_jax.create_model(TINY_EXPORT | {"vision_cfg": {**TINY_EXPORT["vision_cfg"], "image_size": 28,
                                                                "patch_size": 7}})
    export_open_clip(clip_jax.init_params(model, jax.random.key(0)), model.config, str(tmp_path / "logs" / "demo"),
                     mean=(0.5,) * 3, std=(0.5,) * 3)
    load = fashion_mnist.load
    monkeypatch.setattr(fashion_mnist, "load", lambda split, root=fashion_mnist.DEFAULT_DIR: tuple(
        array[:20] for array in load(split, root)))
    monkeypatch.chdir(tmp_path)
    assert benchmark_cli.main(write[3:]) == 0
    assert benchmark_cli.main(evaluate[3:]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^wds/fashion-mnist \(zeroshot_classification, .* s\): acc1 ", out, re.M), out
    assert sorted(os.listdir(tmp_path)) == ["data", "logs", "results"]  # the record went where --output says
    (record,) = os.listdir(tmp_path / "results")
    assert re.fullmatch(r"fashion-mnist_demo_.*_en_zeroshot_classification\.json", record)


OUTPUT_FLAGS = ("--output", "--output_folder", "--output-dir", "--feature_root", "--out")


def readme_outputs() -> set[str]:
    """The files and folders the README's commands write in the working folder (their first path component): what
    follows an output flag, export's OUT_DIR, convert's DST, and the strip guide writes beside its --output."""
    with open(os.path.join(REPO, "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)\n```", f.read(), re.S)
    written = set()
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # a line of a `python -c '...'` spread over lines: no command of clip_jax's
            continue
        if words[:3] in (["python", "-m", "clip_jax.export"], ["python", "-m", "clip_jax.convert"]):
            written.add(words[4])
        for flag, value in zip(words, words[1:]):
            if flag in OUTPUT_FLAGS:
                written.add(value)
                if words[2] == "clip_jax.guide":
                    from clip_jax.interop.guide import strip_path

                    written.add(strip_path(value))
    return {path.split("/")[0] for path in written if not path.startswith(("/", "s3://", "gs://", "$"))}


def test_the_readme_commands_write_in_the_working_folder_only_what_git_ignores():
    import fnmatch

    with open(os.path.join(REPO, ".gitignore")) as f:
        patterns = [line.strip().strip("/") for line in f if line.strip() and not line.startswith("#")]
    written = readme_outputs()
    assert {"exported", "results", "scores.csv", "sneaker.strip.png"} <= written
    assert [name for name in sorted(written) if not any(fnmatch.fnmatch(name, p) for p in patterns)] == []
    assert any(fnmatch.fnmatch(".clip_jax-written", p) for p in patterns)  # the manifest of such a folder


def test_the_readmes_benchmark_evaluations_name_their_output():
    with open(os.path.join(REPO, "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)\n```", f.read(), re.S)
    evaluations = [line for line in "\n".join(blocks).replace("\\\n", " ").splitlines()
                   if "clip_jax.benchmark eval" in line]
    assert len(evaluations) >= 3 and all("--output " in line for line in evaluations)
