"""Where eval images come from: random-access sources of labelled images for classification, and webdataset
shards of images with their captions for retrieval.

Classification sources hold `{"image": encoded bytes or uint8 [H, W] / [H, W, 3], "label": int}` items and are read
by index (Grain's random-access protocol); images stay encoded until `batches.eval_image` transforms them.
"""

import dataclasses
import itertools
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np

from clip_jax.data import shards as shards_lib
from clip_jax.data import tar_format, transforms, webdataset
from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.evaluation.batches import EvalItem, streamed_batches

FOLDER_IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class ImageFolderSource(grain.sources.RandomAccessDataSource):
    """`root/class_name/image.jpg` (the layout of OpenCLIP's `--imagenet-val`): classes are the sorted folder
    names, label `i` is `class_names[i]`. Items are `{"image": bytes, "label": int}`.

    Folders named by numbers only (ImageNet-V2's `0` ... `999`) are labels themselves: they are ordered by value
    (text order would put `10` before `2`) and must be `0` ... `N-1`. `numbered` says which layout was found."""

    def __init__(self, root: str):
        if not os.path.isdir(root):
            raise MissingInput(f"image folder {root!r} does not exist")
        self.root = root
        folders = [d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith(".")]
        if not folders:
            raise MissingInput(f"no class folders in {root!r}: expected root/class_name/image.jpg")
        self.numbered = all(name.isdecimal() for name in folders)
        if self.numbered:
            labels = sorted(int(name) for name in folders)
            if labels != list(range(len(labels))):
                missing = sorted(set(range(labels[-1] + 1)) - set(labels))[:5]
                raise InvalidInput(f"{root!r} has numbered class folders (ImageNet-V2's layout), which must be 0 ... "
                                   f"N-1 and are not: missing {missing or [0]}; duplicates like '01' and '1' are "
                                   "ambiguous too")
            self.class_names = tuple(sorted(folders, key=int))
        else:
            self.class_names = tuple(sorted(folders))
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
    """A prepared TFDS dataset read with `tfds.data_source` (ArrayRecord, no TensorFlow); images stay encoded
    bytes. Items are `{"image": bytes, "label": int}`; `class_names` come from the label feature."""

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


class ArraySource:
    """Images held in memory, uint8 [N, H, W] (greyscale) or [N, H, W, 3], with labels [N]."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        if len(images) != len(labels):
            raise InvalidInput(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": self.images[index], "label": int(self.labels[index])}


def captions_of(files: dict[str, bytes]) -> list[str]:
    """A retrieval sample's captions: `json["captions"]` when present, else the non-empty lines of `txt`."""
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

    `caption_image[t]` is the index of the image caption `t` describes.
    """

    urls: tuple[str, ...]
    captions: tuple[str, ...]
    caption_image: np.ndarray  # int32 [T]
    num_images: int

    def image_batches(self, *, batch_size: int, image_size: int, mean: Sequence[float], std: Sequence[float],
                      num_threads: int | None = None, resize_mode: str = "shortest") -> Iterator[np.ndarray]:
        """Eval-transformed, normalised images float32 [<=B, S, S, 3] of the first `num_images` images, in order
        (the last batch partial), streamed from the shards through `batches.streamed_batches`."""
        groups = itertools.islice(_iter_retrieval_groups(self.urls), self.num_images)
        items = ({"image": image, "label": 0, "where": where} for image, _, where in groups)
        for batch in streamed_batches(items, batch_size=batch_size, image_size=image_size, mean=mean, std=std,
                                      num_threads=num_threads,
                                      item=_RetrievalImage(image_size, resize_mode)):
            yield batch["images"][batch["valid"]]


@dataclasses.dataclass(frozen=True)
class _RetrievalImage:
    """A retrieval item's image under the eval transform; one that does not decode is an error naming it."""

    image_size: int
    resize_mode: str = "shortest"

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        try:
            return EvalItem(self.image_size, self.resize_mode)(item)
        except transforms.ImageDecodeError as e:
            raise InvalidInput(f"corrupt image {item['where']} in a retrieval set ({e}): fix or drop it (see "
                               "`python -m clip_jax.data.check`)") from e


def load_retrieval_set(pattern: str) -> RetrievalSet:
    """Reads the captions of image-caption shards (several captions per image: `json["captions"]` or one per
    line of `txt`). Samples without an image or a caption are left out."""
    urls = shards_lib.resolve_shards(pattern).urls
    captions, owners, num_images = [], [], 0
    for _, image_captions, _ in _iter_retrieval_groups(urls):
        captions.extend(image_captions)
        owners.extend([num_images] * len(image_captions))
        num_images += 1
    if not num_images:
        raise InvalidInput(f"no image with a caption in {pattern!r}")
    return RetrievalSet(urls, tuple(captions), np.asarray(owners, np.int32), num_images)
