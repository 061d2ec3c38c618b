"""Precision policies: the dtype parameters are stored in and the dtype the towers compute in.

| policy      | params (and optimizer state) | activations and matmuls |
| ----------- | ---------------------------- | ----------------------- |
| `fp32`      | float32                      | float32 (default matmul precision: TF32 on Ampere+) |
| `bf16`      | float32                      | bfloat16                |
| `pure_bf16` | bfloat16                     | bfloat16                |
| `fp16`      | float32                      | float16, under a dynamic loss scale |
| `fp8`       | float32                      | bfloat16; the residual blocks' matmuls in FP8 (below) |

`fp8` runs each residual block's four matmuls (in_proj, out_proj, c_fc, c_proj) in FP8, each operand scaled by
its own amax in every step (no scaling state: the train state and checkpoints are bf16's, so a run resumes from
and into bf16): e4m3 for activations and weights, e5m2 for output gradients, the weight gradients 16-bit
(`mixed_precision.fp8_dense`). It needs FP8 matmuls on a GPU (compute capability 8.9 or later: H100, H200, L40S,
...; `check_fp8`); XLA emulates them on a CPU.

Under every policy the norms, the features, the logits, the softmax and the loss are float32 (the model
returns fp32 features; the loss casts). A policy changes dtypes only, never the parameter tree; `fp16` also owns
its loss scale, kept in the train state's `policy_state` slot (`training.policy_state`), which a resume under
another policy drops or starts afresh, in one line. So a run can resume under another one.

Gradients are summed over the batch, and so across devices, in `grad_reduce_dtype`: "float32" by default under
every policy (as OpenCLIP's DDP sums float32 gradients), "bfloat16" to let a 16-bit policy sum them in its compute
dtype (half the bytes of the gradient all-reduce, with an 8-bit mantissa for every partial sum). Under `fp32` they
are float32 whatever it says.

The residual stream between the transformer blocks is in `residual_dtype`: "compute" (the compute dtype),
"float32", or "auto" (the default): float32 under `fp16`, the compute dtype under every other policy. OpenCLIP
under torch's autocast keeps it in float32 (its embeddings are float32 parameters added to the stream, and each
block's 16-bit branch output is added into it). The compute dtype halves the bytes the backward keeps at every block
boundary and every LayerNorm input, which decides whether ViT-L/14 fits without remat (benchmarks/RESULTS.md section
19, with the measured distance of each from the fp32 step); float16's range (largest value 65504) is why `fp16`
keeps a float32 stream: a forward that overflows there is not rescued by any loss scale.
"""

import dataclasses

import jax
import jax.numpy as jnp

from clip_jax.errors import InvalidInput


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    param_dtype: jnp.dtype
    compute_dtype: jnp.dtype
    fp8: bool = False  # the residual blocks' matmuls in FP8
    loss_scaling: bool = False  # gradients computed from a dynamically scaled loss (float16's narrow range)


POLICIES = {
    "fp32": PrecisionPolicy("fp32", jnp.float32, jnp.float32),
    "bf16": PrecisionPolicy("bf16", jnp.float32, jnp.bfloat16),
    "pure_bf16": PrecisionPolicy("pure_bf16", jnp.bfloat16, jnp.bfloat16),
    "fp16": PrecisionPolicy("fp16", jnp.float32, jnp.float16, loss_scaling=True),
    "fp8": PrecisionPolicy("fp8", jnp.float32, jnp.bfloat16, fp8=True),
}


GRAD_REDUCE_DTYPES = ("float32", "bfloat16")
RESIDUAL_DTYPES = ("auto", "compute", "float32")


def model_residual_dtype(policy: PrecisionPolicy, residual_dtype: str):
    """The model's `residual_dtype` for a policy and the config's: None (the policy's compute dtype) or float32
    ("float32", or "auto" under float16 compute)."""
    if residual_dtype not in RESIDUAL_DTYPES:
        raise InvalidInput(f"residual_dtype={residual_dtype!r}: choose one of {RESIDUAL_DTYPES}")
    float16 = jnp.dtype(policy.compute_dtype) == jnp.float16
    return jnp.dtype(jnp.float32) if residual_dtype == "float32" or (residual_dtype == "auto" and float16) else None


def model_grad_dtype(policy: PrecisionPolicy, grad_reduce_dtype: str):
    """The model's `grad_dtype` for a policy and a `grad_reduce_dtype`: float32 where the compute dtype is narrower
    and float32 is asked for, else None (autodiff's gradients, in the compute dtype)."""
    if grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
        raise InvalidInput(f"grad_reduce_dtype={grad_reduce_dtype!r}: choose one of {GRAD_REDUCE_DTYPES}")
    if grad_reduce_dtype != "float32" and policy.loss_scaling:
        raise InvalidInput(f"grad_reduce_dtype={grad_reduce_dtype!r} under a loss-scaled policy would sum the scaled "
                           "gradients in float16's range: keep grad_reduce_dtype='float32'")
    if grad_reduce_dtype == "float32" and jnp.dtype(policy.compute_dtype).itemsize < 4:
        return jnp.dtype(jnp.float32)
    return None


# OpenCLIP's --precision names that are another name here
OPEN_CLIP_NAMES = {"amp": "fp16"}


def open_clip_hint(name: str) -> str:
    """"; did you mean ..." for OpenCLIP's name of a policy, else ""."""
    if name not in OPEN_CLIP_NAMES:
        return ""
    return f"; did you mean {OPEN_CLIP_NAMES[name]!r}? (OpenCLIP's {name!r} is float16 mixed precision)"


def get_policy(name: str) -> PrecisionPolicy:
    if name not in POLICIES:
        raise InvalidInput(f"unknown precision policy '{name}'; choose one of {sorted(POLICIES)}{open_clip_hint(name)}")
    return POLICIES[name]


def check_fp8(precision: str, gpu) -> None:
    """Refuses `precision="fp8"` on a GPU (`runtime.hardware.GPU`) without FP8 matmuls; None (a CPU, or a GPU of
    unknown kind) passes."""
    if get_policy(precision).fp8 and gpu is not None and not gpu.has_fp8:
        raise InvalidInput(f"precision='fp8' needs FP8 matmuls (compute capability 8.9 or later: H100, H200, L40S, "
                           f"...), which a {gpu.name} does not have: use --config.precision=bf16")


def check_gpu_precision(precision: str, gpu) -> None:
    """Refuses a policy a GPU (`runtime.hardware.GPU`) cannot run: FP8 matmuls (`check_fp8`), or bfloat16 ones on a
    GPU before Ampere (T4, V100), whose mixed precision is `fp16`. None (a CPU, or a GPU of unknown kind) passes."""
    check_fp8(precision, gpu)
    if gpu is not None and not gpu.has_bf16 and jnp.dtype(get_policy(precision).compute_dtype) == jnp.bfloat16:
        raise InvalidInput(f"precision={precision!r} needs bfloat16 matmuls (compute capability 8.0 or later), which "
                           f"a {gpu.name} does not have: use --config.precision=fp16 (float16 with a loss scale)")


def bf16_recommendation(precision: str, gpu) -> str | None:
    """The line a run under a loss-scaled policy on a GPU with bfloat16 logs (else None): bf16 has float32's range,
    so it needs no loss scale and skips no step."""
    if gpu is None or not gpu.has_bf16 or not get_policy(precision).loss_scaling:
        return None
    return (f"precision={precision!r} on a {gpu.name}, which has bfloat16: --config.precision=bf16 is recommended "
            "(float32's range: no loss scale to find, no step skipped on overflow)")


def cast_params(params, policy: PrecisionPolicy):
    """Floating-point leaves cast to the policy's parameter dtype; other leaves untouched."""

    def cast(leaf):
        return leaf.astype(policy.param_dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf

    return jax.tree.map(cast, params)
