"""Embedding throughput: `python -m clip_jax.embed` against OpenCLIP's own encode loop as clip-retrieval runs it.

    python benchmarks/embed.py [--model ViT-B-32] [--samples 256] [--batch-size 64] [--workers 2] [--repeats 2]
    python benchmarks/embed.py --model tiny-224   # a tiny 224 px model: decoding and resizing dominate
    python benchmarks/embed.py --towers           # also both models' towers alone on one batch (CPU-seconds)

Both sides read the same webdataset shards (photo-like JPEGs of 400-500 x 300-375 px, quality 90, a caption each)
and the same exported model (OpenCLIP's random init of `--model`, written as an OpenCLIP folder), embed images and
captions, and write float16 embeddings and a parquet of keys and captions. OpenCLIP's side is clip-retrieval's
inference loop: `webdataset.WebDataset` with its `select` and `map` (PIL open, OpenCLIP's eval transform, its
tokenizer), a `DataLoader` with `--workers` worker processes, `encode_image` / `encode_text`, normalised, float16.
clip_jax's side is `clip_jax.evaluation.embed.run` with `--workers` decoding threads over all JAX devices.

Each side runs in a process of its own, the two alternating `--repeats` times; inside, one warm-up pass over one
batch (JIT compilation, worker start) precedes the timed pass over every shard. Reported: samples per second of
wall time and per CPU-second (the process's threads and its worker processes), so "per core". Prints a table and
writes benchmarks/out/embed-MODEL.json.
"""

import argparse
import io
import json
import os
import platform
import resource
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

TINY_224 = {"embed_dim": 64, "vision_cfg": {"image_size": 224, "layers": 1, "width": 64, "patch_size": 32},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 1}}
CAPTIONS = ("a dog running on a beach with a red ball", "an old wooden house in the snow at dusk",
            "close-up of a bowl of ramen with an egg", "a city skyline reflected in a river at night")
OPENAI_MEAN, OPENAI_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def make_export(folder: str, model_name: str) -> None:
    """OpenCLIP's random init of the model, written as the folder `local-dir:` loads."""
    import open_clip
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    config = TINY_224 if model_name == "tiny-224" else open_clip.get_model_config(model_name)
    model = open_clip.CLIP(**config)
    os.makedirs(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(folder, "open_clip_model.safetensors"))
    preprocess = {"size": config["vision_cfg"]["image_size"], "mode": "RGB", "mean": list(OPENAI_MEAN),
                  "std": list(OPENAI_STD), "interpolation": "bicubic", "resize_mode": "shortest"}
    with open(os.path.join(folder, "open_clip_config.json"), "w") as f:
        json.dump({"model_cfg": config, "preprocess_cfg": preprocess}, f)


def make_shards(folder: str, samples: int, per_shard: int, seed: int = 0) -> list[str]:
    """Photo-like JPEGs (a coarse random grid, upsampled, with noise) with captions, `per_shard` a shard."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    paths = []
    for start in range(0, samples, per_shard):
        paths.append(os.path.join(folder, f"{len(paths):05d}.tar"))
        with tarfile.open(paths[-1], "w") as tar:
            for i in range(start, min(start + per_shard, samples)):
                width, height = int(rng.integers(400, 501)), int(rng.integers(300, 376))
                coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8))
                pixels = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), np.int16)
                pixels = np.clip(pixels + rng.integers(-12, 13, pixels.shape), 0, 255).astype(np.uint8)
                buffer = io.BytesIO()
                Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
                for name, data in ((f"{i:09d}.jpg", buffer.getvalue()),
                                   (f"{i:09d}.txt", CAPTIONS[i % len(CAPTIONS)].encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return paths


class Clock:
    """Wall seconds and CPU seconds of this process's threads and of its reaped children."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), self._cpu()

    @staticmethod
    def _cpu() -> float:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + children.ru_utime + children.ru_stime

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, self._cpu() - self.cpu


def open_clip_side(export: str, shards: list[str], warmup: list[str], out: str, batch_size: int,
                   workers: int) -> dict:
    """clip-retrieval's inference loop (its reader, mapper and writer) with OpenCLIP's model."""
    import open_clip
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import webdataset as wds
    from PIL import Image

    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{export}")
    model.eval()
    tokenizer = open_clip.get_tokenizer(f"local-dir:{export}")

    def loader(urls):
        def sample(item):
            image = preprocess(Image.open(io.BytesIO(item["jpg"])))
            caption = item["txt"].decode("utf-8")
            return {"image_filename": item["__key__"], "image_tensor": image, "text_tokens": tokenizer([caption])[0],
                    "text": caption}

        dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False).select(lambda item: "jpg" in item and "txt" in item)
        dataset = dataset.map(sample, handler=wds.handlers.warn_and_continue)
        return torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers, shuffle=False,
                                           prefetch_factor=2 if workers else None)

    def embed(urls, name) -> int:
        images, texts, keys, captions = [], [], [], []
        with torch.no_grad():
            for batch in loader(urls):
                image_f = model.encode_image(batch["image_tensor"])
                text_f = model.encode_text(batch["text_tokens"])
                images.append((image_f / image_f.norm(dim=-1, keepdim=True)).to(torch.float16).numpy())
                texts.append((text_f / text_f.norm(dim=-1, keepdim=True)).to(torch.float16).numpy())
                keys += batch["image_filename"]
                captions += batch["text"]
        os.makedirs(out, exist_ok=True)
        np.save(os.path.join(out, f"img_emb_{name}.npy"), np.concatenate(images))
        np.save(os.path.join(out, f"text_emb_{name}.npy"), np.concatenate(texts))
        pq.write_table(pa.table({"image_path": keys, "caption": captions}), os.path.join(out, f"meta_{name}.parquet"))
        return len(keys)

    embed(warmup, "warmup")
    clock = Clock()
    samples = embed(shards, "0")
    wall, cpu = clock.read()
    return {"samples": samples, "wall_s": wall, "cpu_s": cpu, "threads": torch.get_num_threads()}


def clip_jax_side(export: str, shards: list[str], warmup: list[str], out: str, batch_size: int,
                  workers: int) -> dict:
    from clip_jax.evaluation import embed

    def run(urls, folder):
        pattern = urls[0] if len(urls) == 1 else "{" + ",".join(urls) + "}"
        args = embed.parse_args(["--input_dataset", pattern, "--input_format", "webdataset", "--output_folder",
                                 folder, "--clip_model", export, "--batch_size", str(batch_size),
                                 "--num_prepro_workers", str(workers)])
        return embed.run(args)

    run(warmup, os.path.join(out, "warmup"))
    clock = Clock()
    summary = run(shards, os.path.join(out, "timed"))
    wall, cpu = clock.read()
    return {"samples": summary["samples"], "wall_s": wall, "cpu_s": cpu}


def towers_side(export: str, batch_size: int, repeats: int = 2) -> dict:
    """CPU-seconds of one batch through both towers (random images, one caption), OpenCLIP's and clip_jax's."""
    import jax
    import open_clip
    import torch

    import clip_jax

    reference = open_clip.create_model_and_transforms(f"local-dir:{export}")[0].eval()
    model, params, _, _ = clip_jax.create_model_and_transforms(f"local-dir:{export}")
    size = model.config.vision.image_size
    images = np.random.default_rng(0).normal(size=(batch_size, size, size, 3)).astype(np.float32)
    tokens = np.asarray(clip_jax.get_tokenizer(f"local-dir:{export}")([CAPTIONS[0]] * batch_size))
    towers = jax.jit(lambda p, i, t: (model.apply({"params": p}, i, method="encode_image"),
                                      model.apply({"params": p}, t, method="encode_text")))

    def open_clip_towers():
        with torch.no_grad():
            reference.encode_image(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous())
            reference.encode_text(torch.from_numpy(tokens).long())

    measured = {}
    for side, step in (("open_clip", open_clip_towers),
                       ("clip_jax", lambda: jax.block_until_ready(towers(params, images, tokens)))):
        step()  # warm-up (compilation)
        start = time.process_time()
        for _ in range(repeats):
            step()
        measured[side] = (time.process_time() - start) / repeats
    return measured


def side_in_process(side: str, options: dict) -> dict:
    """Runs one side in a fresh Python process and returns what it measured."""
    command = [sys.executable, __file__, "--side", side, "--side-options", json.dumps(options)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{side} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--per-shard", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--side", choices=("open_clip", "clip_jax", "towers"), help=argparse.SUPPRESS)
    parser.add_argument("--side-options", help=argparse.SUPPRESS)
    parser.add_argument("--towers", action="store_true", help="also time both models' towers alone on one batch")
    parser.add_argument("--out", help="JSON path (default benchmarks/out/embed-MODEL.json)")
    args = parser.parse_args(argv)
    if args.side:
        options = json.loads(args.side_options)
        sides = {"open_clip": open_clip_side, "clip_jax": clip_jax_side, "towers": towers_side}
        print(json.dumps(sides[args.side](**options)))
        return 0

    with tempfile.TemporaryDirectory() as root:
        export = os.path.join(root, "model")
        make_export(export, args.model)
        os.makedirs(os.path.join(root, "shards"))
        os.makedirs(os.path.join(root, "warmup"))
        shards = make_shards(os.path.join(root, "shards"), args.samples, args.per_shard)
        warmup = make_shards(os.path.join(root, "warmup"), args.batch_size, args.batch_size, seed=1)
        runs = {"open_clip": [], "clip_jax": []}
        for repeat in range(args.repeats):
            for side in ("open_clip", "clip_jax"):
                options = {"export": export, "shards": shards, "warmup": warmup, "batch_size": args.batch_size,
                           "workers": args.workers, "out": os.path.join(root, f"out-{side}-{repeat}")}
                measured = side_in_process(side, options)
                runs[side].append(measured)
                print(f"{side} run {repeat}: {measured['samples']} samples, {measured['wall_s']:.1f} s wall, "
                      f"{measured['cpu_s']:.1f} CPU-s", flush=True)
        towers = side_in_process("towers", {"export": export, "batch_size": args.batch_size}) if args.towers else None

    def best(side, key):  # the fastest repeat: the one the machine's other jobs disturbed least
        return max(r["samples"] / r[key] for r in runs[side])

    rows = [(side, best(side, "wall_s"), best(side, "cpu_s")) for side in ("open_clip", "clip_jax")]
    print(f"\n{args.model}, {args.samples} samples, batch {args.batch_size}, {args.workers} workers, "
          f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})")
    print(f"| pipeline | samples/s (wall) | samples per CPU-second |\n| --- | ---: | ---: |")
    for side, wall, cpu in rows:
        print(f"| {side} | {wall:.2f} | {cpu:.2f} |")
    wall_ratio, cpu_ratio = rows[1][1] / rows[0][1], rows[1][2] / rows[0][2]
    print(f"| clip_jax / OpenCLIP | {wall_ratio:.2f}x | {cpu_ratio:.2f}x |")
    if towers:
        print(f"towers alone, one batch of {args.batch_size}: OpenCLIP {towers['open_clip']:.2f} CPU-s, clip_jax "
              f"{towers['clip_jax']:.2f} CPU-s ({towers['open_clip'] / towers['clip_jax']:.2f}x)")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", f"embed-{args.model}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"model": args.model, "samples": args.samples, "batch_size": args.batch_size,
                   "workers": args.workers, "cpus": os.cpu_count(), "runs": runs, "ratio_wall": wall_ratio,
                   "ratio_per_cpu_second": cpu_ratio,
                   "towers_cpu_s_per_batch": towers}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
