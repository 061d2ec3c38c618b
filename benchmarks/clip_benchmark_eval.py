"""Fashion-MNIST's test split in CLIP_benchmark's webdataset layout against the same images held in memory (`--demo`).

    python benchmarks/clip_benchmark_eval.py --checkpoint logs/demo [--model configs/models/demo-tiny.json]

Writes the 10,000 test images (PNG) as a CLIP_benchmark classification folder — `classnames.txt` holding the class
names with their article ("an ankle boot") and `zeroshot_classification_templates.txt` the demo's templates with
`{c}`, so the prompts are exactly the demo's — then runs `python -m clip_jax.zeroshot` on it with `--benchmark` and
with `--demo`, on the same checkpoint. Both must give the same top-1 / acc1; the table shows the wall time of each
whole command (model load, compile, classifier, images) and of opening the folder (scanning its shards). Writes
benchmarks/out/clip_benchmark_eval.json.
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

from clip_jax import zeroshot
from clip_jax.data import fashion_mnist
from clip_jax.evaluation import clip_benchmark

HERE = pathlib.Path(__file__).resolve().parent


def write_folder(root: pathlib.Path, per_shard: int = 2500) -> int:
    """The test split as a CLIP_benchmark folder; returns the number of images."""
    images, labels = fashion_mnist.load("test")
    (root / "test").mkdir(parents=True)
    (root / "classnames.txt").write_text("\n".join(fashion_mnist.with_article(c) for c in fashion_mnist.CLASS_NAMES)
                                         + "\n")
    (root / "zeroshot_classification_templates.txt").write_text(
        "\n".join(t.replace("{}", "{c}") for t in fashion_mnist.ZEROSHOT_TEMPLATES) + "\n")
    shards = -(-len(images) // per_shard)
    for s in range(shards):
        with tarfile.open(root / "test" / f"{s}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(s * per_shard, min(len(images), (s + 1) * per_shard)):
                png = io.BytesIO()
                Image.fromarray(images[i]).save(png, format="png")
                for ext, data in (("png", png.getvalue()), ("cls", str(int(labels[i])).encode())):
                    info = tarfile.TarInfo(f"s{i:07d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    (root / "test" / "nshards.txt").write_text(f"{shards}\n")
    return len(images)


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
    assert demo["top1"] == bench["acc1"] and demo["top5"] == bench["acc5"], (demo, bench)
    rows = [("--demo (arrays in memory)", demo_s, demo["top1"], demo["top5"]),
            ("--benchmark (CLIP_benchmark tars, PNG)", bench_s, bench["acc1"], bench["acc5"])]
    print(f"{'command':<40} {'wall s':>8} {'images/s':>9} {'top1':>8} {'top5':>8}")
    for name, seconds, top1, top5 in rows:
        print(f"{name:<40} {seconds:8.1f} {num_images / seconds:9.0f} {100 * top1:7.2f}% {100 * top5:7.2f}%")
    print(f"opening the folder (scanning {num_images} samples): {scan_s:.2f} s; mean_per_class_recall "
          f"{100 * bench['mean_per_class_recall']:.2f}%")
    result = {"device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "jax_devices": jax.device_count(), "num_images": num_images, "scan_seconds": scan_s,
              "demo_seconds": demo_s, "benchmark_seconds": bench_s, "demo": demo, "benchmark": bench}
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2, default=float)
        f.write("\n")


if __name__ == "__main__":
    main()
