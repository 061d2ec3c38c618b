"""One sharded train step on 8 devices equals the same step on 1; accumulation equals the full batch."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from tiny_model import SGD, SGD_LR, assert_same_update
from xla_flags import run_once

from clip_jax.models import create_model, init_params, param_shapes
from clip_jax.runtime.mesh import (batch_sharding, create_mesh, fsdp_data_size, fsdp_leaf_spec, fsdp_spec,
                                   make_global_batch)
from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step
from clip_jax.training.train_step import TrainState, merge_micro_batches, split_micro_batches

GLOBAL_BATCH = 32


@pytest.fixture(scope="module")
def model(tiny_model_config):
    return create_model(tiny_model_config)


@pytest.fixture(scope="module")
def params(model):
    return jax.tree.map(np.asarray, init_params(model, jax.random.key(0)))


@pytest.fixture(scope="module")
def batch(random_batch):
    return random_batch(GLOBAL_BATCH)


def sgd_step(config, params, batch, *, n_devices, accum_steps=1, fsdp=False, remat_policy="none"):
    """(params after one SGD step of `config`'s model as numpy, metrics) on the first `n_devices` devices."""
    mesh = create_mesh(jax.devices()[:n_devices])
    spec = StepSpec(config, remat_policy=remat_policy, fsdp=fsdp, optimizer=SGD, accum_steps=accum_steps)
    step = build_step(spec, mesh)
    state, metrics = run_once(step.update, step.state_from_params(params), make_global_batch(batch, mesh))
    return jax.tree.map(np.asarray, state.params), {k: float(v) for k, v in metrics.items()}


@pytest.fixture(scope="module")
def one_device_step(model, params, batch):
    return sgd_step(model.config, params, batch, n_devices=1)


@pytest.fixture(scope="module")
def eight_device_step(model, params, batch):
    return sgd_step(model.config, params, batch, n_devices=8)


@pytest.mark.slow
def test_eight_devices_equal_one_device(params, one_device_step, eight_device_step):
    (after_1, metrics_1), (after_8, metrics_8) = one_device_step, eight_device_step
    assert_same_update(params, after_8, after_1)
    for name in ("loss", "accuracy", "logit_scale", "grad_norm"):
        assert metrics_8[name] == pytest.approx(metrics_1[name], rel=1e-5), name
    assert np.isfinite(metrics_1["loss"]) and metrics_1["loss"] > 0
    assert metrics_1["learning_rate"] == SGD_LR
    # SGD moved every parameter by -lr * grad: the reported norm is the norm of that move over lr
    moves = jax.tree.map(lambda a, b: (np.float64(a) - b) / SGD_LR, params, after_1)
    grad_norm = np.sqrt(sum(np.sum(m**2) for m in jax.tree.leaves(moves)))
    assert metrics_1["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)


@pytest.mark.slow
def test_fsdp_equals_replicated(model, params, batch, eight_device_step):
    after, metrics = sgd_step(model.config, params, batch, n_devices=8, fsdp=True)
    assert_same_update(params, after, eight_device_step[0])
    assert metrics["loss"] == pytest.approx(eight_device_step[1]["loss"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("accum_steps", [4])  # micro-batches of one row per device
def test_accumulation_with_fsdp_and_remat_equals_full_batch(model, params, batch, eight_device_step, accum_steps):
    after, metrics = sgd_step(model.config, params, batch, n_devices=8, accum_steps=accum_steps, fsdp=True,
                              remat_policy="nothing_saveable")
    assert_same_update(params, after, eight_device_step[0])
    for name in ("loss", "accuracy", "logit_scale", "grad_norm"):
        assert metrics[name] == pytest.approx(eight_device_step[1][name], rel=1e-5), name


@pytest.mark.slow
def test_adamw_step_with_fsdp_shards_state_clamps_scale_and_donates(model, params, batch):
    adamw = OptimizerSpec(lr=1e-3, warmup=5, total_steps=100, weight_decay=0.2, grad_clip_norm=1.0)
    step = build_step(StepSpec(model.config, fsdp=True, optimizer=adamw), create_mesh())
    mesh = step.mesh
    start = {**params, "logit_scale": np.float32(4.7)}  # above ln(100): the step must clamp it
    state = step.state_from_params(start)

    kernel = state.params["visual"]["transformer"]["resblocks"]["mlp"]["c_fc"]["kernel"]  # [layers, 64, 256]
    assert kernel.sharding.spec == P(None, None, "data")
    assert kernel.addressable_shards[0].data.shape == (2, 64, 32)
    adam_state = state.opt_state[1][0]
    assert adam_state.mu["visual"]["transformer"]["resblocks"]["mlp"]["c_fc"]["kernel"].sharding.spec == P(
        None, None, "data"
    )
    assert state.params["visual"]["ln_pre"]["scale"].sharding.spec == P()  # small: replicated

    old_kernel = kernel
    for expected_step in (1, 2):
        state, metrics = step(state, make_global_batch(batch, mesh))
        assert int(state.step) == expected_step
        assert metrics["learning_rate"] == pytest.approx(1e-3 * expected_step / 5)
        if expected_step == 1:  # Adam moved it by about lr from 4.7: still above the bound, so clamped
            assert float(state.params["logit_scale"]) == pytest.approx(math.log(100), rel=1e-7)
        assert float(state.params["logit_scale"]) <= np.float32(math.log(100))
    assert old_kernel.is_deleted()  # the old state was donated
    assert state.params["visual"]["transformer"]["resblocks"]["mlp"]["c_fc"]["kernel"].sharding.spec == P(
        None, None, "data"
    )
    assert isinstance(state, TrainState) and np.isfinite(metrics["loss"])


def test_micro_batches_take_rows_from_every_shard_and_merge_back():
    x = np.arange(16)  # 4 shards of 4 rows, 2 micro-batches of 8
    micro = np.asarray(split_micro_batches(jnp.asarray(x), accum_steps=2, n_shards=4))
    np.testing.assert_array_equal(micro, [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]])
    np.testing.assert_array_equal(merge_micro_batches(micro, n_shards=4), x)


def test_batch_not_divisible_by_devices_times_micro_batches_is_rejected(model, params, batch):
    step = build_step(StepSpec(model.config, optimizer=SGD, accum_steps=3), create_mesh())
    with pytest.raises(ValueError, match="divisible by devices x accum_steps = 8 x 3"):
        step(step.state_from_params(params), make_global_batch(batch, step.mesh))


def test_global_batch_from_process_rows():
    mesh = create_mesh()
    rows = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    global_batch = make_global_batch({"images": rows}, mesh)
    assert global_batch["images"].sharding.is_equivalent_to(batch_sharding(mesh), 2)
    np.testing.assert_array_equal(global_batch["images"], rows)
    with pytest.raises(ValueError, match="multiple of the 8 local devices"):
        make_global_batch({"images": rows[:12]}, mesh)


def test_fsdp_spec_splits_the_largest_divisible_dim_and_keeps_layers_and_small_leaves_whole():
    assert fsdp_spec((1024, 4096), 8) == P(None, "data")
    assert fsdp_spec((4096, 1000), 8) == P("data", None)
    assert fsdp_spec((24, 1024, 3072), 8, stacked=True) == P(None, None, "data")
    assert fsdp_spec((64, 300), 8, stacked=True, min_size=1) == P()  # only the layer axis divides
    assert fsdp_spec((257, 1023), 8, min_size=1) == P()  # nothing divides
    assert fsdp_spec((8, 8), 8) == P()  # too small to be worth splitting
    assert fsdp_spec((1024, 4096), 1) == P()


def test_fsdp_grid_is_the_largest_split_every_large_leaf_allows(tiny_model_config):
    vit_l_14 = param_shapes(create_model("ViT-L-14"))
    assert fsdp_data_size(vit_l_14, 384) == 128  # 1024 and 4096 divide by 128, not by 384 (= 3 x 128)
    assert fsdp_data_size(vit_l_14, 256) == 256  # a power of two: every leaf splits, the mesh stays 1-D
    devices = jax.devices()[:6]
    mesh = create_mesh(devices, fsdp_params=param_shapes(create_model(tiny_model_config)))  # widths 32 and 64: 2 of 6
    assert dict(mesh.shape) == {"replica": 3, "data": 2}
    assert list(mesh.devices.flat) == devices  # the same order: the batch lands where a 1-D mesh puts it
    assert dict(create_mesh(devices).shape) == {"data": 6}  # without FSDP, no grid
    # On the grid: split over every device where a dimension allows (192 = 6 x 32), else over "data".
    assert fsdp_leaf_spec(mesh, (128, 192)) == P(None, ("replica", "data"))
    assert fsdp_leaf_spec(mesh, (64, 256)) == P(None, "data")
    assert fsdp_leaf_spec(mesh, (2, 64, 256), stacked=True) == P(None, None, "data")


@pytest.mark.slow
def test_fsdp_on_a_replica_grid_equals_replicated(model, params, random_batch):
    """6 devices, weights of width 32 and 64: most leaves split 2 ways over a 3 x 2 grid. One SGD step equals the
    replicated step on the same devices, leaf by leaf; the state is split as the grid says."""
    batch, devices = random_batch(24), jax.devices()[:6]

    def step_on(mesh, fsdp):  # (the c_fc kernel's spec and shard shape, params after one step, metrics)
        step = build_step(StepSpec(model.config, fsdp=fsdp, optimizer=SGD), mesh)
        state = step.state_from_params(params)
        kernel = state.params["visual"]["transformer"]["resblocks"]["mlp"]["c_fc"]["kernel"]  # [2, 64, 256]
        layout = kernel.sharding.spec, kernel.addressable_shards[0].data.shape
        state, metrics = run_once(step.update, state, make_global_batch(batch, mesh))
        return layout, jax.tree.map(np.asarray, state.params), metrics

    layout, after, metrics = step_on(create_mesh(devices, fsdp_params=param_shapes(model)), fsdp=True)
    assert layout == (P(None, None, "data"), (2, 64, 128))
    _, expected, expected_metrics = step_on(create_mesh(devices), fsdp=False)
    assert_same_update(params, after, expected)
    assert float(metrics["loss"]) == pytest.approx(float(expected_metrics["loss"]), rel=1e-6)


def test_step_spec_refuses_what_no_step_compiles(tiny_model_config):
    for fields, message in [({"precision": "fp12"}, "unknown precision policy 'fp12'"),
                            ({"attention_impl": "auto"}, "resolve 'auto'"), ({"accum_steps": 0}, "accum_steps"),
                            ({"loss": "sigmoid"}, "loss 'sigmoid'")]:
        with pytest.raises(ValueError, match=message):
            StepSpec.for_model(tiny_model_config, **fields)
    with pytest.raises(ValueError, match="optimizer 'lamb'"):
        OptimizerSpec("lamb")


# Activations dominate its step's memory (65 tokens per image, 4 heads, batch 32 per device), as in real runs.
MEMORY_MODEL = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 4, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 256, "width": 64, "heads": 4, "layers": 2},
}


def compiled_step_memory(model, n_devices: int, per_device_batch: int, *, fsdp: bool):
    """XLA's memory analysis of the AdamW train step for `n_devices`, compiled from abstract inputs."""
    step = build_step(StepSpec(model.config, fsdp=fsdp), create_mesh(jax.devices()[:n_devices]))
    return step.compile(per_device_batch).memory_analysis()


@pytest.mark.slow
def test_fsdp_memory_per_device_does_not_grow_with_the_device_count():
    """At a fixed per-device batch, the FSDP step's temporaries stay flat from 2 to 8 devices (activations split
    over the batch, weights gathered where used), and a device holds less than a replica does."""
    model = create_model(MEMORY_MODEL)
    fsdp = {n: compiled_step_memory(model, n, 32, fsdp=True) for n in (2, 4, 8)}
    replica = compiled_step_memory(model, 8, 32, fsdp=False)
    for n in (4, 8):
        assert fsdp[n].temp_size_in_bytes <= 1.02 * fsdp[2].temp_size_in_bytes, n

    def total(m):
        return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes

    assert total(fsdp[8]) < total(replica)
    # Beyond a replica's temporaries, FSDP's hold at most the full weights it gathers (a replica's arguments).
    param_bytes = 4 * sum(math.prod(s.shape) for s in jax.tree.leaves(
        jax.eval_shape(lambda rng: init_params(model, rng), jax.random.key(0))))
    assert fsdp[8].temp_size_in_bytes <= replica.temp_size_in_bytes + param_bytes
    assert fsdp[8].argument_size_in_bytes < replica.argument_size_in_bytes / 2  # the split state
