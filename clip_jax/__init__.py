"""CLIP training in JAX/Flax, compatible with OpenCLIP checkpoints.

The core (models, tokenizer, conversion, loss, train step) imports neither
TensorFlow nor clu, so it runs in a bare JAX image.
"""

from clip_jax.models import CLIPConfig, create_model, get_model_config, init_params, list_models

__all__ = ["CLIPConfig", "create_model", "get_model_config", "init_params", "list_models"]
__version__ = "0.1.0"
