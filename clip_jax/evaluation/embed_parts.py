"""What `python -m clip_jax.embed` reads and which part of its output each input lands in, in clip-retrieval's
layout.

The input is split into `P` parts, `P = ceil(samples / write_batch_size)`, where `samples` is the number of samples
of a `files` folder, or for webdataset shards their number times `wds_number_file_per_input_file` (an estimate, as
clip-retrieval makes it: a shard's samples are known only once read). Part `i` takes every `P`-th input from the
`i`-th on: samples of a folder in the order of their keys, or whole shards. Its files are numbered with `i` padded
to the digits of `P` (`img_emb_03.npy` of 10 to 99 parts). Process `p` of `n` writes parts `p`, `p + n`, ...
"""

import dataclasses
import math
import os
from collections.abc import Sequence

from clip_jax.data.shards import expand_braces
from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.runtime import storage

INPUT_FORMATS = ("files", "webdataset")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
TEXT_SUFFIX, METADATA_SUFFIX = ".txt", ".json"
KINDS = ("img_emb", "text_emb", "metadata")  # the output's folders; each holds `{kind}_{number}.{npy|parquet}`


@dataclasses.dataclass(frozen=True)
class FileSample:
    """One sample of a `files` folder: files sharing a path without their suffix (`key`)."""

    key: str
    image: str | None
    text: str | None
    metadata: str | None


def check_format(input_format: str) -> None:
    if input_format not in INPUT_FORMATS:
        raise InvalidInput(f"--input_format {input_format!r}: give one of {', '.join(INPUT_FORMATS)}")


def folder_samples(folder: str, *, enable_image: bool, enable_text: bool) -> list[FileSample]:
    """The samples of a folder (searched recursively) sorted by key: keys with an image file (when images are
    embedded) and a `.txt` caption (when texts are), with their `.json` where one exists."""
    if not os.path.isdir(folder):
        raise MissingInput(f"--input_dataset {folder}: no such folder (the files format reads a folder of images "
                           "with .txt captions; shards take --input_format webdataset)")
    images, texts, metadata = {}, {}, {}
    for root, _, names in os.walk(folder):
        for name in names:
            stem, suffix = os.path.splitext(name)
            path = os.path.join(root, name)
            key = os.path.relpath(os.path.join(root, stem), folder).replace(os.sep, "/")
            suffix = suffix.lower()
            if suffix in IMAGE_SUFFIXES:
                images.setdefault(key, path)
            elif suffix == TEXT_SUFFIX:
                texts[key] = path
            elif suffix == METADATA_SUFFIX:
                metadata[key] = path
    wanted = [set(found) for found, on in ((images, enable_image), (texts, enable_text)) if on]
    keys = sorted(set.intersection(*wanted)) if wanted else []
    return [FileSample(key, images.get(key), texts.get(key), metadata.get(key)) for key in keys]


def shard_urls(pattern: str, option: str = "--input_dataset", instead: str = "") -> list[str]:
    """The shards a brace pattern names (`/data/{00000..00099}.tar`); local ones must exist (`option`: the flag
    that gave it, named in the error with `instead`, what else it takes)."""
    urls = expand_braces(pattern)
    missing = [url for url in urls if "://" not in url and not os.path.isfile(url)]
    if missing:
        raise MissingInput(f"{option} {pattern}: {len(missing)} of {len(urls)} shards do not exist "
                           f"(first: {missing[0]}){instead}")
    return urls


def partition_count(samples: int, write_batch_size: int) -> int:
    if write_batch_size < 1:
        raise InvalidInput(f"--write_batch_size {write_batch_size}: give a number of samples per part, at least 1")
    return max(1, math.ceil(samples / write_batch_size))


def part_number(part: int, parts: int) -> str:
    """The part's number in its file names: `part` zero-padded to one more digit than `floor(log10(parts))`."""
    return str(part).zfill(int(math.log10(parts)) + 1)


def part_inputs(inputs: Sequence, part: int, parts: int) -> list:
    """The inputs (samples or shards) of part `part` of `parts`: every `parts`-th from the `part`-th on."""
    return list(inputs[part::parts])


def process_parts(parts: int, process_index: int, process_count: int) -> range:
    """The parts process `process_index` of `process_count` writes."""
    return range(process_index, parts, process_count)


def part_paths(output_folder: str, part: int, parts: int, kinds: Sequence[str]) -> dict[str, str]:
    """`{kind: path}` of one part's files, for the kinds the run writes."""
    number = part_number(part, parts)
    suffix = {"img_emb": ".npy", "text_emb": ".npy", "metadata": ".parquet"}
    return {kind: storage.join(output_folder, kind, f"{kind}_{number}{suffix[kind]}") for kind in kinds}


def is_written(paths: dict[str, str]) -> bool:
    """A part is done when every one of its files is there (each is written whole or not at all)."""
    return all(storage.isfile(path) for path in paths.values())
