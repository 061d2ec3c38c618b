"""Fashion-MNIST, the embedded demo dataset: loading, class names, training captions and zero-shot prompts.

70,000 real 28x28 greyscale photos of 10 kinds of clothing (60,000 train, 10,000 test), MIT licence, shipped by
Debian's ``dataset-fashion-mnist`` package under ``/usr/share/datasets/fashion-mnist``. Training captions combine a
template with a synonym of the class; zero-shot evaluation uses :data:`CLASS_NAMES` with :data:`ZEROSHOT_TEMPLATES`.
"""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np

from clip_jax.errors import InvalidInput, MissingInput

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
SPLITS = {"train": "train", "test": "t10k"}

# Label i of the dataset is CLASS_NAMES[i].
CLASS_NAMES = ("t-shirt", "trousers", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot")

SYNONYMS = (
    ("t-shirt", "tee", "top", "short-sleeved top"),
    ("trousers", "pants", "pair of trousers", "slacks"),
    ("pullover", "sweater", "jumper", "knitted sweater"),
    ("dress", "frock", "gown", "summer dress"),
    ("coat", "jacket", "overcoat", "winter coat"),
    ("sandal", "summer sandal", "strappy sandal", "open-toe shoe"),
    ("shirt", "button-up shirt", "collared shirt", "blouse"),
    ("sneaker", "trainer", "running shoe", "athletic shoe"),
    ("bag", "handbag", "purse", "tote bag"),
    ("ankle boot", "boot", "short boot", "bootie"),
)

# "{}" is a noun phrase with its article, e.g. "an ankle boot".
CAPTION_TEMPLATES = (
    "a photo of {}.",
    "a black and white photo of {}.",
    "a small greyscale picture of {}.",
    "{} on a black background.",
    "a product photo of {}.",
    "a low resolution photo of {}.",
    "a catalogue image showing {}.",
    "this is {}.",
)

ZEROSHOT_TEMPLATES = (
    "a photo of {}.",
    "a black and white photo of {}.",
    "a low resolution photo of {}.",
    "a product photo of {}.",
)

_PLURAL = {"trousers", "pants", "slacks"}


def with_article(noun: str) -> str:
    """``"ankle boot"`` -> ``"an ankle boot"``; plurals (``"trousers"``) take none."""
    if noun in _PLURAL:
        return noun
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def zeroshot_prompts(class_name: str) -> list[str]:
    """The zero-shot prompts of one class."""
    return [template.format(with_article(class_name)) for template in ZEROSHOT_TEMPLATES]


def captions(labels: np.ndarray, seed: int) -> list[str]:
    """One caption per label: a template and a synonym drawn from an RNG seeded with ``seed``."""
    rng = np.random.default_rng(seed)
    templates = rng.integers(0, len(CAPTION_TEMPLATES), size=len(labels))
    synonyms = rng.integers(0, len(SYNONYMS[0]), size=len(labels))
    return [CAPTION_TEMPLATES[t].format(with_article(SYNONYMS[int(label)][s]))
            for label, t, s in zip(labels, templates, synonyms)]


class FashionMNISTNotFoundError(MissingInput):
    pass


def _read_idx(path: str) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise InvalidInput(f"{path} is not an idx file of unsigned bytes")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _paths(split: str, root: str) -> tuple[str, str]:
    """The image and label files of ``split``; FashionMNISTNotFoundError says how to get them."""
    if split not in SPLITS:
        raise InvalidInput(f"unknown Fashion-MNIST split {split!r}; use one of {sorted(SPLITS)}")
    prefix = os.path.join(root, SPLITS[split])
    paths = (f"{prefix}-images-idx3-ubyte.gz", f"{prefix}-labels-idx1-ubyte.gz")
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise FashionMNISTNotFoundError(
            f"Fashion-MNIST not found ({missing[0]} is missing): install it with "
            f"`apt-get install dataset-fashion-mnist`, or point to a folder holding the four *-ubyte.gz files"
        )
    return paths


def load(split: str, root: str = DEFAULT_DIR) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 [N, 28, 28] and labels uint8 [N] of ``split`` ("train" or "test")."""
    image_path, label_path = _paths(split, root)
    images, labels = _read_idx(image_path), _read_idx(label_path)
    if len(images) != len(labels):
        raise InvalidInput(f"{len(images)} images but {len(labels)} labels in {root}")
    return images, labels


def num_images(split: str, root: str = DEFAULT_DIR) -> int:
    """How many images ``split`` has, read from its label file (a few kB) rather than its images."""
    return len(_read_idx(_paths(split, root)[1]))
