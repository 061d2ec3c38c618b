"""OpenCLIP-identical CLIP models in Flax linen."""

from clip_jax.models.clip import (CLIP, count_params, create_model, dummy_inputs, init_params, init_variables,
                                  l2_normalize, param_shapes)
from clip_jax.models.config import BlockConfig, CLIPConfig, ResNetVisionConfig, TextConfig, VisionConfig, is_resnet
from clip_jax.models.open_clip_json import open_clip_model_cfg
from clip_jax.models.registry import get_model_config, list_models
from clip_jax.models.remat import remat_policy_names

__all__ = [
    "BlockConfig", "CLIP", "CLIPConfig", "ResNetVisionConfig", "TextConfig", "VisionConfig", "count_params",
    "create_model", "dummy_inputs", "get_model_config", "init_params", "init_variables", "is_resnet", "l2_normalize",
    "list_models", "open_clip_model_cfg", "param_shapes", "remat_policy_names",
]
