"""CLIPScore of image-caption pairs: `python -m clip_jax.score`.

    python -m clip_jax.score --checkpoint exported/ --images generated/ --captions prompts.csv --output scores.csv
    python -m clip_jax.score --checkpoint logs/demo --images 'shards/{00000..00009}.tar' --output scores.csv

The CLIPScore of an image and its caption (Hessel et al. 2021, as torchmetrics computes it) is 100 x max(cos, 0), the
cosine of the model's image and text embeddings. `--checkpoint` takes any model the other commands take
(`clip_jax.interop.opener`). `--images` is a folder of images, with `--captions FILE.csv` giving the caption of each
one scored (rows `filename,caption`, the name relative to the folder; a header row `filename,caption` may come
first), or webdataset shards (a brace pattern of `.tar` files), whose samples carry their captions (`.txt`). The
command prints `CLIPScore <mean>` over the pairs scored and writes one row per pair to `--output`
(`image,caption,score`). An image that does not decode is named, counted and skipped; so is an image file that
cannot be read.
"""

import argparse
import collections
import concurrent.futures
import csv
import os
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np

from clip_jax.data import skips, webdataset
from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.evaluation import embed_reader
from clip_jax.evaluation.embed_parts import shard_urls
from clip_jax.evaluation.embed_reader import Sample
from clip_jax.interop.opened_model import add_budget_argument
from clip_jax.runtime import entry

PROGRESS_EVERY_S = 10.0
SCALE = 100.0  # torchmetrics' CLIPScore: 100 x max(cos, 0)


def clip_scores(image_features: np.ndarray, text_features: np.ndarray) -> np.ndarray:
    """CLIPScore float64 [N] of row-aligned L2-normalised features [N, E]: 100 x max(cos, 0)."""
    cosine = np.sum(np.asarray(image_features, np.float64) * np.asarray(text_features, np.float64), axis=-1)
    return SCALE * np.maximum(cosine, 0.0)


def read_caption_rows(path: str) -> list[tuple[str, str]]:
    """(file name, caption) of each row of `--captions FILE.csv`; a first row `filename,caption` is a header."""
    if not os.path.isfile(path):
        raise MissingInput(f"--captions {path} does not exist: give a .csv of rows filename,caption")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = [row for row in csv.reader(f) if any(cell.strip() for cell in row)]
    except UnicodeDecodeError:
        raise InvalidInput(f"--captions {path} is not UTF-8 text") from None
    if rows and [cell.strip().lower() for cell in rows[0][:2]] == ["filename", "caption"]:
        rows = rows[1:]
    short = [number for number, row in enumerate(rows, 1) if len(row) < 2 or not row[1].strip()]
    if short:
        raise InvalidInput(f"--captions {path}: {len(short)} rows have no caption (first: data row {short[0]}); "
                           "each row is filename,caption")
    if not rows:
        raise InvalidInput(f"--captions {path} holds no row: give one filename,caption row per image")
    return [(row[0].strip(), row[1].strip()) for row in rows]


def folder_pairs(folder: str, captions: str | None) -> list[tuple[str, str]]:
    """(image path, caption) of each row of `captions`, each name checked to be a file in `folder`."""
    if captions is None:
        raise InvalidInput(f"--images {folder} is a folder: give --captions FILE.csv, a row filename,caption for "
                           "each image to score (webdataset shards carry their own captions)")
    rows = read_caption_rows(captions)
    missing = [name for name, _ in rows if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        raise InvalidInput(f"--captions {captions}: {len(missing)} of its {len(rows)} file names are no file in "
                           f"{folder} (first: {missing[0]!r}); the first column names an image relative to --images")
    return [(os.path.join(folder, name), caption) for name, caption in rows]


def folder_samples(pairs: list[tuple[str, str]], skipped: collections.Counter, named: list) -> Iterator[Sample]:
    """The pairs' samples, each image read as it is reached; one that cannot be read is counted and named."""
    for path, caption in pairs:
        try:
            with open(path, "rb") as f:
                image = f.read()
        except OSError as e:
            skipped[skips.MISSING_IMAGE] += 1
            named.append((path, f"cannot be read ({e.strerror or e})"))
            continue
        yield Sample(path, image, caption, None)


def open_pairs(args, skipped: collections.Counter, named: list) -> Iterator[Sample]:
    """The samples `--images` (and `--captions`) give."""
    if os.path.isdir(args.images):
        return folder_samples(folder_pairs(args.images, args.captions), skipped, named)
    if args.captions is not None:
        raise InvalidInput(f"--captions is for a folder of images; --images {args.images} names shards, whose samples "
                           "carry their captions")
    urls = shard_urls(args.images, "--images", "; give a folder of images (with --captions) or webdataset shards")
    return embed_reader.shard_part(urls, skipped, webdataset.SampleFormat(), need_image=True, need_text=True)


def score(args) -> dict:
    """Scores every pair; returns {"rows": [(image, caption, score)], "skipped": {reason: count}, "named": ...,
    "max_num_patches": a NaFlex model's budget, else None}."""
    import jax

    from clip_jax.data.transforms import normalize
    from clip_jax.evaluation.batches import pad_rows
    from clip_jax.evaluation.encoder import ShardedEncoder, round_up, shard_rows
    from clip_jax.evaluation.embed import read_model
    from clip_jax.interop.opener import open_model
    from clip_jax.text.model_tokenizer import tokenizer_for
    from clip_jax.runtime.mesh import create_mesh

    if args.batch_size < 1:
        raise InvalidInput(f"--batch-size {args.batch_size}: give at least 1")
    opened = open_model(args.checkpoint, args.model, what="--checkpoint",  # what the path holds, said first
                        max_num_patches=args.max_num_patches)
    skipped, named = collections.Counter(), []
    samples = open_pairs(args, skipped, named)  # the inputs checked before the weights are read
    model, params, mean, std, resize_mode = read_model(opened, f"--checkpoint {args.checkpoint}", args.model)
    tokenize = tokenizer_for(model.config)
    mesh = create_mesh(jax.local_devices())
    encoder = ShardedEncoder(model, mesh)
    placed = encoder.place(params)
    rows = round_up(args.batch_size, mesh.size)
    lock = threading.Lock()  # the tokenizer's cache is not shared between threads

    def tokens(texts):
        with lock:
            return tokenize(texts)

    scored, start, last = [], time.perf_counter(), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, args.workers)) as pool:
        for batch in embed_reader.batches(samples, skipped, pool, batch_size=rows, tokenize=tokens,
                                          image_size=model.config.vision.image_size, num_threads=args.workers,
                                          named=named, resize_mode=resize_mode):
            n = len(batch.samples)
            image_f = encoder.image_features(placed, shard_rows(normalize(pad_rows(batch.images, rows), mean, std),
                                                                encoder.mesh))
            text_f = encoder.text_features(placed, pad_rows(batch.tokens, rows))
            values = clip_scores(np.asarray(image_f)[:n], np.asarray(text_f)[:n])
            scored += [(s.image_path, s.caption, float(v)) for s, v in zip(batch.samples, values)]
            if time.perf_counter() - last >= PROGRESS_EVERY_S:
                last = time.perf_counter()
                print(f"score: {len(scored):,} pairs, {len(scored) / (last - start):.1f} pairs/s", file=sys.stderr,
                      flush=True)
    return {"rows": scored, "skipped": dict(sorted(skipped.items())), "named": named,
            "max_num_patches": opened.max_num_patches}


def write_rows(path: str, rows) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(("image", "caption", "score"))
        writer.writerows((image, caption, f"{value:.4f}") for image, caption, value in rows)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m clip_jax.score", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, metavar="PATH", help="the model: a run directory, one of its "
                        "checkpoints, an exported or transformers folder, or a weights file (with --model)")
    parser.add_argument("--model", help="model name or OpenCLIP model-config .json to read --checkpoint as")
    add_budget_argument(parser)
    parser.add_argument("--images", required=True, metavar="FOLDER_OR_SHARDS",
                        help="a folder of images (with --captions) or webdataset shards ('d/{00000..00009}.tar')")
    parser.add_argument("--captions", metavar="FILE.csv", help="rows filename,caption for a folder of images")
    parser.add_argument("--output", required=True, metavar="FILE.csv", help="one row per pair: image,caption,score")
    parser.add_argument("--batch-size", type=int, default=64, help="pairs encoded at a time")
    parser.add_argument("--workers", type=int, default=4, help="threads decoding images (and as many tokenizing)")
    return parser.parse_args(argv)


@entry.command(stopped="before the scores were written")
def main(argv=None) -> int:
    from clip_jax.runtime import ownership

    args = parse_args(argv)
    ownership.claim_file(args.output, writing="the scores", change="give another --output")  # before the work
    result = score(args)
    if not result["rows"]:
        raise MissingInput(f"--images {args.images}: no pair was scored (skipped: "
                           f"{', '.join(f'{r} {n}' for r, n in result['skipped'].items()) or 'none'})")
    for image, reason in result["named"]:
        print(f"skipped {image}: {reason}", file=sys.stderr)
    write_rows(args.output, result["rows"])
    values = [value for _, _, value in result["rows"]]
    skipped = ", ".join(f"{reason} {count}" for reason, count in result["skipped"].items()) or "none"
    budget = f", images at {result['max_num_patches']} patches" if result["max_num_patches"] else ""
    print(f"{len(values):,} pairs scored{budget}, written to {args.output}; skipped: {skipped}")
    print(f"CLIPScore {np.mean(values):.4f}")
    return 0
