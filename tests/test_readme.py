"""What the README writes in Python works as written: every `clip_jax.X.Y(...)` it calls resolves after
`import clip_jax`, in a fresh interpreter (the test session has long imported everything), and its ```python
blocks run, in order, in one fresh interpreter (tests/readme_blocks.py), given named fixtures for their inputs."""

import json
import os
import re
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
    for name in ("clip_jax.tokenizer.tokenize", "clip_jax.interop.convert.from_open_clip",
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
