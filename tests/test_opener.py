"""The model opener: a path of each kind it reads gives the model, preprocessing, weights and tokenizer it holds; a
path that holds no model (nothing, an empty folder, a run without a checkpoint yet, two models at once, a file of
another format, weights that do not say their model) is told in one line naming what is there and what is expected."""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import optax
import pytest
from PIL import Image
from tiny_model import TINY_MODEL

from clip_jax.errors import InvalidInput, MissingInput, UserError
from clip_jax.evaluation import benchmark_cli, clip_score, embed
from clip_jax.evaluation import zeroshot as zeroshot_cli
from clip_jax.interop import export, similarity, weight_files
from clip_jax.interop.convert import variables_to_open_clip
from clip_jax.interop.export import export_open_clip
from clip_jax.interop.opener import open_model
from clip_jax.interop.weight_files import save_params, write_open_clip
from clip_jax.models import create_model, get_model_config, init_params
from clip_jax.run_config import default_config
from clip_jax.runtime.checkpoints import CheckpointMeta, RunCheckpoints
from clip_jax.training.config_checks import check_config
from clip_jax.training.finetune_config import default_finetune_config
from clip_jax.training.trainer import Trainer
from clip_jax.training.train_step import init_train_state

# the tiny model with the tokenizer's vocabulary, so that transformers' CLIPModel files are written for it too
TINY = {**TINY_MODEL, "text_cfg": {**TINY_MODEL["text_cfg"], "context_length": 77, "vocab_size": 49408}}
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.3, 0.25)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("opener")
    (root / "tiny.json").write_text(json.dumps(TINY))
    config = get_model_config(str(root / "tiny.json"))
    params = jax.device_get(init_params(create_model(config), jax.random.key(0)))
    run = root / "run"
    run.mkdir()
    run_config = default_config()
    run_config.model, run_config.image_mean, run_config.image_std = str(root / "tiny.json"), MEAN, STD
    (run / "config.json").write_text(run_config.to_json())
    meta = CheckpointMeta(step=3, model="tiny", precision="fp32", global_batch=8, samples_seen=24, epoch=0.1)
    with RunCheckpoints(str(run / "checkpoints"), async_save=False) as checkpoints:
        checkpoints.save(3, init_train_state(params, optax.sgd(0.1)), None, meta)
    export_open_clip(params, config, str(root / "export"), mean=MEAN, std=STD)  # OpenCLIP's and transformers' files
    shutil.copytree(root / "export", root / "hf", ignore=shutil.ignore_patterns("open_clip_*"))
    write_open_clip(str(root / "open_clip.safetensors"), variables_to_open_clip({"params": params}, config))
    save_params(str(root / "params.npz"), params)
    return root, config, params


def test_each_kind_of_model_path_gives_its_model_preprocessing_weights_and_tokenizer(paths):
    root, config, params = paths
    run_said = {"mean": MEAN, "std": STD}
    kinds = [("run", "a clip_jax run directory", run_said),
             ("run/checkpoints", "a clip_jax checkpoint", run_said),
             ("run/checkpoints/3", "a clip_jax checkpoint", run_said),
             ("export", "an exported model folder", run_said),
             ("hf", "a transformers CLIPModel folder", run_said),
             ("open_clip.safetensors", "a weights file", {}),
             ("params.npz", "a weights file", {})]
    for name, kind, preprocessing in kinds:
        says_its_model = preprocessing != {}
        opened = open_model(str(root / name), None if says_its_model else config)
        assert opened.source.kind == kind, name
        assert dataclasses.replace(opened.config, name=config.name) == config, name
        assert opened.preprocessing == preprocessing, name
        jax.tree.map(np.testing.assert_array_equal, opened.variables(), {"params": params})
        assert opened.tokenizer(["a photo"]).shape == (1, 77)
    assert open_model(str(root / "run")).normalization() == (MEAN, STD)
    assert open_model(str(root / "params.npz"), config).normalization(mean=(0.1,) * 3)[0] == (0.1,) * 3


def test_a_run_or_checkpoint_named_relative_to_the_working_folder_opens(paths, monkeypatch):
    """As the README's commands name the demo (`--pretrained logs/demo`): Orbax reads absolute paths only."""
    root, _, params = paths
    monkeypatch.chdir(root)
    for name in ("run", "run/checkpoints", "run/checkpoints/3"):
        jax.tree.map(np.testing.assert_array_equal, open_model(name).variables(), {"params": params})


def _refusal(path, error, **options) -> str:
    with pytest.raises(error) as info:
        open_model(str(path), **options).variables()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_path_that_holds_no_model_says_what_is_there_and_what_is_expected(paths, tmp_path):
    root, config, _ = paths
    expected = "give a clip_jax run directory (config.json beside checkpoints/: its newest checkpoint), one of its"
    message = _refusal(tmp_path / "logs" / "dmeo", MissingInput, what="--checkpoint")
    assert message.startswith(f"--checkpoint {tmp_path}/logs/dmeo does not exist: {expected}")
    assert message.endswith("or a weights file (.pt, .pth, .bin, .safetensors, .npz: OpenCLIP's state_dict or "
                            "clip_jax's params)")
    (tmp_path / "empty").mkdir()
    assert f"{tmp_path}/empty is an empty folder: no complete checkpoint in it, neither an exported model folder" in (
        _refusal(tmp_path / "empty", MissingInput))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("my notes\n")
    assert "notes is a folder of README.md: no complete checkpoint in it" in _refusal(tmp_path / "notes", MissingInput)
    (tmp_path / "weights.ckpt").write_bytes(b"")
    assert "weights.ckpt is a file of an unknown checkpoint format: give" in _refusal(tmp_path / "weights.ckpt",
                                                                                      InvalidInput)

    fresh = tmp_path / "fresh-run"  # started, nothing saved yet
    os.makedirs(fresh / "checkpoints")
    shutil.copy(root / "run" / "config.json", fresh / "config.json")
    assert _refusal(fresh, MissingInput) == (f"the clip_jax run {fresh} has no complete checkpoint yet "
                                             f"({fresh}/checkpoints holds none): let the run save one, or give "
                                             "another run or checkpoint")
    shutil.copy(root / "export" / "open_clip_config.json", fresh / "open_clip_config.json")
    assert f"{fresh} is both a clip_jax run directory and an exported model folder" in _refusal(fresh, InvalidInput)
    assert _refusal(root / "params.npz", InvalidInput, what="--pretrained") == (
        f"--pretrained {root}/params.npz is a weights file, which does not say which model it holds: name the model "
        "(--model NAME, e.g. ViT-L-14)")


@pytest.fixture
def wrong_model_paths(paths, tmp_path, monkeypatch):
    """In a working folder: logs/demo, a run that has not saved a checkpoint yet; logs/empty, an empty folder; and a
    folder of one captioned image for the commands that also read data."""
    root, _, _ = paths
    monkeypatch.chdir(tmp_path)
    os.makedirs("logs/demo/checkpoints")
    os.makedirs("logs/empty")
    shutil.copy(root / "run" / "config.json", "logs/demo/config.json")
    os.makedirs("photos")
    Image.new("RGB", (8, 8), "red").save("photos/red.png")
    (tmp_path / "photos" / "red.txt").write_text("a red square")
    return {"logs/dmeo": "logs/dmeo does not exist (did you mean logs/demo?): give a clip_jax run directory",
            "logs/empty": "logs/empty is an empty folder: no complete checkpoint in it",
            "logs/demo": "the clip_jax run logs/demo has no complete checkpoint yet (logs/demo/checkpoints holds none)"}


# Every command that takes a model, with its model path as PATH and, where it has one, another argument that is
# also wrong (a dataset that is not there): what is at the model path is said first.
COMMANDS = [
    (zeroshot_cli, ["--checkpoint", "PATH", "--demo", "--imagenet-val", "no/such/imagenet"]),
    (benchmark_cli, ["eval", "--pretrained", "PATH", "--dataset", "wds/nowhere", "--dataset_root", "no/such/root"]),
    (embed, ["--input_dataset", "photos", "--output_folder", "embeddings", "--clip_model", "PATH"]),
    (export, ["PATH", "exported"]),
    (weight_files, ["PATH", "params.npz", "--model", "ViT-B-32"]),
    (similarity, ["--checkpoint", "PATH", "--images", "no/such/photos", "--labels", " "]),
    (clip_score, ["--checkpoint", "PATH", "--images", "no/such/photos", "--output", "scores.csv"]),
]


@pytest.mark.parametrize("command, argv", COMMANDS, ids=[c[0].__name__.split(".")[-1] for c in COMMANDS])
def test_every_command_says_first_what_is_at_a_model_path_that_holds_no_model(command, argv, wrong_model_paths,
                                                                              capsys):
    for path, said in wrong_model_paths.items():
        if command is weight_files and path == "logs/demo":
            said = "logs/demo is a clip_jax run directory: convert takes a weights file"
        assert command.main([path if a == "PATH" else a for a in argv]) == 2, path
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and said in err, err
    assert not any(os.path.exists(p) for p in ("exported", "embeddings", "scores.csv"))


def test_a_training_or_fine_tuning_start_says_what_is_at_its_pretrained_path_before_anything_is_built(
        wrong_model_paths, tmp_path):
    for path, said in wrong_model_paths.items():
        c = default_config()
        c.train_data, c.pretrained, c.make_train_data = "/data/{0..1}.tar", path, "fashion-mnist"
        with pytest.raises(InvalidInput, match="^bad config: .*") as error:
            check_config(c, num_devices=8)
        missing = path == "logs/dmeo"  # told by the config check, in its words
        assert ("pretrained='logs/dmeo' does not exist (did you mean logs/demo?): give" if missing else said) in (
            str(error.value))

        c = default_finetune_config()
        c.update(pretrained=path, data=str(tmp_path / "fashion-mnist"), make_data="fashion-mnist",
                 logs=str(tmp_path / "finetune-logs"), report_to="none")
        with pytest.raises(UserError) as error:
            Trainer(c)
        assert ("pretrained='logs/dmeo' does not exist (did you mean logs/demo?)" if missing else said) in (
            str(error.value))
        assert not (tmp_path / "fashion-mnist").exists()  # the demo's data is not written for a start that fails
