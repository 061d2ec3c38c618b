"""Image features of a classification split, cached: what a linear probe trains and is scored on.

    FEATURE_ROOT/WEIGHTS_KEY/DATASET/SPLIT.npz      features float32 [N, E] (L2-normalised), labels int32 [N]

WEIGHTS_KEY is a hash of the model's weights and of what the images go through before them (image size, mean, std),
so other weights never read these features; DATASET is the dataset's name with `/` made `_`. A file is written whole
under a `.clip_jax-partial` name and then renamed, so a killed run leaves no file that looks complete, and
FEATURE_ROOT's manifest records WEIGHTS_KEY as clip_jax's (`clip_jax.runtime.ownership`): a folder of that name that
clip_jax did not write is refused, never replaced. A cached file whose image count differs from the split's (the
dataset changed) is computed again.
"""

import hashlib
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np

from clip_jax.errors import InvalidInput
from clip_jax.runtime import ownership

PARTIAL_PREFIX = ".clip_jax-partial-"


def weights_key(params, image_size: int, mean: Sequence[float], std: Sequence[float],
                resize_mode: str = "shortest") -> str:
    """A hex digest (16 characters) of every weight (path, dtype, shape, bytes) and the preprocessing (the resize
    named only when it is not the shortest side's: the keys of features cached before it was stay theirs)."""
    preprocessing = (image_size, tuple(map(float, mean)), tuple(map(float, std)))
    digest = hashlib.sha256(repr(preprocessing + ((resize_mode,) if resize_mode != "shortest" else ())).encode())
    for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(params)[0], key=lambda kv: jax.tree_util.keystr(
            kv[0])):
        array = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{jax.tree_util.keystr(path)}:{array.dtype}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()[:16]


def cache_path(feature_root: str, key: str, dataset: str, split: str) -> str:
    return os.path.join(feature_root, key, dataset.replace("/", "_"), f"{split}.npz")


def _read(path: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as f:
            features, labels = f["features"], f["labels"]
    except (OSError, ValueError, KeyError) as e:
        raise InvalidInput(f"cached features {path} cannot be read ({type(e).__name__}: {e}): delete it and they are "
                           "computed again") from None
    if features.ndim != 2 or labels.shape != (len(features),):
        raise InvalidInput(f"cached features {path} hold features {features.shape} and labels {labels.shape}: delete "
                           "it and they are computed again")
    return features, labels


def _write(path: str, features: np.ndarray, labels: np.ndarray) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    partial = os.path.join(folder, f"{PARTIAL_PREFIX}{os.path.basename(path)}.{os.getpid()}.npz")
    with open(partial, "wb") as f:
        np.savez(f, features=features, labels=labels)
    os.replace(partial, path)


def cached_features(feature_root: str | None, key: str, dataset: str, split: str, num_images: int,
                    compute: Callable[[], tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(features [N, E], labels [N]) of `dataset`'s `split`: read from the cache under `feature_root` when it holds
    them for `num_images` images, else `compute()`d and (on process 0) written there. No `feature_root`: no cache."""
    if feature_root is None:
        return compute()
    path = cache_path(feature_root, key, dataset, split)
    if os.path.isfile(path):
        features, labels = _read(path)
        if len(labels) == num_images:
            return features, labels
    if jax.process_index() == 0:  # before the images are encoded: a foreign folder is refused at once
        ownership.claim(feature_root, [key], writing="caching image features", change="give another --feature_root")
    features, labels = compute()
    if jax.process_index() == 0:
        _write(path, np.asarray(features, np.float32), np.asarray(labels, np.int32))
    return features, labels
