"""clip_jax and the outside world: the model opener (`opener.open_model`: what a path holds), OpenCLIP and
transformers weights both ways, pretrained starts, export to OpenCLIP's and transformers' folders, the inference
API (`create_model_and_transforms`), and `similarity`: a model's predictions on your own images."""

import functools

from clip_jax import import_submodule

__getattr__ = functools.partial(import_submodule, __name__)  # clip_jax.interop.convert after `import clip_jax`
