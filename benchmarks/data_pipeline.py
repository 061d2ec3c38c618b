"""Input pipeline throughput per CPU core: clip_jax's Grain pipeline against OpenCLIP's webdataset pipeline.

Both read the same 256 px JPEG shards (Fashion-MNIST photos upscaled to 256 px and coloured, made here) and do the
same work per sample: read from tar, decode, RandomResizedCrop(224, scale=(0.9, 1.0)) bicubic, normalise to float32,
tokenize the caption (77 tokens), batch. Each runs in this one process on one thread (no worker processes), so
samples per CPU-second is samples per core. Runs alternate to share the machine's noise.

    python benchmarks/data_pipeline.py                # prints a table, writes benchmarks/out/data_pipeline.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
import types

import numpy as np
from PIL import Image

from clip_jax import data
from clip_jax.data import fashion_mnist, make_shards

MEAN = STD = (0.5, 0.5, 0.5)
GPU_FEED_RATE = 800  # samples/s one GPU step consumes (the ViT-L/14 run: ~73 samples/s/A100; headroom x10)
CORES_PER_GPU = 16


def photo_samples(count: int, size: int = 256, seed: int = 0):
    """Fashion-MNIST garments upscaled to ``size`` px, tinted over a coloured gradient with noise, JPEG q90."""
    images, labels = fashion_mnist.load("train")
    captions = fashion_mnist.captions(labels[:count], seed=seed)
    rng = np.random.default_rng(seed)
    y, x = (np.mgrid[0:size, 0:size] / size).astype(np.float32)
    gradient = np.stack([x, y, 1 - x], -1) * 255  # [S, S, 3]
    noise = rng.normal(0, 8, (64, size, size, 3)).astype(np.float32)
    for index in range(count):
        garment = Image.fromarray(images[index]).resize((size, size), Image.Resampling.BICUBIC)
        alpha = np.asarray(garment, np.float32)[..., None] / 255  # [S, S, 1]
        tint = (rng.uniform(0.3, 1.0, 3) * 255).astype(np.float32)
        background = gradient * rng.uniform(0.2, 0.8, 3).astype(np.float32)
        pixels = alpha * tint + (1 - alpha) * background + noise[index % 64]
        pixels = np.clip(pixels, 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
        yield make_shards.Sample(buffer.getvalue(), "jpg", captions[index], f"bench:{index}", size, size, 28, 28)


def time_batches(batches, num_batches: int) -> dict[str, float]:
    """Takes one warm-up batch, then times ``num_batches`` batches."""
    first = next(batches)
    batch_size = len(first[0] if isinstance(first, (tuple, list)) else first["images"])
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(num_batches):
        next(batches)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    samples = num_batches * batch_size
    return {"samples": samples, "wall_s": wall, "cpu_s": cpu, "samples_per_s": samples / wall,
            "samples_per_cpu_s": samples / cpu}


def clip_jax_batches(pattern: str, batch_size: int):
    cfg = data.TrainDataConfig(shards=pattern, resampled=True, workers=0, seed=0)
    it = data.build_train_iterator(cfg, global_batch_size=batch_size, image_size=224, mean=MEAN, std=STD)
    while True:
        batch = next(it)
        assert batch["images"].shape == (batch_size, 224, 224, 3) and batch["images"].dtype == np.float32
        yield batch


def open_clip_batches(pattern: str, batch_size: int):
    import functools

    import open_clip
    import open_clip_train.data
    import webdataset

    # OpenCLIP's training code pins webdataset <= 0.2.86; webdataset 1.x ends each shard with an empty-dict marker
    # that OpenCLIP's key grouping cannot read. Turning the marker off restores the behaviour it was written for.
    open_clip_train.data.tar_file_expander = functools.partial(webdataset.tariterators.tar_file_expander,
                                                               eof_value=None)
    get_wds_dataset = open_clip_train.data.get_wds_dataset

    args = types.SimpleNamespace(
        train_data=pattern, val_data=None, dataset_resampled=True, train_num_samples=10**9,
        train_data_upsampling_factors=None, seed=0, batch_size=batch_size, workers=0, world_size=1,
    )
    preprocess = open_clip.image_transform(224, is_train=True, mean=MEAN, std=STD)
    tokenizer = open_clip.get_tokenizer("ViT-L-14")
    loader = get_wds_dataset(args, preprocess, is_train=True, epoch=0, tokenizer=tokenizer).dataloader
    for images, tokens in loader:
        assert tuple(images.shape) == (batch_size, 3, 224, 224) and tuple(tokens.shape) == (batch_size, 77)
        yield images, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=2000, help="samples in the generated shards")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--batches", type=int, default=12, help="timed batches per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "data_pipeline.json"))
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        paths = make_shards.write_shards(photo_samples(args.samples), folder, samples_per_shard=500)
        pattern = make_shards.shard_pattern(paths)
        print(f"made {len(paths)} shards of 256 px JPEGs in {time.perf_counter() - start:.1f} s: {pattern}")
        runs = {"clip_jax": [], "open_clip": []}
        for repeat in range(args.repeats):
            for name, make in (("clip_jax", clip_jax_batches), ("open_clip", open_clip_batches)):
                result = time_batches(make(pattern, args.batch_size), args.batches)
                runs[name].append(result)
                print(f"  run {repeat + 1} {name:<10} {result['samples_per_cpu_s']:7.1f} samples/CPU-s "
                      f"({result['samples_per_s']:.1f} samples/s wall)")

    summary = {name: {"samples_per_cpu_s": statistics.median(r["samples_per_cpu_s"] for r in results),
                      "samples_per_s": statistics.median(r["samples_per_s"] for r in results)}
               for name, results in runs.items()}
    ratio = summary["clip_jax"]["samples_per_cpu_s"] / summary["open_clip"]["samples_per_cpu_s"]
    per_gpu = summary["clip_jax"]["samples_per_cpu_s"] * CORES_PER_GPU
    print()
    print(f"{'pipeline':<12}{'samples/s/core':>16}{'wall samples/s':>16}")
    for name, values in summary.items():
        print(f"{name:<12}{values['samples_per_cpu_s']:>16.1f}{values['samples_per_s']:>16.1f}")
    print(f"ratio clip_jax / open_clip per core: {ratio:.2f}x (goal >= 1.2x)")
    print(f"{CORES_PER_GPU} cores at this rate: {per_gpu:.0f} samples/s (goal >= {GPU_FEED_RATE})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"batch_size": args.batch_size, "image_size": 224, "source_size": 256, "runs": runs,
                   "median": summary, "ratio_per_core": ratio, "projected_samples_per_s_16_cores": per_gpu}, f,
                  indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
