"""A tower's residual blocks unrolled (`unroll_layers`): the scanned stack's parameters, outputs and gradients, a
program without the loop whose remat still recomputes, the training config's switch, the planner's flop count, and,
compiled for an H200 without one, a stack that moves fewer memory-bound bytes than the scanned one (no per-layer
stacks of saved activations)."""

import copy
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from clip_jax.models.layers import Transformer
from clip_jax.plan import flops
from clip_jax.run_config import default_config
from clip_jax.runtime import hlo_kernels, xla_gpu
from clip_jax.runtime.hardware import get_gpu
from clip_jax.runtime.mesh import create_mesh
from clip_jax.training.step_factory import StepSpec, build_step

import tiny_model


def stack(unroll: bool, remat: str = "none") -> Transformer:
    return Transformer(32, 3, 2, 64, remat_policy=remat, unroll_layers=unroll)


@functools.partial(jax.jit, static_argnums=2)
def value_and_grads(params, x, model):
    return jax.value_and_grad(lambda p, x: jnp.sum(model.apply(p, x) * jnp.arange(32.0)), (0, 1))(params, x)


@pytest.mark.parametrize("remat", ["none", "dots_saveable"])
def test_an_unrolled_stack_gives_the_scanned_stacks_outputs_and_gradients(remat):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 9, 32)), jnp.float32)
    scanned, unrolled = stack(False, remat), stack(True, remat)
    params = scanned.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, unrolled.init(jax.random.key(0), x))
    (value, grads), (value_u, grads_u) = value_and_grads(params, x, scanned), value_and_grads(params, x, unrolled)
    np.testing.assert_allclose(value_u, value, rtol=1e-6)
    for g_u, g in zip(jax.tree.leaves(grads_u), jax.tree.leaves(grads)):
        np.testing.assert_allclose(g_u, g, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(g))))


def compiled_gradient(model) -> str:
    x = jnp.zeros((2, 9, 32))
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    return value_and_grads.lower(params, x, model).compile().as_text()


def products(hlo: str) -> int:
    return sum(" dot(" in line for line in hlo.splitlines())


def test_an_unrolled_stack_has_no_loop_and_its_remat_still_recomputes_the_forward():
    assert " while(" in compiled_gradient(stack(False))
    unrolled = compiled_gradient(stack(True))
    assert " while(" not in unrolled
    # nothing_saveable recomputes five of each block's six products for the backward pass (in_proj, the two of
    # attention, out_proj, c_fc; not c_proj, whose output the backward does not read): XLA must not merge them with
    # the forward's, as it may once the blocks are no longer a loop's body
    assert products(compiled_gradient(stack(True, "nothing_saveable"))) == products(unrolled) + 3 * 5


def test_a_training_config_switches_the_unrolled_blocks_on():
    config = default_config()
    assert config.unroll_layers is False and StepSpec.from_config(config, platform="cpu").unroll_layers is False
    config.unroll_layers = True
    spec = StepSpec.from_config(config, platform="cpu")
    assert spec.unroll_layers and "layers unrolled" in spec.describe()
    assert spec.create_model().unroll_layers  # both towers take it (the planner's flop count below)


def test_the_planners_flop_count_adds_no_blocks_to_an_unrolled_step():
    """XLA counts a loop's body once, and the planner adds the other blocks of a scanned tower; an unrolled tower's
    blocks are all in the program, so the same forward is counted the same either way."""
    mesh = create_mesh(jax.devices()[:1])

    def forward_flops(unroll):
        spec = StepSpec.for_model(copy.deepcopy(tiny_model.TINY_MODEL), "fp32", "none", unroll_layers=unroll)
        forward = build_step(spec, mesh).compile_forward(2)
        return flops.loop_corrected_flops(forward, spec, 2, train=False), forward

    (scanned, _), (unrolled, forward) = forward_flops(False), forward_flops(True)
    assert " while(" not in forward.as_text()  # neither tower's blocks are a loop
    assert unrolled == pytest.approx(scanned, rel=0.01)


class ScannedAndUnrolled(nn.Module):
    """The same bf16 dots_saveable stack twice in one program, scanned and unrolled (one compile for both)."""

    @nn.compact
    def __call__(self, x):
        options = dict(width=64, layers=3, heads=2, mlp_width=256, dtype=jnp.bfloat16, remat_policy="dots_saveable")
        return sum(Transformer(**options, unroll_layers=unroll, name=name)(x).astype(jnp.float32).sum()
                   for name, unroll in (("scanned", False), ("unrolled", True)))


@pytest.mark.gpu_compile
def test_on_an_h200_the_unrolled_stack_copies_no_saved_activation_into_a_stack_and_moves_fewer_bytes():
    whole = NamedSharding(create_mesh(xla_gpu.devices(get_gpu("h200"), 1, 1)), P())
    model, x = ScannedAndUnrolled(), jax.ShapeDtypeStruct((8, 17, 64), jnp.bfloat16, sharding=whole)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=whole),
                          jax.eval_shape(model.init, jax.random.key(0), x))
    step = jax.jit(jax.grad(model.apply, argnums=(0, 1))).lower(params, x)
    kernels = hlo_kernels.kernels(xla_gpu.compile_lowered(step).as_text())

    def stacked_writes(part):
        return [k.name for k in kernels if f"/{part}/" in k.op_name and "dynamic_update_slice" in k.op_name]

    def memory_bound(part):
        return sum(k.step_bytes for k in kernels
                   if f"/{part}/" in k.op_name and k.kind not in ("gemm", "attention", "collective"))

    assert stacked_writes("scanned") and not stacked_writes("unrolled")
    # 0.88 here (3 blocks of 17 tokens); ViT-L/14's step: benchmarks/RESULTS.md section 36
    assert memory_bound("unrolled") < 0.95 * memory_bound("scanned")
