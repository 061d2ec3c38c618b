"""Spike telemetry: its values against numpy from independently computed gradients, its place in metrics.jsonl
and TensorBoard of a short run, its events on a NaN rollback, and the switch that turns it off."""

import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from trainer_run import nan_after, tiny_config

from clip_jax.training import trainer as train_lib
from clip_jax.training.stability import InstabilityMonitor
from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step, mesh_for

B2, EPS = 0.98, 1e-6


def independent_grads(model, params, batch):
    """The CLIP loss's gradient on one device, written out here: the mean of the two cross-entropies of
    scale * image_features @ text_features.T against the diagonal."""

    def loss(params):
        image_features, text_features, scale = model.apply({"params": params}, batch["images"], batch["tokens"])
        logits = scale * image_features @ text_features.T
        labels = jnp.arange(logits.shape[0])
        image_loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        text_loss = optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()
        return (image_loss + text_loss) / 2

    return jax.device_get(jax.grad(loss)(params))


def block_leaves(tree, root):
    """{name: [layers, ...] float64} of the block stack under `root` ('visual/transformer' or 'transformer')."""
    node = tree
    for key in root.split("/"):
        node = node[key]
    return {jax.tree_util.keystr(p): np.asarray(x, np.float64)
            for p, x in jax.tree_util.tree_flatten_with_path(node["resblocks"])[0]}


def per_block_rms(leaves: dict) -> np.ndarray:
    total = sum(np.sum(x.reshape(x.shape[0], -1) ** 2, axis=1) for x in leaves.values())
    count = sum(np.prod(x.shape[1:]) for x in leaves.values())
    return np.sqrt(total / count)


@pytest.mark.slow
def test_telemetry_equals_numpy_from_independent_gradients(tiny_model_config, random_batch):
    spec = StepSpec.for_model(tiny_model_config, optimizer=OptimizerSpec(lr=1e-3, b2=B2, eps=EPS), telemetry_every=2)
    step = build_step(spec, mesh_for(spec, jax.devices()[:1]))
    batches = [random_batch(8), {k: v[::-1].copy() for k, v in random_batch(8).items()}]
    state = step.init(0)
    params = [jax.device_get(state.params)]
    metrics = []
    for batch in batches:
        state, m = step(state, batch)
        params.append(jax.device_get(state.params))
        metrics.append(jax.device_get(m))
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(metrics[0]["telemetry"]))  # step 1: not due
    telemetry = metrics[1]["telemetry"]
    grads = [independent_grads(step.model, params[i], batches[i]) for i in range(2)]
    for tower, root in (("visual", "visual/transformer"), ("text", "transformer")):
        g1, g2 = block_leaves(grads[0], root), block_leaves(grads[1], root)
        np.testing.assert_allclose(telemetry[tower]["grad_rms"], per_block_rms(g2), rtol=1e-4)
        change = {k: block_leaves(params[2], root)[k] - block_leaves(params[1], root)[k] for k in g2}
        np.testing.assert_allclose(telemetry[tower]["update_rms"], per_block_rms(change), rtol=1e-3)
        # Adam's second moment after two updates, bias-corrected
        v_hat = {k: (B2 * (1 - B2) * g1[k] ** 2 + (1 - B2) * g2[k] ** 2) / (1 - B2**2) for k in g2}
        ratios = {k: np.abs(g2[k]) / np.sqrt(np.maximum(v_hat[k], EPS**2)) for k in g2}
        np.testing.assert_allclose(telemetry[tower]["rms_ratio"], per_block_rms(ratios), rtol=1e-4)
        kernel = block_leaves(params[2], root)["['attn']['in_proj']['kernel']"][-1]
        width = kernel.shape[0]
        np.testing.assert_allclose(telemetry[tower]["q_norm"], np.linalg.norm(kernel[:, :width]), rtol=1e-5)
        np.testing.assert_allclose(telemetry[tower]["k_norm"], np.linalg.norm(kernel[:, width:2 * width]), rtol=1e-5)


@pytest.fixture(scope="module")
def shards(fashion_mnist_shards):
    """768 Fashion-MNIST training images in 3 shards."""
    return fashion_mnist_shards(768)


def read_tensorboard(run_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    scalars: dict[str, dict[int, float]] = {}
    for path in glob.glob(os.path.join(run_dir, "tensorboard", "events.*")):
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


@pytest.mark.slow
@pytest.mark.parametrize("spike_telemetry", [True, False])
def test_a_run_logs_telemetry_and_its_rollback_as_events(shards, tmp_path, spike_telemetry):
    # 768 samples / 64 per step = 12 steps; a checkpoint at 4 and 8; NaN batches 5-7 roll back to 4
    config = tiny_config(shards, tmp_path, train_num_samples=768, log_every_n_steps=4, save_every_steps=4,
                         report_to="tensorboard", spike_telemetry=spike_telemetry)
    with train_lib.Trainer(config, edit_batch=nan_after({4, 5, 6})) as trainer:
        trainer.train()
    assert trainer.rollbacks == 1
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    events = [r for r in records if "event" in r]
    assert [e["event"] for e in events] == ["non_finite_step"] * 3 + ["rollback"]
    assert [e["step"] for e in events] == [5, 6, 7, 7]
    assert events[-1]["to_step"] == 4 and "3 non-finite steps" in events[-1]["reason"]
    logged = {r["step"]: r for r in records if "loss" in r}
    assert sorted(logged) == [4, 8, 12]
    tensorboard = read_tensorboard(tmp_path / "run")
    assert set(tensorboard["events/rollback"]) == {7}
    telemetry_keys = {k for r in logged.values() for k in r if k.startswith("telemetry/")}
    if not spike_telemetry:
        assert not telemetry_keys and not any(k.startswith("telemetry/") for k in tensorboard)
        return
    for tower in ("visual", "text"):
        for name in ("grad_rms", "update_rms", "rms_ratio"):
            for block in (0, 1):  # the trainer's model has two blocks a tower
                key = f"telemetry/{tower}/{name}/block_{block}"
                assert all(logged[s][key] > 0 for s in (4, 8, 12)), key
                assert set(tensorboard[key]) == {4, 8, 12}
        assert all(logged[s][f"telemetry/{tower}/q_norm"] > 0 for s in (4, 8, 12))
    assert "logit_scale" in logged[8]


def test_the_monitor_names_the_kind_of_problem_the_trainer_records():
    monitor = InstabilityMonitor(nan_patience=2, spike_factor=2.0, window=5, min_history=3)
    assert [monitor.observe(1.0, True) for _ in range(3)] == [None] * 3
    assert "loss spike" in monitor.observe(5.0, True) and monitor.last_problem == "loss_spike"
    assert monitor.observe(float("nan"), False) is None
    assert "2 non-finite" in monitor.observe(float("nan"), False) and monitor.last_problem == "non_finite"


@pytest.mark.slow
@pytest.mark.parametrize("option", ["qk_norm", "scaled_cosine_attn"])
def test_telemetry_of_normalised_attention_blocks(tiny_model_config, option):
    """The q/k kernel norms are still found in the packed projection of these blocks; the cosine block also
    reports its largest per-head attention factor, exp of the clamped learned scale, computed here from the
    perturbed parameter itself."""
    from clip_jax.models.clip import create_model, dummy_inputs
    from clip_jax.training.spike_telemetry import step_telemetry

    config = {**tiny_model_config, **{tower: {**tiny_model_config[tower], option: True}
                                      for tower in ("vision_cfg", "text_cfg")}}  # the fixture is shared
    model = create_model(config)
    params = jax.device_get(model.init(jax.random.PRNGKey(0), *dummy_inputs(model.config, 2))["params"])
    scales = {}
    for tower, root in (("visual", params["visual"]["transformer"]), ("text", params["transformer"])):
        attn = root["resblocks"]["attn"]
        if option == "scaled_cosine_attn":  # one head of the last block above the ln 100 clamp, one below init
            raw = np.array(attn["logit_scale"], np.float32)
            raw[-1, 0], raw[-1, -1] = 5.5, 1.0
            attn["logit_scale"] = raw
            scales[tower] = np.exp(min(float(np.max(raw[-1])), np.log(100.0)))
    zeros = jax.tree.map(np.zeros_like, params)
    telemetry = jax.device_get(step_telemetry(zeros, zeros, (), params, b2=B2, eps=EPS))
    for tower, root in (("visual", "visual/transformer"), ("text", "transformer")):
        kernel = block_leaves(params, root)["['attn']['in_proj']['kernel']"][-1]
        width = kernel.shape[0]
        np.testing.assert_allclose(telemetry[tower]["q_norm"], np.linalg.norm(kernel[:, :width]), rtol=1e-5)
        np.testing.assert_allclose(telemetry[tower]["k_norm"], np.linalg.norm(kernel[:, width:2 * width]), rtol=1e-5)
        if option == "scaled_cosine_attn":
            np.testing.assert_allclose(telemetry[tower]["attn_logit_scale"], scales[tower], rtol=1e-6)
            assert scales[tower] == pytest.approx(100.0)
        else:
            assert "attn_logit_scale" not in telemetry[tower]
