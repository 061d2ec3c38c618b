"""Distribution shifts of a classification set, for robustness scores: the same images and labels, transformed.

`inverted(dataset)`: every image's pixel values inverted, `255 - x` (Fashion-MNIST's white-on-black garments become
black-on-white), a shift a model trained on the originals has never seen.
"""

import dataclasses
import io

import numpy as np
from PIL import Image

from clip_jax.evaluation.datasets import ClassificationSet


def decode(image: "bytes | np.ndarray") -> np.ndarray:
    """uint8 [H, W] or [H, W, 3] of encoded bytes or an array (greyscale kept, everything else made RGB)."""
    if isinstance(image, np.ndarray):
        return image
    with Image.open(io.BytesIO(image)) as img:
        return np.asarray(img if img.mode == "L" else img.convert("RGB"))


class InvertedSource:
    """`source[i]` with its image inverted, as a uint8 array."""

    def __init__(self, source):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict:
        item = self.source[index]
        return {**item, "image": 255 - decode(item["image"])}


def inverted(dataset: ClassificationSet) -> ClassificationSet:
    """`dataset` with every image inverted (`255 - x`), named `NAME:inverted`."""
    return dataclasses.replace(dataset, name=f"{dataset.name}:inverted", source=InvertedSource(dataset.source))
