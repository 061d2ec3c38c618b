"""The residual blocks' rematerialisation policies, by name: "none" or one of `jax.checkpoint_policies`."""

import jax

from clip_jax.errors import InvalidInput
from clip_jax.models import mixed_precision


def remat_policy_names() -> list[str]:
    """Names accepted as `remat_policy`: "none" (keep every activation) or a policy of `jax.checkpoint_policies`."""
    return ["none"] + sorted(
        name for name, value in vars(jax.checkpoint_policies).items()
        if not name.startswith("_") and callable(value) and name.endswith("saveable")
    )


def resolve_remat_policy(name: str):
    """The `jax.checkpoint` policy for a name; None for "none" (no rematerialisation). A policy that saves matmul
    outputs ("dots_...") also saves those of `mixed_precision.dense`, whose custom VJP hides the matmul from it."""
    if name == "none":
        return None
    if name not in remat_policy_names():
        raise InvalidInput(f"unknown remat_policy {name!r}; choose one of {remat_policy_names()}")
    policies = jax.checkpoint_policies
    policy = getattr(policies, name)
    if name.startswith("dots"):
        return policies.save_from_both_policies(policy, policies.save_only_these_names(mixed_precision.MATMUL_OUTPUT))
    return policy
