"""Distribution shifts of a classification set, for robustness scores: the same images and labels, transformed.

`inverted(dataset)`: every image's pixel values inverted, `255 - x` (Fashion-MNIST's white-on-black garments become
black-on-white), a shift a model trained on the originals has never seen.

`upside_down(dataset)`: every image flipped top to bottom (torchvision's `vflip`), the fine-tuning demo's shift: the
demo's zero-shot model keeps 48% top-1 there (of 77% on the originals), where it is at chance on inverted images
(benchmarks/RESULTS.md, section 25).

`shifted(dataset, name, transform)` makes any other: `transform` takes and returns a uint8 image array. `SHIFTS`
names those a config can ask for (`shift_data` of the fine-tuning config).
"""

import dataclasses
import io
from collections.abc import Callable

import numpy as np
from PIL import Image

from clip_jax.evaluation.datasets import ClassificationSet


def decode(image: "bytes | np.ndarray") -> np.ndarray:
    """uint8 [H, W] or [H, W, 3] of encoded bytes or an array (greyscale kept, everything else made RGB)."""
    if isinstance(image, np.ndarray):
        return image
    with Image.open(io.BytesIO(image)) as img:
        return np.asarray(img if img.mode == "L" else img.convert("RGB"))


class ShiftedSource:
    """`source[i]` with `transform` applied to its image (decoded to a uint8 array first)."""

    def __init__(self, source, transform: Callable[[np.ndarray], np.ndarray]):
        self.source, self.transform = source, transform

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict:
        item = self.source[index]
        return {**item, "image": self.transform(decode(item["image"]))}


def shifted(dataset: ClassificationSet, name: str, transform: Callable[[np.ndarray], np.ndarray]) -> ClassificationSet:
    """`dataset` with `transform` applied to every image, named `NAME:name`."""
    return dataclasses.replace(dataset, name=f"{dataset.name}:{name}", source=ShiftedSource(dataset.source, transform))


def inverted(dataset: ClassificationSet) -> ClassificationSet:
    """`dataset` with every image inverted (`255 - x`), named `NAME:inverted`."""
    return shifted(dataset, "inverted", lambda image: 255 - image)


def upside_down(dataset: ClassificationSet) -> ClassificationSet:
    """`dataset` with every image flipped top to bottom, named `NAME:upside-down`."""
    return shifted(dataset, "upside-down", lambda image: np.ascontiguousarray(image[::-1]))


# The shifts a config names (`shift_data`), each a function of the test set.
SHIFTS: dict[str, Callable[[ClassificationSet], ClassificationSet]] = {"invert": inverted, "vflip": upside_down}
