"""Fashion-MNIST's test split in CLIP_benchmark's webdataset layout against the same images held in memory (`--demo`).

    python benchmarks/clip_benchmark_eval.py --checkpoint logs/demo [--model configs/models/demo-tiny.json]

Writes the 10,000 test images (PNG) as a CLIP_benchmark classification folder — `classnames.txt` holding the class
names with their article ("an ankle boot") and `zeroshot_classification_templates.txt` the demo's templates with
`{c}`, so the prompts are exactly the demo's — then runs `python -m clip_jax.zeroshot` on it with `--benchmark` and
with `--demo`, on the same checkpoint. Both must give the same top-1 / acc1; the table shows the wall time of each
whole command (model load, compile, classifier, images) and of opening the folder (scanning its shards). With
`--with-clip-benchmark`, LAION's `clip-benchmark` package also scores the folder (its webdataset reader,
`zero_shot_classifier`, `run_classification`, fp32) with the OpenCLIP model of the checkpoint's params
(`convert.to_open_clip`), and must agree too. Writes benchmarks/out/clip_benchmark_eval.json.
"""

import argparse
import io
import json
import os
import pathlib
import platform
import tarfile
import tempfile
import time

import jax
from PIL import Image

from clip_jax.data import fashion_mnist
from clip_jax.evaluation import clip_benchmark, zeroshot

HERE = pathlib.Path(__file__).resolve().parent


def write_folder(root: pathlib.Path, per_shard: int = 2500) -> int:
    """The test split as a CLIP_benchmark folder; returns the number of images."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "classnames.txt").write_text("\n".join(fashion_mnist.with_article(c) for c in fashion_mnist.CLASS_NAMES)
                                         + "\n")
    (root / "zeroshot_classification_templates.txt").write_text(
        "\n".join(t.replace("{}", "{c}") for t in fashion_mnist.ZEROSHOT_TEMPLATES) + "\n")
    return write_split(root, "test", per_shard=per_shard)


def write_split(root: pathlib.Path, split: str, limit: int | None = None, per_shard: int = 2500) -> int:
    """The first `limit` images of a Fashion-MNIST split as `root/split/N.tar` (CLIP_benchmark's webdataset
    layout: KEY.png + KEY.cls) and `nshards.txt`; returns the number of images."""
    images, labels = fashion_mnist.load(split)
    images, labels = images[:limit], labels[:limit]
    (root / split).mkdir(parents=True)
    shards = -(-len(images) // per_shard)
    for s in range(shards):
        with tarfile.open(root / split / f"{s}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(s * per_shard, min(len(images), (s + 1) * per_shard)):
                png = io.BytesIO()
                Image.fromarray(images[i]).save(png, format="png")
                for ext, data in (("png", png.getvalue()), ("cls", str(int(labels[i])).encode())):
                    info = tarfile.TarInfo(f"s{i:07d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    (root / split / "nshards.txt").write_text(f"{shards}\n")
    return len(images)


def clip_benchmark_scores(folder: pathlib.Path, checkpoint: str, model_json: str, workers: int) -> dict:
    """acc1 / acc5 of LAION's clip-benchmark on the folder, with the OpenCLIP model of the checkpoint's params."""
    import open_clip
    import torch
    from clip_benchmark.datasets.builder import build_dataset
    from clip_benchmark.metrics.zeroshot_classification import run_classification, zero_shot_classifier

    from clip_jax.data.transforms import OPENAI_MEAN, OPENAI_STD
    from clip_jax.interop.convert import to_open_clip

    cfg = json.loads(pathlib.Path(model_json).read_text())
    model = open_clip.CLIP(**cfg)
    params = zeroshot.read_checkpoint(checkpoint, model_json)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in to_open_clip(params, model_json).items()})
    model.eval()
    size = cfg["vision_cfg"]["image_size"]
    transform = open_clip.image_transform(size, is_train=False, mean=OPENAI_MEAN, std=OPENAI_STD)
    dataset = build_dataset("wds/fashion_mnist", root=str(folder), transform=transform, split="test")
    loader = torch.utils.data.DataLoader(dataset.batched(256), batch_size=None, num_workers=workers)

    def tokenizer(texts):
        return open_clip.tokenize(texts, context_length=cfg["text_cfg"]["context_length"])

    start = time.perf_counter()
    classifier = zero_shot_classifier(model, tokenizer, dataset.classes, dataset.templates, "cpu", amp=False)
    logits, target = run_classification(model, classifier, loader, "cpu", amp=False)
    # Its accuracy() computes top-k with torch.topk; called by hand (its float() of a 1-element array fails under
    # NumPy 2).
    hits = logits.topk(5, 1, True, True)[1].t() == target.view(1, -1)
    return {"acc1": float(hits[:1].sum()) / len(target), "acc5": float(hits[:5].sum()) / len(target),
            "seconds": time.perf_counter() - start}


def timed_main(argv) -> float:
    start = time.perf_counter()
    assert zeroshot.main(argv) == 0
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a demo run directory (e.g. logs/demo)")
    parser.add_argument("--model", default=str(HERE.parent / "configs" / "models" / "demo-tiny.json"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--output", default=str(HERE / "out" / "clip_benchmark_eval.json"))
    parser.add_argument("--with-clip-benchmark", action="store_true", help="also score with LAION's clip-benchmark")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        folder = tmp / "fashion_mnist"
        num_images = write_folder(folder)
        start = time.perf_counter()
        clip_benchmark.open_dataset(str(folder))
        scan_s = time.perf_counter() - start
        common = ["--model", args.model, "--checkpoint", args.checkpoint, "--no-progress", "--workers",
                  str(args.workers)]
        demo_s = timed_main([*common, "--demo", "--output", str(tmp / "demo.json")])
        bench_s = timed_main([*common, "--benchmark", str(folder), "--output-dir", str(tmp / "results"),
                              "--output", str(tmp / "bench.json")])
        demo = next(iter(json.loads((tmp / "demo.json").read_text())["results"].values()))
        bench = json.loads((tmp / "bench.json").read_text())["results"]["wds/fashion_mnist"]["metrics"]
        laion = (clip_benchmark_scores(folder, args.checkpoint, args.model, args.workers)
                 if args.with_clip_benchmark else None)
    assert demo["top1"] == bench["acc1"] and demo["top5"] == bench["acc5"], (demo, bench)
    rows = [("--demo (arrays in memory)", demo_s, demo["top1"], demo["top5"]),
            ("--benchmark (CLIP_benchmark tars, PNG)", bench_s, bench["acc1"], bench["acc5"])]
    if laion is not None:
        assert (laion["acc1"], laion["acc5"]) == (bench["acc1"], bench["acc5"]), (laion, bench)
        rows.append(("clip-benchmark 1.6.2 + OpenCLIP (torch)", laion["seconds"], laion["acc1"], laion["acc5"]))
    print(f"{'command':<40} {'wall s':>8} {'images/s':>9} {'top1':>8} {'top5':>8}")
    for name, seconds, top1, top5 in rows:
        print(f"{name:<40} {seconds:8.1f} {num_images / seconds:9.0f} {100 * top1:7.2f}% {100 * top5:7.2f}%")
    print(f"opening the folder (scanning {num_images} samples): {scan_s:.2f} s; mean_per_class_recall "
          f"{100 * bench['mean_per_class_recall']:.2f}%")
    result = {"device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "jax_devices": jax.device_count(), "num_images": num_images, "scan_seconds": scan_s,
              "demo_seconds": demo_s, "benchmark_seconds": bench_s, "demo": demo, "benchmark": bench,
              "clip_benchmark": laion}
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2, default=float)
        f.write("\n")


if __name__ == "__main__":
    main()
