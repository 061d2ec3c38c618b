"""Input pipeline throughput per CPU core: clip_jax's Grain pipeline against OpenCLIP's webdataset pipeline.

Both read the same 256 px JPEG shards (Fashion-MNIST photos upscaled to 256 px and coloured, made here) and do the
same work per sample: read from tar, decode, RandomResizedCrop(224, scale=(0.9, 1.0)) bicubic, normalise to float32,
tokenize the caption (77 tokens), batch. Each runs in this one process on one thread (no worker processes), so
samples per CPU-second is samples per core. Runs alternate to share the machine's noise.

``clip_jax_filtered`` is clip_jax's pipeline with sample filters on (``FILTER``: four rules on each sample's .json,
a minimum image size and caption length, chosen to keep every sample so both read the same images): the cost of
filtering, measured against ``clip_jax`` in the same run. ``clip_jax_streams`` reads the same data as 16 data streams
(``data_streams``, each its own shard reads and shuffle window): the cost of streams against one. ``synthetic`` is
``dataset_type="synthetic"`` (no reading, no decoding): the loader's floor.

    python benchmarks/data_pipeline.py                # prints a table, writes benchmarks/out/data_pipeline.json
    python benchmarks/data_pipeline.py --no-open-clip --repeats 5   # filters on vs off only
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
from clip_jax.data import fashion_mnist, filters, make_shards

MEAN = STD = (0.5, 0.5, 0.5)
GPU_FEED_RATE = 800  # samples/s one GPU step consumes (the ViT-L/14 run: ~73 samples/s/A100; headroom x10)
CORES_PER_GPU = 16
# keeps every benchmark sample (img2dataset-like .json written by make_shards), so it only adds the filter's cost
FILTER = "status == 'success' and width >= 64 and original_width > 0 and not caption == ''"
STREAMS = 16  # clip_jax_streams: data streams in one process (the reference run: 28 per GPU process, 8 samples each)


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
            "samples_per_cpu_s": samples / max(cpu, 1e-9)}


def clip_jax_batches(pattern: str, batch_size: int, sample_filter: filters.SampleFilter | None = None):
    cfg = data.TrainDataConfig(shards=pattern, resampled=True, workers=0, seed=0, sample_filter=sample_filter)
    it = data.build_train_iterator(cfg, global_batch_size=batch_size, image_size=224, mean=MEAN, std=STD)
    while True:
        batch = next(it)
        assert batch["images"].shape == (batch_size, 224, 224, 3) and batch["images"].dtype == np.float32
        if sample_filter is not None:
            assert not it.skipped_samples(), it.skipped_samples()  # the filter keeps every sample
        yield batch


def clip_jax_streams_batches(pattern: str, batch_size: int):
    """The same pipeline read as ``STREAMS`` data streams in this one process (``data_streams``), each stream giving
    ``batch_size / STREAMS`` samples of every batch: the reference run's 8 samples per stream per step at batch 128."""
    cfg = data.TrainDataConfig(shards=pattern, resampled=True, workers=0, seed=0, streams=STREAMS)
    it = data.build_train_iterator(cfg, global_batch_size=batch_size, image_size=224, mean=MEAN, std=STD)
    while True:
        batch = next(it)
        assert batch["images"].shape == (batch_size, 224, 224, 3) and len(it.last_keys) == batch_size
        yield batch


def clip_jax_filtered_batches(pattern: str, batch_size: int):
    sample_filter = filters.SampleFilter(FILTER, min_image_size=64, min_caption_chars=1)
    yield from clip_jax_batches(pattern, batch_size, sample_filter)


def synthetic_batches(pattern: str, batch_size: int):
    """``dataset_type="synthetic"``: what the loader costs when it reads nothing."""
    del pattern
    cfg = data.TrainDataConfig(shards="", dataset_type="synthetic", seed=0)
    yield from data.build_train_iterator(cfg, global_batch_size=batch_size, image_size=224, mean=MEAN, std=STD)


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


LAION_FILTER = "punsafe < 0.5 and pwatermark < 0.8 and similarity >= 0.28 and NSFW != 'NSFW'"
LAION_JSON = {  # the fields img2dataset writes for a LAION-2B-en sample, with plausible values
    "url": "https://example.com/images/2021/07/summer-beach-dog-with-red-ball-123456.jpg",
    "caption": "A golden retriever running on a sandy beach with a red ball in its mouth, summer 2021",
    "key": "000123456", "status": "success", "error_message": None, "width": 256, "height": 256,
    "original_width": 1024, "original_height": 768, "exif": '{"Image Make": "Canon", "Image Model": "EOS 80D"}',
    "sha256": "ab" * 32, "NSFW": "UNLIKELY", "similarity": 0.3312, "LICENSE": "?", "punsafe": 0.0123,
    "pwatermark": 0.101,
}


def filter_cost_us(repeats: int = 20_000) -> float:
    """CPU microseconds the LAION filter (four rules, min size, min caption) takes on one LAION-like .json."""
    sample_filter = filters.SampleFilter(LAION_FILTER, min_image_size=64, min_caption_chars=5)
    metadata = json.dumps(LAION_JSON).encode()
    assert sample_filter.check(metadata, b"", LAION_JSON["caption"]) is None
    start = time.process_time()
    for _ in range(repeats):
        sample_filter.check(metadata, b"", LAION_JSON["caption"])
    return (time.process_time() - start) / repeats * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=2000, help="samples in the generated shards")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--batches", type=int, default=12, help="timed batches per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-open-clip", action="store_true", help="time clip_jax with and without filters only")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "data_pipeline.json"))
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        paths = make_shards.write_shards(photo_samples(args.samples), folder, samples_per_shard=500)
        pattern = make_shards.shard_pattern(paths)
        print(f"made {len(paths)} shards of 256 px JPEGs in {time.perf_counter() - start:.1f} s: {pattern}")
        pipelines = {"clip_jax": clip_jax_batches, "clip_jax_filtered": clip_jax_filtered_batches,
                     "clip_jax_streams": clip_jax_streams_batches, "synthetic": synthetic_batches}
        if not args.no_open_clip:
            pipelines["open_clip"] = open_clip_batches
        runs = {name: [] for name in pipelines}
        for repeat in range(args.repeats):
            for name, make in pipelines.items():
                result = time_batches(make(pattern, args.batch_size), args.batches)
                runs[name].append(result)
                print(f"  run {repeat + 1} {name:<10} {result['samples_per_cpu_s']:7.1f} samples/CPU-s "
                      f"({result['samples_per_s']:.1f} samples/s wall)")

    summary = {name: {"samples_per_cpu_s": statistics.median(r["samples_per_cpu_s"] for r in results),
                      "samples_per_s": statistics.median(r["samples_per_s"] for r in results)}
               for name, results in runs.items()}
    per_gpu = summary["clip_jax"]["samples_per_cpu_s"] * CORES_PER_GPU
    # filters on / off: the median over repeats of each repeat's own ratio (the two runs of a repeat are adjacent)
    filter_ratio = statistics.median(on["samples_per_cpu_s"] / off["samples_per_cpu_s"]
                                     for on, off in zip(runs["clip_jax_filtered"], runs["clip_jax"]))
    print()
    print(f"{'pipeline':<20}{'samples/s/core':>16}{'wall samples/s':>16}")
    for name, values in summary.items():
        print(f"{name:<20}{values['samples_per_cpu_s']:>16.1f}{values['samples_per_s']:>16.1f}")
    ratio = None
    if "open_clip" in summary:
        ratio = summary["clip_jax"]["samples_per_cpu_s"] / summary["open_clip"]["samples_per_cpu_s"]
        print(f"ratio clip_jax / open_clip per core: {ratio:.2f}x (goal >= 1.2x)")
    print(f"filters on / off per core: {filter_ratio:.3f}x (goal >= 0.95x)")
    streams_ratio = statistics.median(many["samples_per_cpu_s"] / one["samples_per_cpu_s"]
                                      for many, one in zip(runs["clip_jax_streams"], runs["clip_jax"]))
    print(f"{STREAMS} data streams / one per core: {streams_ratio:.3f}x")
    cost = filter_cost_us()
    share = cost * summary["clip_jax"]["samples_per_cpu_s"] / 1e6
    print(f"LAION filter on a LAION-like .json: {cost:.1f} us per sample, {100 * share:.2f}% of a sample's CPU time")
    print(f"{CORES_PER_GPU} cores at this rate: {per_gpu:.0f} samples/s (goal >= {GPU_FEED_RATE})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"batch_size": args.batch_size, "image_size": 224, "source_size": 256, "runs": runs,
                   "median": summary, "ratio_per_core": ratio,
                   "filter": FILTER, "filtered_over_unfiltered_per_core": filter_ratio,
                   "streams": STREAMS, "streams_over_one_per_core": streams_ratio,
                   "laion_filter": LAION_FILTER, "laion_filter_us_per_sample": cost, "laion_filter_cpu_share": share,
                   "projected_samples_per_s_16_cores": per_gpu}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
