"""Webdataset samples: the members of a tar shard that share a key (``KEY.jpg`` + ``KEY.txt`` + ``KEY.json``, as
img2dataset writes them) made one raw (image bytes, caption) sample, or the reason it is skipped.

A :class:`SampleFormat` says which members are the image and the caption and which samples a run keeps; samples
its filter drops are counted like bad ones, under reasons starting ``"filter: "`` (:mod:`clip_jax.data.skips`).
:func:`iter_shard` reads one shard in file order; the Grain dataset over many shards is
:mod:`clip_jax.data.tar_dataset`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from collections.abc import Iterator
from typing import BinaryIO, NamedTuple

from clip_jax.data import filters, skips, tar_format
from clip_jax.errors import InvalidInput

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ("jpg", "png", "jpeg", "webp")  # preference order when a sample has several
CAPTION_EXTENSION = "txt"


class RawSample(NamedTuple):
    image: bytes  # encoded image file
    caption: str
    key: str
    shard: str  # URL of the shard it came from
    stream: int  # data stream (process, worker) that read it
    number: int  # index of the sample in its stream; (stream, number) keys the per-sample augmentation RNG
    metadata: bytes | None = None  # the sample's .json, as stored


@dataclasses.dataclass(frozen=True)
class SampleFormat:
    """Which members of a sample are its image and caption, and which samples a run keeps.

    ``image_keys``: extensions tried in order (OpenCLIP's ``jpg;png;jpeg;webp``). ``caption_key``: an extension
    (``txt``) or ``json:FIELD``, a string field of the sample's ``.json`` (img2dataset's ``json:caption``).
    ``sample_filter``: a :class:`~clip_jax.data.filters.SampleFilter`; what it drops is counted under its reasons.
    """

    image_keys: tuple[str, ...] = IMAGE_EXTENSIONS
    caption_key: str = CAPTION_EXTENSION
    sample_filter: filters.SampleFilter | None = None

    def __post_init__(self):
        if not self.image_keys or not all(self.image_keys):
            raise InvalidInput(f"image keys {self.image_keys!r}: give extensions such as 'jpg;png;webp'")
        if not self.caption_key or self.caption_key == "json:":
            raise InvalidInput(f"caption key {self.caption_key!r}: give an extension ('txt') or 'json:FIELD'")

    @classmethod
    def parse(cls, image_keys: str = ";".join(IMAGE_EXTENSIONS), caption_key: str = CAPTION_EXTENSION,
              sample_filter: filters.SampleFilter | None = None) -> "SampleFormat":
        """From OpenCLIP-style strings: ``"jpg;png;webp"`` and ``"txt"`` / ``"json:caption"``."""
        keys = tuple(k.strip().lstrip(".").lower() for k in image_keys.split(";"))
        return cls(keys, caption_key.strip().lstrip("."), sample_filter)


DEFAULT_FORMAT = SampleFormat()


def _caption_bytes(files: dict[str, bytes], caption_key: str) -> bytes | None | str:
    """The caption's UTF-8 bytes, None when absent, or a skip reason."""
    if not caption_key.startswith("json:"):
        return files.get(caption_key)
    meta = files.get("json")
    if meta is None:
        return None
    try:
        value = json.loads(meta).get(caption_key[5:])
    except (ValueError, UnicodeDecodeError, AttributeError):
        return skips.BAD_CAPTION
    if value is None:
        return None
    if not isinstance(value, str):
        return skips.BAD_CAPTION
    return value.encode("utf-8", "surrogatepass")


def sample_from_group(group: tar_format.Group, shard: str, stream: int = 0, number: int = -1,
                      fmt: SampleFormat = DEFAULT_FORMAT) -> RawSample | str:
    """The sample a group of members forms, or the reason it has to be skipped (or is filtered out)."""
    files = group.files
    image = next((files[ext] for ext in fmt.image_keys if ext in files), None)
    text = _caption_bytes(files, fmt.caption_key)
    if image is None:
        return skips.NO_IMAGE if text is not None else skips.JSON_ONLY
    if text is None:
        return skips.NO_CAPTION
    if isinstance(text, str):
        return text
    if not image:
        return skips.EMPTY_IMAGE
    try:
        caption = text.decode("utf-8")
    except UnicodeDecodeError:
        return skips.BAD_CAPTION
    if not caption.strip():
        return skips.EMPTY_CAPTION
    if fmt.sample_filter is not None:
        reason = fmt.sample_filter.check(files.get("json"), image, caption)
        if reason is not None:
            return reason
    return RawSample(image, caption, group.key, shard, stream, number, files.get("json"))


def open_shard(url: str) -> BinaryIO:
    """Opens a local path or fsspec URL for buffered sequential reading."""
    if "://" not in url or url.startswith("file://"):
        return open(url.removeprefix("file://"), "rb", buffering=1 << 20)  # noqa: SIM115
    import fsspec

    return fsspec.open(url, "rb", block_size=1 << 22).open()


def iter_shard(url: str, skipped: collections.Counter | None = None,
               fmt: SampleFormat = DEFAULT_FORMAT) -> Iterator[RawSample]:
    """All good (and kept) samples of one shard in file order; skips, drops and shard errors are added to
    ``skipped``."""
    skipped = skipped if skipped is not None else collections.Counter()
    try:
        stream = open_shard(url)
    except OSError as e:
        log.warning("skipping unreadable shard %s: %s", url, e)
        skipped[skips.UNREADABLE_SHARD] += 1
        return
    with stream:
        try:
            for group in tar_format.iter_groups(tar_format.iter_members(stream)):
                sample = sample_from_group(group, url, fmt=fmt)
                if isinstance(sample, str):
                    skipped[sample] += 1
                else:
                    yield sample
        except (tar_format.TarError, OSError) as e:
            reason = shard_error_reason(e)
            log.warning("%s %s: %s", reason.replace("_", " "), url, e)
            skipped[reason] += 1


def shard_error_reason(error: Exception) -> str:
    if isinstance(error, tar_format.TruncatedTarError):
        return skips.TRUNCATED_SHARD
    if isinstance(error, tar_format.CorruptTarError):
        return skips.CORRUPT_SHARD
    return skips.UNREADABLE_SHARD
