"""CLIP training in JAX/Flax, compatible with OpenCLIP checkpoints.

The core (models, tokenizers, conversion, loss, train step) imports neither TensorFlow nor clu, so it runs in a
bare JAX image. Names below load on first use, so that `import clip_jax.text.clip_tokenizer` (in data workers) stays
light; so do the subpackages and modules, so that after `import clip_jax` a dotted name such as
`clip_jax.interop.convert.from_open_clip` works as written.

The one process-wide setting made at import: jaxlib's CUDA plugin's start-up traceback is left out on a machine
without a GPU (`clip_jax.cuda_plugin`), so that a script using the library is as quiet as the commands.
"""

import importlib
import importlib.util

from clip_jax import cuda_plugin

__version__ = "0.1.0"
cuda_plugin.quiet_cuda_plugin()

_EXPORTS = {
    "CLIPConfig": "clip_jax.models",
    "create_model": "clip_jax.models",
    "create_model_and_transforms": "clip_jax.interop.inference",
    "get_tokenizer": "clip_jax.interop.inference",
    "get_model_config": "clip_jax.models",
    "init_params": "clip_jax.models",
    "list_models": "clip_jax.models",
    "load_pretrained": "clip_jax.interop.opener",
    "open_model": "clip_jax.interop.opener",
    "tokenize": "clip_jax.text.clip_tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    return import_submodule(__name__, name)


def import_submodule(package: str, name: str):
    """`package.name` imported, for a package's `__getattr__`: a module of the package loads when first named."""
    if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
        return importlib.import_module(f"{package}.{name}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
