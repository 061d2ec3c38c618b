"""Evaluation sets: classification (image folders, TFDS ArrayRecord sources, Fashion-MNIST) and image-text
retrieval shards.

Every image goes through the same path as OpenCLIP's eval: decode to RGB, resize the shortest side (bicubic),
center crop, normalise. Classification batches have a fixed size: the last one is padded, with ``valid`` marking
the real rows.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np
from PIL import Image

from clip_jax.data import fashion_mnist, tar_format, transforms, webdataset
from clip_jax.data import shards as shards_lib
from clip_jax.errors import InvalidInput, MissingInput

FOLDER_IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class ImageFolderSource(grain.sources.RandomAccessDataSource):
    """``root/class_name/image.jpg`` (the layout of OpenCLIP's ``--imagenet-val``): classes are the sorted folder
    names, label ``i`` is ``class_names[i]``. Items are ``{"image": bytes, "label": int}``."""

    def __init__(self, root: str):
        if not os.path.isdir(root):
            raise MissingInput(f"image folder {root!r} does not exist")
        self.root = root
        self.class_names = tuple(sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith(".")))
        if not self.class_names:
            raise MissingInput(f"no class folders in {root!r}: expected root/class_name/image.jpg")
        items = []
        for label, name in enumerate(self.class_names):
            for folder, _, files in sorted(os.walk(os.path.join(root, name))):
                items.extend((os.path.join(folder, f), label) for f in sorted(files)
                             if f.lower().endswith(FOLDER_IMAGE_EXTENSIONS) and not f.startswith("."))
        if not items:
            raise MissingInput(
                f"no images ({', '.join(FOLDER_IMAGE_EXTENSIONS)}) in the class folders of {root!r}"
            )
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        path, label = self.items[index]
        with open(path, "rb") as f:
            return {"image": f.read(), "label": label}


class TfdsSource(grain.sources.RandomAccessDataSource):
    """A prepared TFDS dataset read with ``tfds.data_source`` (ArrayRecord, no TensorFlow); images stay encoded
    bytes. Items are ``{"image": bytes, "label": int}``; ``class_names`` come from the label feature."""

    def __init__(self, name: str, split: str, data_dir: str | None = None, image_key: str = "image",
                 label_key: str = "label"):
        import tensorflow_datasets as tfds

        try:
            self._source = tfds.data_source(name, split=split, data_dir=data_dir, download=False,
                                            decoders={image_key: tfds.decode.SkipDecoding()})
        except Exception as e:  # noqa: BLE001 - tfds raises several kinds for a missing or unprepared dataset
            raise MissingInput(
                f"cannot open TFDS dataset {name!r} split {split!r} in {data_dir or 'the default data_dir'}: {e}. "
                "Prepare it first in ArrayRecord format (e.g. `tfds build NAME --file_format=array_record`)"
            ) from e
        features = self._source.dataset_info.features
        self.class_names = tuple(features[label_key].names)
        self.image_key, self.label_key = image_key, label_key

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        example = self._source[index]
        return {"image": bytes(example[self.image_key]), "label": int(example[self.label_key])}


class FashionMNISTSource(grain.sources.RandomAccessDataSource):
    """A Fashion-MNIST split for zero-shot classification; items are ``{"image": uint8 [28, 28], "label": int}``
    and ``class_names`` are :data:`clip_jax.data.fashion_mnist.CLASS_NAMES`."""

    def __init__(self, split: str = "test", root: str = fashion_mnist.DEFAULT_DIR):
        self.images, self.labels = fashion_mnist.load(split, root)
        self.class_names = fashion_mnist.CLASS_NAMES

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": self.images[index], "label": int(self.labels[index])}


@dataclasses.dataclass(frozen=True)
class EvalTransform:
    """Encoded image bytes or a uint8 array [H, W(, C)] -> uint8 [S, S, 3] with OpenCLIP's eval transform."""

    image_size: int

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        image = item["image"]
        if isinstance(image, np.ndarray):
            image = Image.fromarray(image).convert("RGB")
        else:
            image = transforms.decode_rgb(image)
        return {"image": transforms.eval_crop(image, self.image_size), "label": np.int32(item["label"])}


@dataclasses.dataclass(frozen=True)
class PaddedCollate:
    """Stacks up to ``batch_size`` items, pads with zeros to ``batch_size``; ``valid`` marks the real rows."""

    batch_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
        images = transforms.normalize(np.stack([item["image"] for item in items]), self.mean, self.std)
        labels = np.asarray([item["label"] for item in items], np.int32)
        pad = self.batch_size - len(items)
        if pad:
            images = np.concatenate([images, np.zeros((pad, *images.shape[1:]), images.dtype)])
            labels = np.concatenate([labels, np.full(pad, -1, np.int32)])
        valid = np.arange(self.batch_size) < len(items)
        return {"images": images, "labels": labels, "valid": valid}


def classification_batches(
    source: grain.sources.RandomAccessDataSource,
    *,
    batch_size: int,
    image_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    num_threads: int = 8,
) -> grain.IterDataset:
    """Batches ``{"images": float32 [B, S, S, 3], "labels": int32 [B] (-1 = padding), "valid": bool [B]}`` in
    source order, decoded by ``num_threads`` threads."""
    ds = grain.MapDataset.source(source).map(EvalTransform(image_size))
    ds = ds.batch(batch_size, batch_fn=PaddedCollate(batch_size, tuple(mean), tuple(std)))
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=2))


# ---------------------------------------------------------------------------------------------------------------
# Retrieval: webdataset shards of images with one or more captions each.


def captions_of(files: dict[str, bytes]) -> list[str]:
    """A retrieval sample's captions: ``json["captions"]`` when present, else the non-empty lines of ``txt``."""
    if "json" in files:
        try:
            meta = json.loads(files["json"])
        except ValueError:
            meta = None
        if isinstance(meta, dict) and isinstance(meta.get("captions"), list):
            return [c for c in meta["captions"] if isinstance(c, str) and c.strip()]
    text = files.get("txt", b"").decode("utf-8", "replace")
    return [line.strip() for line in text.splitlines() if line.strip()]


def _iter_retrieval_groups(urls: Sequence[str]) -> Iterator[tuple[bytes, list[str], str]]:
    for url in urls:
        with webdataset.open_shard(url) as stream:
            for group in tar_format.iter_groups(tar_format.iter_members(stream)):
                image = next((group.files[e] for e in webdataset.IMAGE_EXTENSIONS if e in group.files), None)
                captions = captions_of(group.files)
                if image and captions:
                    yield image, captions, f"{url}:{group.key}"


@dataclasses.dataclass(frozen=True)
class RetrievalSet:
    """Images (streamed from the shards in order) and all their captions.

    ``caption_image[t]`` is the index of the image caption ``t`` describes.
    """

    urls: tuple[str, ...]
    captions: tuple[str, ...]
    caption_image: np.ndarray  # int32 [T]
    num_images: int

    def image_batches(self, *, batch_size: int, image_size: int, mean: Sequence[float],
                      std: Sequence[float]) -> Iterator[np.ndarray]:
        """Eval-transformed, normalised images float32 [<=B, S, S, 3] of the first ``num_images`` images, in order
        (the last batch partial)."""
        batch = []
        groups = itertools.islice(_iter_retrieval_groups(self.urls), self.num_images)
        for image, _, where in groups:
            try:
                batch.append(transforms.eval_crop(transforms.decode_rgb(image), image_size))
            except transforms.ImageDecodeError as e:
                raise InvalidInput(f"corrupt image {where} in a retrieval set ({e}): fix or drop it (see "
                                 "`python -m clip_jax.data.check`)") from e
            if len(batch) == batch_size:
                yield transforms.normalize(np.stack(batch), mean, std)
                batch = []
        if batch:
            yield transforms.normalize(np.stack(batch), mean, std)


def load_retrieval_set(pattern: str) -> RetrievalSet:
    """Reads the captions of image-caption shards (several captions per image: ``json["captions"]`` or one per
    line of ``txt``). Samples without an image or a caption are left out."""
    urls = shards_lib.resolve_shards(pattern).urls
    captions, owners, num_images = [], [], 0
    for _, image_captions, _ in _iter_retrieval_groups(urls):
        captions.extend(image_captions)
        owners.extend([num_images] * len(image_captions))
        num_images += 1
    if not num_images:
        raise InvalidInput(f"no image with a caption in {pattern!r}")
    return RetrievalSet(urls, tuple(captions), np.asarray(owners, np.int32), num_images)
