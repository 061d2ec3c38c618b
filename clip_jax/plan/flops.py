"""FLOPs per sample: the analytic count and XLA's count of the compiled programs, every scanned block counted.

XLA's cost analysis counts the body of a while loop once, whatever its trip count, and the residual blocks of each
tower run as one scanned loop (nn.scan): the forward loop, and in the step the backward loop too. The full count
is therefore the compiled program's count plus (depth - 1) x one block's count, where one block's count is that of
the same scanned stack compiled alone at depth 2 (still a loop, so one body: forward, or forward and backward with
the step's remat policy, dtype and per-device batch). Blocks are identical, so this is exact up to the few ops
outside the loops that the alone-compiled stack adds (a sum). Whether this XLA counts loop bodies once is checked
(a depth-2 and a depth-3 stack counting the same); where it counts every trip, nothing is added. A ResNet image
tower has no loop (its blocks differ in shape and are unrolled): only the text tower's blocks are added; a step with
`unroll_layers` has no loop in either tower, and XLA counts each of its blocks itself.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from clip_jax.models import is_resnet
from clip_jax.models.flops import forward_flops, image_tokens, train_flops
from clip_jax.models.layers import Transformer
from clip_jax.models.precision import get_policy
from clip_jax.plan.steps import compile_train_step
from clip_jax.training.step_factory import StepSpec, build_step

TOWERS = ("image", "text")


@functools.cache
def loop_bodies_counted_once() -> bool:
    """True when XLA's cost analysis ignores trip counts (a depth-3 stack counts as much as a depth-2 one)."""
    def cost(depth: int) -> float:
        stack = Transformer(width=64, layers=depth, heads=2, mlp_width=256)
        x = jax.ShapeDtypeStruct((4, 8, 64), jnp.float32)
        params = jax.eval_shape(stack.init, jax.random.key(0), x)
        return jax.jit(stack.apply).lower(params, x).compile().cost_analysis()["flops"]

    two, three = cost(2), cost(3)
    return three - two < 0.5 * two


def scanned_towers(setup: StepSpec) -> tuple[str, ...]:
    """The towers whose residual blocks run as a scanned loop: both, or the text tower alone beside a ResNet image
    tower (whose bottleneck blocks are unrolled, each counted by XLA), or none when the step unrolls them."""
    if setup.unroll_layers:
        return ()
    return ("text",) if is_resnet(setup.model) else TOWERS


def _tower(setup: StepSpec, tower: str, train: bool = False) -> tuple[int, int, int, int, int, bool]:
    """(width, heads, mlp_width, tokens, layers, causal) of a tower's residual stack (`train`: the image tokens the
    step's blocks see, only the kept patches under patch dropout; a NaFlex tower's at the step's patch budget)."""
    if tower == "image":
        v = setup.model.vision
        return v.width, v.heads, v.mlp_width, image_tokens(v, train, setup.max_num_patches), v.layers, False
    t = setup.model.text
    return t.width, t.heads, t.mlp_width, t.num_tokens, t.layers, not t.no_causal_mask


def block_flops(setup: StepSpec, tower: str, per_device_batch: int, *, train: bool) -> float:
    """XLA's count for one residual block of `tower` (a depth-2 scanned stack, whose loop body is counted once)."""
    width, heads, mlp_width, tokens, _, causal = _tower(setup, tower, train)
    policy = get_policy(setup.precision)
    block = (setup.model.vision if tower == "image" else setup.model.text).block
    stack = Transformer(width, 2, heads, mlp_width, causal=causal, quick_gelu=setup.model.quick_gelu,
                        dtype=policy.compute_dtype, param_dtype=policy.param_dtype, remat_policy=setup.remat_policy,
                        block=block)
    x = jax.ShapeDtypeStruct((per_device_batch, tokens, width), policy.compute_dtype)
    params = jax.eval_shape(stack.init, jax.random.key(0), x)
    if train:
        fn = jax.grad(lambda p, x: jnp.sum(stack.apply(p, x).astype(jnp.float32)), argnums=(0, 1))
    else:
        fn = stack.apply
    return jax.jit(fn).lower(params, x).compile().cost_analysis()["flops"]


def loop_corrected_flops(compiled, setup: StepSpec, per_device_batch: int, *, train: bool) -> float:
    """FLOPs per sample of a compiled forward (train=False) or train step, every block counted."""
    flops = compiled.cost_analysis()["flops"]
    if loop_bodies_counted_once():
        for tower in scanned_towers(setup):
            layers = _tower(setup, tower)[4]
            if layers > 1:
                flops += (layers - 1) * block_flops(setup, tower, per_device_batch, train=train)
    return flops / per_device_batch


@dataclasses.dataclass(frozen=True)
class FlopsPerSample:
    """The `*_xla` fields and `counted_at_batch` are None when XLA's count was not asked for (`analytic_only`)."""

    forward_analytic: float
    forward_xla: float | None
    train_analytic: float  # 3 x forward: the model FLOPs MFU is quoted in
    train_xla: float | None  # the step without remat: also norms, softmax, GELU, the loss and the AdamW update
    remat_extra_analytic: float  # upper bound: every block's forward again
    remat_extra_xla: float | None  # what the remat policy really recomputes (XLA drops recomputation nothing needs)
    counted_at_batch: int | None  # the per-device batch XLA's programs were compiled for


def _remat_extra_analytic(setup: StepSpec) -> float:
    if setup.remat_policy == "none":
        return 0.0
    budget = setup.max_num_patches
    return float(train_flops(setup.model, True, budget) - train_flops(setup.model, max_num_patches=budget))


def analytic_only(setup: StepSpec) -> FlopsPerSample:
    """The analytic counts alone: no program is compiled."""
    budget = setup.max_num_patches
    return FlopsPerSample(float(forward_flops(setup.model, max_num_patches=budget)), None,
                          float(train_flops(setup.model, max_num_patches=budget)), None, _remat_extra_analytic(setup),
                          None, None)


def flops_per_sample(setup: StepSpec, mesh, per_device_batch: int, *,
                     compile_step: Callable[[StepSpec], Any] | None = None) -> FlopsPerSample:
    """Analytic and XLA-counted FLOPs per sample; `compile_step(setup)` may supply (cached) compiled steps."""
    if compile_step is None:
        def compile_step(spec):
            return compile_train_step(spec, mesh, per_device_batch)
    plain = dataclasses.replace(setup, remat_policy="none")
    forward_xla = loop_corrected_flops(build_step(plain, mesh).compile_forward(per_device_batch), plain,
                                       per_device_batch, train=False)
    train_xla = loop_corrected_flops(compile_step(plain), plain, per_device_batch, train=True)
    remat_xla = 0.0
    if setup.remat_policy != "none":
        remat_xla = loop_corrected_flops(compile_step(setup), setup, per_device_batch, train=True) - train_xla
    analytic = analytic_only(setup)
    return dataclasses.replace(analytic, forward_xla=forward_xla, train_xla=train_xla, remat_extra_xla=remat_xla,
                               counted_at_batch=per_device_batch)
