"""A model's weights in their two forms: a params tree (a ViT model's), or the variables `{"params": ...,
"batch_stats": ...}` of a ResNet image tower (its BatchNorm running statistics beside the params)."""

from collections.abc import Mapping
from typing import Any


def as_variables(weights) -> dict:
    """`weights` (a params tree, or variables with a `params` collection) as the variables `model.apply` takes. A
    CLIP params tree never has a top-level `params` key, so the two cannot be confused."""
    return dict(weights) if isinstance(weights, Mapping) and "params" in weights else {"params": weights}


def params_of(weights) -> dict:
    """The params of `weights` (a params tree or variables): what holds `logit_scale`, `logit_bias`."""
    return as_variables(weights)["params"]


def eval_variables(params, batch_stats=None) -> Any:
    """What evaluation takes of a train state: its params, with its BatchNorm statistics when it has them."""
    return params if batch_stats is None else {"params": params, "batch_stats": batch_stats}
