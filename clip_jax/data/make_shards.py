"""Writes webdataset shards in img2dataset's format (:mod:`clip_jax.data.shard_writer`), from an image folder with
captions (:mod:`clip_jax.data.image_folder`: bad files are left out, counted and named) or from Fashion-MNIST.

    python -m clip_jax.data.make_shards fashion-mnist --out /tmp/fmnist            # train/ and test/ shards
    python -m clip_jax.data.make_shards fashion-mnist --out /tmp/fm256 --image-size 256 --split test
    python -m clip_jax.data.make_shards folder --images photos/ --captions captions.tsv --out /tmp/photos
    python -m clip_jax.data.make_shards filter-parquet laion/part-*.parquet --out kept.parquet \
        --filter "punsafe < 0.5 and pwatermark < 0.8"      # LAION's metadata, pre-filtered for img2dataset
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator

from PIL import Image

from clip_jax.data import fashion_mnist, write_once
from clip_jax.data.image_folder import image_folder_samples
from clip_jax.data.shard_writer import ROWS_PER_SHARD_MAX, Sample, encode_jpeg, shard_pattern, write_shards
from clip_jax.data.shards import expand_braces
from clip_jax.errors import InvalidInput
from clip_jax.runtime import entry, ownership, stop_signals

# What the demo's shards take per Fashion-MNIST image (tar members, stats and parquet): 3.84 MB for the first 1,024
FASHION_MNIST_SHARD_BYTES_PER_IMAGE = 3_750
DEMO_FOLDER = ("fashion-mnist", "train")  # the last two parts of the only folders make_train_data writes


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
