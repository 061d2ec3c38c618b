"""Precision policies: the dtype parameters are stored in and the dtype the towers compute in.

| policy      | params (and optimizer state) | activations and matmuls |
| ----------- | ---------------------------- | ----------------------- |
| `fp32`      | float32                      | float32 (default matmul precision: TF32 on Ampere+) |
| `bf16`      | float32                      | bfloat16                |
| `pure_bf16` | bfloat16                     | bfloat16                |

Under every policy the norms, the features, the logits, the softmax and the loss are float32 (the model
returns fp32 features; the loss casts). A policy changes dtypes only, never the parameter tree, so a run can
resume under another one.
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


POLICIES = {
    "fp32": PrecisionPolicy("fp32", jnp.float32, jnp.float32),
    "bf16": PrecisionPolicy("bf16", jnp.float32, jnp.bfloat16),
    "pure_bf16": PrecisionPolicy("pure_bf16", jnp.bfloat16, jnp.bfloat16),
}


def get_policy(name: str) -> PrecisionPolicy:
    if name not in POLICIES:
        raise InvalidInput(f"unknown precision policy '{name}'; choose one of {sorted(POLICIES)}")
    return POLICIES[name]


def cast_params(params, policy: PrecisionPolicy):
    """Floating-point leaves cast to the policy's parameter dtype; other leaves untouched."""

    def cast(leaf):
        return leaf.astype(policy.param_dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf

    return jax.tree.map(cast, params)
