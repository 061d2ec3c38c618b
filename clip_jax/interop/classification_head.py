"""A classification head beside an exported model: `classification_head.npz` in the export folder.

    weights      float32 [E, C]   logits = encode_image(image) @ weights + bias, with encode_image's
    bias         float32 [C]      L2-normalised embedding (OpenCLIP's `encode_image(x, normalize=True)`)
    class_names  str [C]          label i's name
    alpha        float32 []       the WiSE-FT mixing weight the folder's model and head were made with

A plain NumPy archive (`numpy.load(path)`, no pickle): any framework reads it. The model beside it is a whole CLIP
model (both towers; `open_clip.create_model_and_transforms("local-dir:FOLDER")`), so it still does zero-shot.
"""

import os
from collections.abc import Sequence

import numpy as np

from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.runtime import ownership

HEAD_FILE = "classification_head.npz"


def write_head(folder: str, weights: np.ndarray, bias: np.ndarray, class_names: Sequence[str], *,
               alpha: float) -> str:
    """Writes the head into `folder` (refused when a file of that name there is not clip_jax's); returns its path."""
    weights, bias = np.asarray(weights, np.float32), np.asarray(bias, np.float32)
    if weights.ndim != 2 or bias.shape != (weights.shape[1],) or len(class_names) != weights.shape[1]:
        raise InvalidInput(f"a head needs weights [E, C], bias [C] and C class names; got {weights.shape}, "
                           f"{bias.shape} and {len(class_names)} names")
    ownership.claim(folder, [HEAD_FILE], writing="the classification head", change="give another export folder")
    path = os.path.join(folder, HEAD_FILE)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "wb") as f:
        np.savez(f, weights=weights, bias=bias, class_names=np.asarray(list(class_names), dtype=str),
                 alpha=np.float32(alpha))
    os.replace(partial, path)
    return path


def read_head(folder: str) -> dict:
    """`{"weights", "bias", "class_names" (a tuple), "alpha"}` of the head in export folder `folder`."""
    path = os.path.join(folder, HEAD_FILE)
    if not os.path.isfile(path):
        raise MissingInput(f"{path} does not exist: {folder} holds no classification head")
    try:
        with np.load(path, allow_pickle=False) as f:
            head = {"weights": f["weights"], "bias": f["bias"], "class_names": tuple(str(c) for c in f["class_names"]),
                    "alpha": float(f["alpha"])}
    except (OSError, ValueError, KeyError) as e:
        raise InvalidInput(f"{path} is not a classification head ({type(e).__name__}: {e})") from None
    return head
