"""The samples of one part of `python -m clip_jax.embed`'s input, and their batches ready for the towers.

A sample is skipped, and counted by reason as the training data pipeline counts it (`clip_jax.data.skips`), when it
lacks what the run embeds (an image, a caption), when its caption is not UTF-8 or empty, when its image does not
decode, or when its shard cannot be read to the end. Images are decoded and cropped (OpenCLIP's eval transform) by
Grain's threads as every eval image is (`batches.decoded`), ahead of the batch being encoded; captions are tokenized by
a pool of threads, one batch ahead.
"""

import collections
import concurrent.futures
import dataclasses
import itertools
import json
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from clip_jax.data import skips, tar_format, transforms, webdataset
from clip_jax.evaluation.batches import decoded, eval_image
from clip_jax.evaluation.embed_parts import FileSample


@dataclasses.dataclass(frozen=True)
class Sample:
    image_path: str  # the image's path (files) or the sample's key (webdataset), as clip-retrieval names it
    image: bytes | None
    caption: str | None
    metadata: bytes | None  # the sample's .json, as stored


@dataclasses.dataclass
class Batch:
    samples: list[Sample]
    images: np.ndarray | None  # uint8 [n, S, S, 3]
    tokens: np.ndarray | None  # int32 [n, L]


def _checked(image: bytes | None, caption: bytes | None, *, need_image: bool, need_text: bool) -> tuple | str:
    """(image, caption) of a sample's raw members, or the reason it is skipped."""
    if need_image and image is None:
        return skips.NO_IMAGE if caption is not None else skips.JSON_ONLY
    if need_image and not image:
        return skips.EMPTY_IMAGE
    if need_text and caption is None:
        return skips.NO_CAPTION
    text = None
    if caption is not None:
        try:
            text = caption.decode("utf-8")
        except UnicodeDecodeError:
            if need_text:
                return skips.BAD_CAPTION
    if need_text and not text.strip():
        return skips.EMPTY_CAPTION
    return image, text


def folder_part(samples: Iterable[FileSample], skipped: collections.Counter, *, need_image: bool,
                need_text: bool) -> Iterator[Sample]:
    """The good samples of a `files` part, in key order; unreadable files count as missing images."""
    for sample in samples:
        try:
            image = _read(sample.image) if need_image else None
            caption = _read(sample.text)
            metadata = _read(sample.metadata)
        except OSError:
            skipped[skips.MISSING_IMAGE] += 1
            continue
        checked = _checked(image, caption, need_image=need_image, need_text=need_text)
        if isinstance(checked, str):
            skipped[checked] += 1
            continue
        yield Sample(sample.image or sample.key, checked[0], checked[1], metadata)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def shard_part(urls: Iterable[str], skipped: collections.Counter, fmt: webdataset.SampleFormat, *,
               need_image: bool, need_text: bool) -> Iterator[Sample]:
    """The good samples of a webdataset part, shard after shard in file order; a shard that cannot be read to the
    end is counted (its samples read so far are kept), as the training reader does."""
    for url in urls:
        try:
            stream = webdataset.open_shard(url)
        except OSError:
            skipped[skips.UNREADABLE_SHARD] += 1
            continue
        with stream:
            try:
                for group in tar_format.iter_groups(tar_format.iter_members(stream)):
                    files = group.files
                    image = next((files[ext] for ext in fmt.image_keys if ext in files), None)
                    checked = _checked(image, _caption_member(files, fmt.caption_key), need_image=need_image,
                                       need_text=need_text)
                    if isinstance(checked, str):
                        skipped[checked] += 1
                        continue
                    yield Sample(group.key, checked[0], checked[1], files.get("json"))
            except (tar_format.TarError, OSError) as e:
                skipped[webdataset.shard_error_reason(e)] += 1


def _caption_member(files: dict[str, bytes], caption_key: str) -> bytes | None:
    """The caption's bytes: a member (`txt`), or a string field of the sample's .json (`json:FIELD`)."""
    if not caption_key.startswith("json:"):
        return files.get(caption_key)
    try:
        value = json.loads(files.get("json") or b"{}").get(caption_key[5:])
    except (ValueError, UnicodeDecodeError, AttributeError):
        return None
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True)
class _WithImage:
    """(sample, its image under the eval transform, uint8 [S, S, 3], or the reason it is skipped); picklable, so
    Grain runs it in its threads."""

    image_size: int
    resize_mode: str = "shortest"

    def __call__(self, sample: Sample) -> tuple[Sample, np.ndarray | str]:
        try:
            return sample, eval_image(sample.image, self.image_size, self.resize_mode)
        except transforms.TooManyPixels:
            return sample, skips.TOO_MANY_PIXELS
        except transforms.ImageDecodeError:
            return sample, skips.CORRUPT_IMAGE


def batches(samples: Iterator[Sample], skipped: collections.Counter, pool: concurrent.futures.Executor, *,
            batch_size: int, image_size: int | None, tokenize: Callable | None, num_threads: int = 2,
            named: list | None = None, resize_mode: str = "shortest") -> Iterator[Batch]:
    """Batches of up to `batch_size` samples (fewer where images did not decode): images decoded by `num_threads`
    of Grain's threads, two batches ahead; captions tokenized by `pool`, one batch ahead. `image_size` None: no
    images, `tokenize` None: no tokens. `named`: where to add (image path, reason) of each image skipped.
    `resize_mode`: the eval transform's ("shortest" then a center crop, or a SigLIP folder's "squash")."""
    if image_size:
        with_images = decoded(samples, _WithImage(image_size, resize_mode), num_threads=num_threads,
                              ahead=2 * batch_size,
                              window=4 * batch_size)
    else:
        with_images = ((sample, None) for sample in samples)
    chunks = iter(lambda: list(itertools.islice(with_images, batch_size)), [])

    def submit(chunk):
        kept = []
        for sample, image in chunk:
            if isinstance(image, str):
                skipped[image] += 1
                if named is not None:
                    named.append((sample.image_path, image))
            else:
                kept.append((sample, image))
        tokens = pool.submit(tokenize, [s.caption for s, _ in kept]) if tokenize and kept else None
        return kept, tokens

    pending = collections.deque(submit(chunk) for chunk in itertools.islice(chunks, 2))
    while pending:
        kept, tokens = pending.popleft()
        following = next(chunks, None)
        if following is not None:
            pending.append(submit(following))
        if not kept:
            continue
        yield Batch([s for s, _ in kept], np.stack([image for _, image in kept]) if image_size else None,
                    tokens.result() if tokens is not None else None)
