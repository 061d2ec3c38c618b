"""A folder of one's own images with captions, read as samples for shards (``make_shards folder``).

Images are the ``.jpg``/``.jpeg``/``.png``/``.webp`` files under the folder (recursive, sorted), each captioned by a
``.txt`` beside it or by one captions file (``.tsv``/``.csv``: image path relative to the folder, caption;
``.jsonl``: ``{"image": ..., "caption": ...}``). Images without a caption are left out with a warning.

A bad file is left out too, counted by what is wrong with it: an empty image file, one that is not an image PIL
reads, one that does not decode to its end (cut short or damaged: every image is decoded whole before it is
written), one over PIL's pixel limit, a caption that is not UTF-8 (a ``.txt``, or a line of the captions file). One
warning counts them by reason and names the first few of each; a folder with no usable image is one error.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from collections.abc import Iterator

from PIL import Image

from clip_jax.data.shard_writer import Sample, encode_jpeg
from clip_jax.errors import InvalidInput, MissingInput

IMAGE_EXTENSIONS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}
# Why a file is left out, as the warning counts it ("2 cut short or damaged (a.jpg, b.jpg)")
EMPTY, NOT_AN_IMAGE, DAMAGED = "empty", "not an image", "cut short or damaged"
TOO_MANY_PIXELS, CAPTION_NOT_UTF8 = "over PIL's pixel limit", "caption not UTF-8"
NAMED_AT_MOST = 3


class LeftOut:
    """The bad files left out of a folder's samples: reason -> their names, in the order they were found."""

    def __init__(self):
        self.by_reason: dict[str, list[str]] = {}

    def add(self, reason: str, name: str) -> None:
        self.by_reason.setdefault(reason, []).append(name)

    def __len__(self) -> int:
        return sum(len(names) for names in self.by_reason.values())

    def __str__(self) -> str:
        """``1 empty (z.jpg), 4 cut short or damaged (a.jpg, b.jpg, c.jpg, ...)``."""
        return ", ".join(f"{len(names)} {reason} ({', '.join(names[:NAMED_AT_MOST])}"
                         f"{', ...' if len(names) > NAMED_AT_MOST else ''})" for reason, names in self.by_reason.items())


def _is_utf8(text: str) -> bool:
    """Whether `text` was read from valid UTF-8 (bytes that are not are kept as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_captions_file(path: str) -> tuple[dict[str, str], dict[str, str]]:
    """(image path -> caption, image path -> ``FILE:LINE`` of a caption that is not UTF-8) from a ``.tsv``/``.csv``
    (columns: image path relative to the folder, caption) or ``.jsonl`` (``{"image": ..., "caption": ...}``)."""
    captions, not_utf8 = {}, {}
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
        if path.endswith(".jsonl"):
            rows = (_jsonl_row(path, number, line) for number, line in enumerate(f, 1) if line.strip())
        else:
            rows = _table_rows(path, csv.reader(f, delimiter="\t" if path.endswith(".tsv") else ","))
        for line_number, image, caption in rows:
            if _is_utf8(image) and _is_utf8(caption):
                captions[image] = caption
            else:
                not_utf8[image] = f"{os.path.basename(path)}:{line_number}"
    return captions, not_utf8


def _jsonl_row(path: str, line_number: int, line: str) -> tuple[int, str, str]:
    try:
        record = json.loads(line)
        return line_number, record["image"], record["caption"]
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidInput(f"{path}:{line_number}: expected {{\"image\": ..., \"caption\": ...}}") from e


def _table_rows(path: str, reader) -> Iterator[tuple[int, str, str]]:
    for row in reader:
        if not row or (reader.line_num == 1 and [c.lower() for c in row[:2]] == ["image", "caption"]):
            continue
        if len(row) < 2:
            raise InvalidInput(f"{path}:{reader.line_num}: expected two columns, image path and caption")
        yield reader.line_num, row[0], row[1]


def decoded_image(data: bytes) -> tuple[Image.Image | None, str | None]:
    """(the image decoded whole, None) or (None, why it cannot be: `EMPTY`, `NOT_AN_IMAGE`, `DAMAGED`,
    `TOO_MANY_PIXELS`)."""
    if not data:
        return None, EMPTY
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        return None, TOO_MANY_PIXELS
    except (OSError, SyntaxError, ValueError):  # PIL's UnidentifiedImageError is an OSError
        return None, NOT_AN_IMAGE
    try:
        image.load()  # the whole image: a cut-short JPEG's header alone reads fine
    except (OSError, SyntaxError, ValueError, EOFError):
        return None, DAMAGED
    return image, None


def _caption(full: str, rel: str, captions: dict[str, str] | None, not_utf8: dict[str, str],
             left_out: LeftOut) -> str | None:
    """The caption of image `rel` (None when it has none or it is bad: then counted in `left_out`)."""
    if captions is not None:
        if rel in not_utf8:
            left_out.add(CAPTION_NOT_UTF8, not_utf8[rel])
        return captions.get(rel)
    txt = os.path.splitext(full)[0] + ".txt"
    if not os.path.exists(txt):
        return None
    with open(txt, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        left_out.add(CAPTION_NOT_UTF8, os.path.splitext(rel)[0] + ".txt")
        return None


def _sample(image: Image.Image, data: bytes, rel: str, full: str, caption: str, image_size: int | None) -> Sample:
    original = image.size
    extension = IMAGE_EXTENSIONS[os.path.splitext(rel)[1].lower()]
    if image_size is not None:
        image = image.convert("RGB") if image.mode not in ("RGB", "L") else image
        scale = image_size / min(image.size)
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC)
        data, extension = encode_jpeg(image), "jpg"
    return Sample(data, extension, caption, "file://" + os.path.abspath(full), image.width, image.height, *original)


def image_folder_samples(folder: str, captions_file: str | None = None,
                         image_size: int | None = None) -> Iterator[Sample]:
    """The captioned images under ``folder`` as samples, bad files left out (see the module's docstring).

    ``image_size`` resizes the shortest side (bicubic) and re-encodes as JPEG; otherwise the original bytes are
    kept. Ends with `InvalidInput` when no image was usable.
    """
    if not os.path.isdir(folder):
        raise MissingInput(f"image folder {folder!r} does not exist")
    captions, not_utf8 = read_captions_file(captions_file) if captions_file else (None, {})
    paths = sorted(
        os.path.relpath(os.path.join(d, name), folder)
        for d, _, names in os.walk(folder) for name in names
        if os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS
    )
    if not paths:
        raise MissingInput(f"no .jpg/.jpeg/.png/.webp image under {folder!r}")
    without_caption, left_out, used = 0, LeftOut(), 0
    for rel in paths:
        full = os.path.join(folder, rel)
        bad_before = len(left_out)
        caption = _caption(full, rel, captions, not_utf8, left_out)
        if not caption:
            if len(left_out) == bad_before:  # none at all; a bad one is counted as a bad file
                without_caption += 1
            continue
        with open(full, "rb") as f:
            data = f.read()
        image, problem = decoded_image(data)
        if problem:
            left_out.add(problem, rel)
            continue
        used += 1
        yield _sample(image, data, rel, full, caption, image_size)
    _tell(folder, len(paths), used, without_caption, left_out)


def _tell(folder: str, images: int, used: int, without_caption: int, left_out: LeftOut) -> None:
    """The warnings on what was left out of `images`, or the error when none was `used`."""
    no_caption = f"{without_caption} of {images} images have no caption"
    if not used:
        found = ([f"{len(left_out)} bad files: {left_out}"] if left_out else []) + ([no_caption] if without_caption
                                                                                  else [])
        fixes = (["fix or remove the bad files"] if left_out else []) + (
            ["give each image a caption (a .txt beside it, or a captions file)"] if without_caption else [])
        raise InvalidInput(f"no usable image under {folder}: {'; '.join(found)}: {', and '.join(fixes)}")
    if without_caption:
        print(f"warning: {no_caption} and were left out", file=sys.stderr)
    if left_out:
        print(f"warning: left out {len(left_out)} bad files of {images} images: {left_out}", file=sys.stderr)
