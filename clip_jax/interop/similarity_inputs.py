"""What `python -m clip_jax.similarity` matches: the images of `--images` and the texts of `--labels` or `--captions`.

`--images` names image files and folders (a folder: the image files below it, by their suffix, in path order). A
path that does not exist, or a folder without an image, is refused; an image that cannot be read or decoded is
named in one line and skipped, as the data pipeline skips a bad sample, and the images that decode are matched.
"""

import csv
import dataclasses
import os
import re
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from clip_jax.data import transforms
from clip_jax.errors import InvalidInput, MissingInput

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm")
_BYTES_NAMED = re.compile(r" <_io\.BytesIO object at 0x[0-9a-f]+>")  # Pillow names the buffer, not the file
CAPTION_COLUMNS = ("caption", "title", "text")  # a header naming one of them: --captions reads that column


@dataclasses.dataclass(frozen=True)
class Skipped:
    path: str
    reason: str


def image_paths(paths: Sequence[str]) -> list[str]:
    """The image files `--images` names: each file as given, each folder's image files below it (sorted)."""
    found = []
    for path in paths:
        if os.path.isfile(path):
            found.append(path)
        elif os.path.isdir(path):
            inside = sorted(os.path.join(root, name) for root, dirs, names in os.walk(path)
                            for name in names if name.lower().endswith(IMAGE_SUFFIXES) and not name.startswith("."))
            if not inside:
                raise MissingInput(f"--images {path}: no images ({', '.join(IMAGE_SUFFIXES)}) in the folder")
            found += inside
        else:
            raise MissingInput(f"--images {path} does not exist: give image files and/or folders of them")
    return found


def read_images(paths: Iterable[str], preprocess, skipped: list[Skipped]) -> Iterator[tuple[str, np.ndarray]]:
    """(path, `preprocess(PIL image)`) of each image that decodes; each that does not is added to `skipped`."""
    for path in paths:
        try:
            with open(path, "rb") as f:
                image = transforms.decode_rgb(f.read())
        except OSError as e:
            skipped.append(Skipped(path, f"cannot be read ({e.strerror or e})"))
            continue
        except transforms.ImageDecodeError as e:
            skipped.append(Skipped(path, f"is not an image that decodes ({_BYTES_NAMED.sub('', str(e))})"))
            continue
        yield path, preprocess(image)


def batches(items: Iterator[tuple[str, np.ndarray]], size: int) -> Iterator[tuple[list[str], np.ndarray]]:
    """(names, stacked arrays) of up to `size` items at a time."""
    names, arrays = [], []
    for name, array in items:
        names.append(name)
        arrays.append(array)
        if len(names) == size:
            yield names, np.stack(arrays)
            names, arrays = [], []
    if names:
        yield names, np.stack(arrays)


def parse_labels(text: str) -> list[str]:
    """The comma-separated labels of `--labels` (blank ones left out); refused when none is left."""
    labels = [label.strip() for label in text.split(",") if label.strip()]
    if not labels:
        raise InvalidInput(f"--labels {text!r} names no label: give them comma-separated, e.g. --labels "
                           "'a photo of a dog,a photo of a cat' (or --captions FILE, one a line)")
    return labels


def read_captions(path: str) -> list[str]:
    """The texts of `--captions FILE`: a .csv or .tsv's first column (or the one its header names caption, title or
    text), else one a line; blank ones left out."""
    if not os.path.isfile(path):
        raise MissingInput(f"--captions {path} does not exist: give a text file (one caption a line) or a .csv")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            if path.lower().endswith((".csv", ".tsv")):
                rows = [row for row in csv.reader(f, delimiter="\t" if path.lower().endswith(".tsv") else ",")]
            else:
                rows = [[line.rstrip("\n")] for line in f]
    except UnicodeDecodeError:
        raise InvalidInput(f"--captions {path} is not UTF-8 text") from None
    header = [cell.strip().lower() for cell in rows[0]] if rows else []
    column = next((header.index(name) for name in CAPTION_COLUMNS if name in header), None)
    rows = rows[1:] if column is not None else rows
    captions = [row[column or 0].strip() for row in rows if len(row) > (column or 0) and row[column or 0].strip()]
    if not captions:
        raise InvalidInput(f"--captions {path} holds no caption: give one a line (a .csv: one a row)")
    return captions
