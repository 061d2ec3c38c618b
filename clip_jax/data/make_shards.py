"""Writes webdataset shards in img2dataset's format, from an image folder with captions or from Fashion-MNIST.

Each ``NNNNN.tar`` holds ``KEY.jpg`` (or the source's .png/.webp), ``KEY.txt`` (caption, no trailing newline) and
``KEY.json`` (url, caption, key, status, error_message, width, height, original_width, original_height, exif,
sha256), with 9-digit keys ``shard * 10**4 + row``. Beside it: ``NNNNN_stats.json`` and, when pyarrow is
installed, ``NNNNN.parquet`` with one row per sample.

    python -m clip_jax.data.make_shards fashion-mnist --out /tmp/fmnist            # train/ and test/ shards
    python -m clip_jax.data.make_shards fashion-mnist --out /tmp/fm256 --image-size 256 --split test
    python -m clip_jax.data.make_shards folder --images photos/ --captions captions.tsv --out /tmp/photos
    python -m clip_jax.data.make_shards filter-parquet laion/part-*.parquet --out kept.parquet \
        --filter "punsafe < 0.5 and pwatermark < 0.8"      # LAION's metadata, pre-filtered for img2dataset
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from PIL import Image

from clip_jax import entry
from clip_jax.data import fashion_mnist, write_once
from clip_jax.data.shards import expand_braces
from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.runtime import ownership, stop_signals

ROWS_PER_SHARD_MAX = 10_000  # keys are shard * 10**4 + row
# What the demo's shards take per Fashion-MNIST image (tar members, stats and parquet): 3.84 MB for the first 1,024
FASHION_MNIST_SHARD_BYTES_PER_IMAGE = 3_750
FIXED_MTIME = 1_700_000_000  # tar member times, so that the same input gives the same bytes
IMAGE_EXTENSIONS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}
DEMO_FOLDER = ("fashion-mnist", "train")  # the last two parts of the only folders make_train_data writes
SHARD_FILE = re.compile(r"\d{5}(\.tar|\.tar\.tmp|_stats\.json|\.parquet)$")  # the names write_shard writes


class Sample(NamedTuple):
    image: bytes  # encoded
    extension: str  # "jpg", "png" or "webp"
    caption: str
    url: str
    width: int
    height: int
    original_width: int
    original_height: int


def encode_jpeg(image: Image.Image, quality: int = 95) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def _add(tar, name: str, data: bytes) -> None:
    import tarfile

    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), FIXED_MTIME, 0o444
    tar.addfile(info, io.BytesIO(data))


def _write_parquet(path: str, rows: list[dict]) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_shard(samples: list[Sample], out_dir: str, shard_index: int) -> str:
    """Writes one shard (tar, stats json, parquet) atomically; returns the tar path."""
    import tarfile

    if len(samples) > ROWS_PER_SHARD_MAX:
        raise ValueError(f"{len(samples)} samples in one shard; at most {ROWS_PER_SHARD_MAX} fit 9-digit keys")
    start = time.time()
    name = f"{shard_index:05d}"
    path = os.path.join(out_dir, f"{name}.tar")
    ownership.record(out_dir, [f"{name}.tar", f"{name}.tar.tmp", f"{name}_stats.json", f"{name}.parquet"])
    rows = []
    with tarfile.open(path + ".tmp", "w", format=tarfile.USTAR_FORMAT) as tar:
        for row, sample in enumerate(samples):
            key = f"{shard_index * ROWS_PER_SHARD_MAX + row:09d}"
            meta = {
                "url": sample.url, "caption": sample.caption, "key": key, "status": "success",
                "error_message": None, "width": sample.width, "height": sample.height,
                "original_width": sample.original_width, "original_height": sample.original_height,
                "exif": None, "sha256": hashlib.sha256(sample.image).hexdigest(),
            }
            _add(tar, f"{key}.{sample.extension}", sample.image)
            _add(tar, f"{key}.txt", sample.caption.encode("utf-8"))
            _add(tar, f"{key}.json", json.dumps(meta).encode("utf-8"))
            rows.append(meta)
    os.replace(path + ".tmp", path)
    end = time.time()
    stats = {"count": len(samples), "successes": len(samples), "failed_to_download": 0, "failed_to_resize": 0,
             "duration": end - start, "start_time": start, "end_time": end, "status_dict": {"success": len(samples)}}
    with open(os.path.join(out_dir, f"{name}_stats.json"), "w") as f:
        json.dump(stats, f, indent=4)
    _write_parquet(os.path.join(out_dir, f"{name}.parquet"), rows)
    return path


def write_shards(samples: Iterable[Sample], out_dir: str, samples_per_shard: int = ROWS_PER_SHARD_MAX, *,
                 change: str = "write them into another folder",
                 should_stop: Callable[[], bool] = stop_signals.never) -> list[str]:
    """Writes ``samples`` into ``out_dir/00000.tar, 00001.tar, ...``; returns the tar paths. Other files in
    ``out_dir`` are left alone; shard files there that clip_jax did not write stop it before it writes anything
    (``ownership.ForeignFiles``, ending with ``change``). ``should_stop()`` true before a shard ends the writing
    there (``stop_signals.CutShort``)."""
    if not 1 <= samples_per_shard <= ROWS_PER_SHARD_MAX:
        raise InvalidInput(f"samples_per_shard must be in [1, {ROWS_PER_SHARD_MAX}], got {samples_per_shard}")
    shard_files = [name for name in (os.listdir(out_dir) if os.path.isdir(out_dir) else []) if SHARD_FILE.match(name)]
    ownership.refuse_foreign(out_dir, shard_files, writing="writing shards", change=change)
    os.makedirs(out_dir, exist_ok=True)
    paths, pending = [], []
    for sample in samples:
        pending.append(sample)
        if len(pending) == samples_per_shard:
            stop_signals.cut_short_if(should_stop)  # a stop signal ends the writing between shards
            paths.append(write_shard(pending, out_dir, len(paths)))
            pending = []
    if pending:
        stop_signals.cut_short_if(should_stop)
        paths.append(write_shard(pending, out_dir, len(paths)))
    return paths


def shard_pattern(paths: list[str]) -> str:
    """The brace pattern naming ``paths`` written by :func:`write_shards`."""
    folder = os.path.dirname(paths[0])
    if len(paths) == 1:
        return paths[0]
    return os.path.join(folder, f"{{00000..{len(paths) - 1:05d}}}.tar")


def fashion_mnist_samples(split: str, root: str = fashion_mnist.DEFAULT_DIR, image_size: int | None = None,
                          limit: int | None = None, quality: int = 95) -> Iterator[Sample]:
    """Fashion-MNIST as greyscale JPEG samples (1 channel, as img2dataset stores greyscale), optionally upscaled."""
    images, labels = fashion_mnist.load(split, root)
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    captions = fashion_mnist.captions(labels, seed=0 if split == "train" else 1)
    for index, (pixels, caption) in enumerate(zip(images, captions)):
        image = Image.fromarray(pixels, mode="L")
        if image_size is not None and image_size != image.width:
            image = image.resize((image_size, image_size), Image.Resampling.BICUBIC)
        yield Sample(encode_jpeg(image, quality), "jpg", caption, f"fashion-mnist:{split}/{index}", image.width,
                     image.height, pixels.shape[1], pixels.shape[0])


def fashion_mnist_shards(out_dir: str, split: str = "train", *, root: str | None = None,
                         samples_per_shard: int = ROWS_PER_SHARD_MAX, image_size: int | None = None,
                         change: str = "choose a new or empty folder", note: str = "",
                         should_stop: Callable[[], bool] = stop_signals.never) -> str:
    """Shards of a Fashion-MNIST split in ``out_dir``, written on first use; returns their brace pattern.

    Processes that ask at the same time (the ranks of a local launch) get one set, written by one of them
    (:mod:`clip_jax.data.write_once`), into a folder that holds nothing clip_jax did not write (else
    ``ownership.ForeignFiles``, ending with ``change``). ``root``: the folder of the ``*-ubyte.gz`` files (default:
    Debian's). ``note``: a line the process that writes them prints first. ``should_stop``: as for
    :func:`write_shards` (a writer cut short leaves nothing of its set).
    """
    root = fashion_mnist.DEFAULT_DIR if root is None else root
    num_shards = -(-fashion_mnist.num_images(split, root) // samples_per_shard)
    names = [f"{i:05d}" for i in range(num_shards)]

    def write(folder: str) -> list[str]:
        if note:
            print(note, flush=True)
        return write_shards(fashion_mnist_samples(split, root, image_size), folder, samples_per_shard,
                            should_stop=should_stop)

    write_once.write_once(
        out_dir,
        is_complete=lambda: _stats_present(out_dir, names),
        write=write,
        marker_suffix="_stats.json", what=f"{num_shards} shards of the Fashion-MNIST {split} split", change=change)
    return shard_pattern([os.path.join(out_dir, f"{name}.tar") for name in names])


def _stats_present(folder: str, names: list[str]) -> bool:
    return all(os.path.exists(os.path.join(folder, f"{name}_stats.json")) for name in names)


def is_demo_folder(folder: str) -> bool:
    """Whether ``folder`` is one the demo's shard writer may fill: named for what it holds, ``.../fashion-mnist/train``
    (configs/demo.py's ``data/fashion-mnist/train``). Any other path, mistyped or one's own, is never filled."""
    return tuple(os.path.normpath(os.path.abspath(folder)).split(os.sep)[-2:]) == DEMO_FOLDER


def write_missing_shards(pattern: str, source: str, *, root: str | None = None,
                         should_stop: Callable[[], bool] = stop_signals.never) -> None:
    """Writes the shards ``pattern`` names from ``source`` when they are missing (a run config's ``train_data`` and
    ``make_train_data``).

    ``"fashion-mnist"``: the training split spread evenly over shards ``00000.tar, 00001.tar, ...`` of one local
    folder, as many as the pattern names (``{00000..00011}.tar``: 12 shards of 5,000 images). Shards that are all
    there with their ``_stats.json`` (whoever wrote them) are read as they are; a folder holding other files that
    clip_jax did not write is refused with one line naming them: it is the user's data, not the demo's. Only the
    demo's own folder is written (``is_demo_folder``): any other, new or empty, is refused in one line.
    ``should_stop``: as for :func:`write_shards`.
    """
    if source != "fashion-mnist":
        raise InvalidInput(f"make_train_data={source!r}: the trainer can write only 'fashion-mnist' shards; write "
                           "others with `python -m clip_jax.data.make_shards` and leave make_train_data empty")
    urls = expand_braces(pattern)
    folder = os.path.dirname(urls[0])
    if "://" in pattern or urls != [os.path.join(folder, f"{i:05d}.tar") for i in range(len(urls))]:
        raise InvalidInput(
            f"train_data={pattern!r} cannot be written from Fashion-MNIST: name shards 00000.tar, 00001.tar, ... "
            "of one local folder, e.g. 'data/fashion-mnist/train/{00000..00011}.tar'")
    if _stats_present(folder, [f"{i:05d}" for i in range(len(urls))]):
        return
    change = ("to train on them, set --config.make_train_data='' (and train_num_samples, without *_stats.json "
              "files); for the demo's shards, point train_data at a new folder named fashion-mnist/train")
    new_folder = not os.path.lexists(folder)
    ownership.refuse_foreign(folder, writing=f"make_train_data={source!r}", change=change)
    if not is_demo_folder(folder):
        raise InvalidInput(
            f"make_train_data={source!r} writes Fashion-MNIST only into the demo's own folder, one named "
            f"{'/'.join(DEMO_FOLDER)} (configs/demo.py's data/fashion-mnist/train), not {os.path.abspath(folder)}: "
            "to train on the shards train_data names, set --config.make_train_data=''")
    root = fashion_mnist.DEFAULT_DIR if root is None else root
    images = fashion_mnist.num_images("train", root)
    fewest = -(-images // ROWS_PER_SHARD_MAX)
    if len(urls) < fewest:
        raise InvalidInput(f"train_data={pattern!r} names {len(urls)} shard{'s' if len(urls) > 1 else ''}: "
                           f"make_train_data={source!r} spreads {images:,} images over them, at most "
                           f"{ROWS_PER_SHARD_MAX:,} a shard; name at least {fewest}, e.g. "
                           f"'{os.path.join(folder, '{00000..%05d}.tar' % (fewest - 1))}'")
    note = (f"make_train_data={source!r}: {os.path.abspath(folder)} does not exist yet; writing the {images:,} "
            f"Fashion-MNIST training images there as {len(urls)} shards (about "
            f"{images * FASHION_MNIST_SHARD_BYTES_PER_IMAGE / 1e6:,.0f} MB)") if new_folder else ""
    fashion_mnist_shards(folder, "train", root=root, samples_per_shard=-(-images // len(urls)), change=change,
                         note=note, should_stop=should_stop)


def read_captions_file(path: str) -> dict[str, str]:
    """Captions from ``.tsv``/``.csv`` (columns: image path relative to the folder, caption) or ``.jsonl``
    (``{"image": ..., "caption": ...}``)."""
    captions = {}
    with open(path, encoding="utf-8", newline="") as f:
        if path.endswith(".jsonl"):
            for line_number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                        captions[record["image"]] = record["caption"]
                    except (ValueError, KeyError) as e:
                        raise InvalidInput(
                            f"{path}:{line_number}: expected {{\"image\": ..., \"caption\": ...}}") from e
        else:
            delimiter = "\t" if path.endswith(".tsv") else ","
            for line_number, row in enumerate(csv.reader(f, delimiter=delimiter), 1):
                if not row or (line_number == 1 and [c.lower() for c in row[:2]] == ["image", "caption"]):
                    continue
                if len(row) < 2:
                    raise InvalidInput(f"{path}:{line_number}: expected two columns, image path and caption")
                captions[row[0]] = row[1]
    return captions


def image_folder_samples(folder: str, captions_file: str | None = None,
                         image_size: int | None = None) -> Iterator[Sample]:
    """Images under ``folder`` (sorted, recursive) with captions from ``captions_file`` or a sibling ``.txt``.

    Images without a caption are left out, with a warning. ``image_size`` resizes the shortest side (bicubic) and
    re-encodes as JPEG; otherwise the original bytes are kept.
    """
    if not os.path.isdir(folder):
        raise MissingInput(f"image folder {folder!r} does not exist")
    captions = read_captions_file(captions_file) if captions_file else None
    paths = sorted(
        os.path.relpath(os.path.join(d, name), folder)
        for d, _, names in os.walk(folder) for name in names
        if os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS
    )
    if not paths:
        raise MissingInput(f"no .jpg/.jpeg/.png/.webp image under {folder!r}")
    without_caption = 0
    for rel in paths:
        full = os.path.join(folder, rel)
        if captions is not None:
            caption = captions.get(rel)
        else:
            txt = os.path.splitext(full)[0] + ".txt"
            caption = open(txt, encoding="utf-8").read().strip() if os.path.exists(txt) else None
        if not caption:
            without_caption += 1
            continue
        with open(full, "rb") as f:
            data = f.read()
        image = Image.open(io.BytesIO(data))
        original = image.size
        extension = IMAGE_EXTENSIONS[os.path.splitext(rel)[1].lower()]
        if image_size is not None:
            image = image.convert("RGB") if image.mode not in ("RGB", "L") else image
            scale = image_size / min(image.size)
            image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC)
            data, extension = encode_jpeg(image), "jpg"
        yield Sample(data, extension, caption, "file://" + os.path.abspath(full), image.width, image.height,
                     *original)
    if without_caption:
        print(f"warning: {without_caption} of {len(paths)} images have no caption and were left out", file=sys.stderr)


@entry.command(stopped="before the shards were all written", user_error=1)
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clip_jax.data.make_shards", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="source", required=True)
    fm = commands.add_parser("fashion-mnist", help="shards from the bundled Fashion-MNIST")
    fm.add_argument("--root", default=fashion_mnist.DEFAULT_DIR, help="folder with the *-ubyte.gz files")
    fm.add_argument("--split", choices=["train", "test", "both"], default="both")
    fm.add_argument("--limit", type=int, default=None, help="first N images of each split")
    folder = commands.add_parser("folder", help="shards from an image folder and captions")
    folder.add_argument("--images", required=True, help="folder of images (searched recursively)")
    folder.add_argument("--captions", default=None,
                        help=".tsv/.csv (path, caption) or .jsonl; default: a .txt beside each image")
    for command in (fm, folder):
        command.add_argument("--out", required=True, help="output folder")
        command.add_argument("--samples-per-shard", type=int, default=ROWS_PER_SHARD_MAX)
        command.add_argument("--image-size", type=int, default=None, help="resize (bicubic) to this size")
    pq = commands.add_parser("filter-parquet", help="the rows of parquet metadata files a filter expression keeps")
    pq.add_argument("parquet", nargs="+", help="input parquet files (e.g. LAION's metadata)")
    pq.add_argument("--filter", required=True, help="an expression as train_data_filter, on the files' columns")
    pq.add_argument("--out", required=True, help="output parquet file")
    args = parser.parse_args(argv)

    if args.source == "filter-parquet":
        from clip_jax.data import filters, parquet_filter

        report = parquet_filter.write_filtered(args.parquet, filters.SampleFilter(args.filter), args.out)
        print(f"wrote {report.kept:,} of {report.rows:,} rows to {args.out}")
        return 0
    if args.source == "fashion-mnist":
        splits = ["train", "test"] if args.split == "both" else [args.split]
        jobs = [(os.path.join(args.out, split) if len(splits) > 1 else args.out,
                 fashion_mnist_samples(split, args.root, args.image_size, args.limit)) for split in splits]
    else:
        jobs = [(args.out, image_folder_samples(args.images, args.captions, args.image_size))]
    for out_dir, samples in jobs:
        paths = write_shards(samples, out_dir, args.samples_per_shard, change="give another --out folder")
        print(f"wrote {len(paths)} shards to {out_dir}: {shard_pattern(paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
