"""A ResNet image tower through the run's life: the trainer (zero-shot and validation in eval mode, a stop and a
resume that restores the BatchNorm statistics), the export that real OpenCLIP loads with the same eval features,
the eval script and `create_model_and_transforms` on the run and the export, and pretrained starts that bring the
statistics along."""

import functools
import json

import jax
import numpy as np
import open_clip
import pytest
import torch
from safetensors.numpy import load_file
from trainer_run import losses, tiny_config

import clip_jax
from clip_jax.data import make_shards
from clip_jax.errors import InvalidInput
from clip_jax.evaluation import ShardedEncoder, zeroshot
from clip_jax.interop import export, similarity, weight_files
from clip_jax.interop.opener import load_pretrained, load_pretrained_variables
from clip_jax.models import create_model
from clip_jax.runtime.mesh import create_mesh
from clip_jax.runtime.run_directory import read_params, read_variables
from clip_jax.training import pretraining
from clip_jax.training import trainer as train_lib

# 32 px (the 28 px shards are cropped up to it), one block a stage: a 1x1 grid at the attention pool.
RUN_RN = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1},
}
STEPS, STOP_AT = 6, 3  # 384 samples, 64 a step
EVAL = {"zeroshot_data": "demo", "zeroshot_samples": 64}

pytestmark = pytest.mark.usefixtures("orbax_writes_replicated_arrays_whole")  # saves not split per device


@pytest.fixture(scope="module", autouse=True)
def one_compiled_step():
    """Every trainer of this module builds the same step: `build_step` is pure, so one per (spec, mesh) is built and
    compiled once (the resumed trainer still restores its state from the checkpoint)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pretraining, "build_step", functools.cache(pretraining.build_step))
        yield


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    model_file = out / "tiny-rn.json"
    model_file.write_text(json.dumps(RUN_RN))
    paths = make_shards.write_shards(make_shards.fashion_mnist_samples("train", limit=384), str(out), 192)
    return make_shards.shard_pattern(paths), str(model_file)


def _config(shards, logs, **overrides):
    return tiny_config(shards, logs, train_num_samples=64 * STEPS, save_every_steps=STOP_AT, **overrides)


@pytest.fixture(scope="module")
def run(shards, tmp_path_factory):
    """An uninterrupted run, evaluated (zero-shot, validation on its own shards) at the end."""
    logs = tmp_path_factory.mktemp("uninterrupted")
    result = train_lib.train(_config(shards, logs, val_data=shards[0], val_num_samples=64, **EVAL))
    return logs / "run", result


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported") / "model"
    assert export.main([str(run[0]), str(out)]) == 0
    return out


def _tree_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def _batch_norm_counts(batch_stats) -> set[int]:
    return {int(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(batch_stats)
            if path[-1].key == "num_batches_tracked"}


@pytest.mark.slow
def test_a_stopped_and_resumed_run_ends_as_the_uninterrupted_one(shards, run, tmp_path, monkeypatch):
    run_dir, result = run
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    assert 0 <= result["zeroshot_top1"] <= 1 and np.isfinite(result["val_loss"])

    config = _config(shards, tmp_path, resume="latest")
    trainer = train_lib.Trainer(config)

    class StopAfterStop:  # the signal arrives once step STOP_AT is done
        received = "SIGTERM"

        def agreed(self):
            return trainer.step == STOP_AT

        def restore(self):
            pass

    with monkeypatch.context() as patch:
        patch.setattr(train_lib, "StopSignal", StopAfterStop)
        with trainer:
            assert trainer.train() == {"stopped_at": STOP_AT}
    with train_lib.Trainer(config) as resumed:
        assert int(resumed.state.step) == STOP_AT
        assert _batch_norm_counts(jax.device_get(resumed.state.batch_stats)) == {STOP_AT}  # restored, not fresh
        resumed.train()

    reference, got = read_variables(str(run_dir)), read_variables(str(tmp_path / "run"))
    assert set(got) == {"params", "batch_stats"}
    assert _batch_norm_counts(got["batch_stats"]) == {STEPS}
    stem = got["batch_stats"]["visual"]["bn1"]
    assert np.abs(stem["mean"]).max() > 1e-3 and np.abs(stem["var"] - 1).max() > 1e-3  # moved off their init
    _tree_equal(got, reference)
    _tree_equal(read_params(str(run_dir)), reference["params"])


@pytest.mark.slow
def test_the_export_loads_in_open_clip_with_the_runs_eval_features(run, exported):
    run_dir, _ = run
    saved = json.loads((exported / "open_clip_config.json").read_text())
    assert saved["model_cfg"]["vision_cfg"]["layers"] == [1, 1, 1, 1]
    state_dict = load_file(str(exported / "open_clip_model.safetensors"))
    assert state_dict["visual.bn1.num_batches_tracked"] == STEPS
    variables = read_variables(str(run_dir))
    np.testing.assert_array_equal(state_dict["visual.layer1.0.bn2.running_var"],
                                  variables["batch_stats"]["visual"]["layer1"]["0"]["bn2"]["var"])

    reference, _, _ = open_clip.create_model_and_transforms(f"local-dir:{exported}")
    reference.eval()
    images = np.random.default_rng(0).standard_normal((4, 32, 32, 3)).astype(np.float32)
    with torch.no_grad():
        expected = reference.encode_image(torch.from_numpy(images).permute(0, 3, 1, 2), normalize=True).numpy()
    for source in (f"local-dir:{exported}", None):  # the export, and the run itself
        model, weights, _, _ = clip_jax.create_model_and_transforms(source, pretrained=None if source else
                                                                    str(run_dir))
        assert set(weights) == {"params", "batch_stats"}
        encode_image = jax.jit(functools.partial(model.apply, method="encode_image"))  # not op by op: seconds
        np.testing.assert_allclose(encode_image(weights, images), expected, atol=1e-5)
    # the evaluations' sharded encoder, in eval mode on the running statistics
    encoder = ShardedEncoder(create_model(RUN_RN), create_mesh())
    np.testing.assert_allclose(encoder.encode_images(encoder.place(variables), images), expected, atol=1e-5)


@pytest.mark.slow
def test_the_eval_script_reads_the_run_and_the_export_as_the_trainer_evaluated(shards, run, exported, tmp_path):
    run_dir, result = run
    top1 = {}
    for name, checkpoint, model in (("run", run_dir, ["--model", shards[1]]), ("export", exported, [])):
        output = tmp_path / f"{name}.json"
        assert zeroshot.main([*model, "--checkpoint", str(checkpoint), "--demo", "--limit", "64", "--no-progress",
                              "--output", str(output)]) == 0
        top1[name] = [m["top1"] for m in json.loads(output.read_text())["results"].values()]
    assert top1["run"] == top1["export"] == [pytest.approx(result["zeroshot_top1"], abs=1e-9)]
    # the similarity demo, on the exported OpenCLIP weights (converted with their statistics)
    assert similarity.main(["--model", shards[1], "--checkpoint", str(exported / "open_clip_model.safetensors")]) == 0


@pytest.mark.slow
def test_a_pretrained_start_brings_params_and_batch_stats(shards, run, exported, tmp_path):
    run_dir, _ = run
    expected = read_variables(str(run_dir))
    npz = tmp_path / "variables.npz"
    weight_files.save_params(str(npz), expected)
    for i, source in enumerate((exported, npz, run_dir)):
        with train_lib.Trainer(_config(shards, tmp_path / str(i), pretrained=str(source))) as trainer:
            state = jax.device_get(trainer.state)
        assert int(state.step) == 0
        _tree_equal({"params": state.params, "batch_stats": state.batch_stats}, expected)


@pytest.mark.slow
def test_what_needs_the_statistics_says_so(run):
    run_dir, _ = run
    with pytest.raises(InvalidInput, match="load_pretrained_variables"):
        load_pretrained(str(run_dir), RUN_RN)
    encoder = ShardedEncoder(create_model(RUN_RN), create_mesh())
    with pytest.raises(InvalidInput, match="running statistics"):
        encoder.place(read_params(str(run_dir)))
    with pytest.raises(InvalidInput, match="batch_stats"):  # a ResNet run is not a ViT model's weights
        load_pretrained_variables(str(run_dir), "ViT-B-32")
