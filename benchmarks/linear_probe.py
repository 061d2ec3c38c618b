"""The linear probe of `python -m clip_jax.benchmark eval --task linear_probe` against the reference pipeline
(OpenCLIP's features of the same export + scikit-learn's logistic regression), on Fashion-MNIST, in one run.

    python benchmarks/linear_probe.py --checkpoint logs/demo [--train-limit 60000] [--test-limit 10000]

Writes the first `--train-limit` train and `--test-limit` test images (PNG) as a CLIP_benchmark folder with both
splits and exports the checkpoint (`clip_jax.export`). Ours: the whole command, cold (model load, compile, features
of both splits written to a fresh `--feature_root`, the weight-decay search and refit), then again with the features
cached (the probe alone). The reference: OpenCLIP's model of the export reads the same folder with LAION's
`clip-benchmark` webdataset reader and OpenCLIP's eval transform (fp32, `torch` threads = the CPU count), the
features L2-normalised; scikit-learn's `LogisticRegression` (lbfgs) with C chosen among 9 values in [1, 1e4] on a
stratified validation fifth of train, refit on all of train. CLIP_benchmark's own linear probe asserts CUDA, so it
is not the CPU baseline. The table gives seconds, seconds per 10,000 images (train + test) and test top-1; the ratio
is reference time / ours. Writes benchmarks/out/linear_probe.json.
"""

import argparse
import json
import os
import pathlib
import platform
import tempfile
import time

import numpy as np
from clip_benchmark_eval import write_split

from clip_jax.data import fashion_mnist
from clip_jax.evaluation import benchmark_cli
from clip_jax.interop import export as export_lib

HERE = pathlib.Path(__file__).resolve().parent
C_GRID = np.logspace(0, 4, 9)


def ours(folder: pathlib.Path, export: pathlib.Path, out: pathlib.Path, features: pathlib.Path) -> tuple[float, dict]:
    argv = ["eval", "--dataset", "wds/fashion", "--dataset_root", str(folder), "--pretrained", str(export),
            "--task", "linear_probe", "--feature_root", str(features), "--batch_size", "256",
            "--output", str(out / "{dataset}_{task}.json")]
    start = time.perf_counter()
    assert benchmark_cli.main(argv) == 0
    seconds = time.perf_counter() - start
    return seconds, json.loads((out / "fashion_linear_probe.json").read_text())["metrics"]


def reference(folder: pathlib.Path, export: pathlib.Path) -> dict:
    import open_clip
    import torch
    from clip_benchmark.datasets.builder import build_dataset
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    torch.set_num_threads(os.cpu_count() or 1)
    model, _, transform = open_clip.create_model_and_transforms(f"local-dir:{export}")
    model.eval()

    def features(split):
        dataset = build_dataset("wds/fashion", root=str(folder), transform=transform, split=split)
        loader = torch.utils.data.DataLoader(dataset.batched(256), batch_size=None, num_workers=0)
        rows, labels = [], []
        with torch.no_grad():
            for images, targets in loader:
                rows.append(model.encode_image(images).numpy())
                labels.append(targets.numpy())
        rows = np.concatenate(rows)
        return rows / np.linalg.norm(rows, axis=1, keepdims=True), np.concatenate(labels)

    start = time.perf_counter()
    (train_x, train_y), (test_x, test_y) = features("train"), features("test")
    features_s = time.perf_counter() - start
    print(f"reference features: {features_s:.1f} s", flush=True)
    start = time.perf_counter()
    fit_x, val_x, fit_y, val_y = train_test_split(train_x, train_y, test_size=0.2, stratify=train_y, random_state=0)
    scores = {}
    for c in C_GRID:
        scores[c] = LogisticRegression(C=c, max_iter=3000).fit(fit_x, fit_y).score(val_x, val_y)
        print(f"reference C={c:.3g}: validation top-1 {scores[c]:.4f} ({time.perf_counter() - start:.1f} s)",
              flush=True)
    best = max(scores, key=scores.get)
    acc1 = LogisticRegression(C=best, max_iter=3000).fit(train_x, train_y).score(test_x, test_y)
    return {"features_s": features_s, "probe_s": time.perf_counter() - start, "acc1": float(acc1), "C": float(best)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a run directory (e.g. logs/demo) or exported folder")
    parser.add_argument("--train-limit", type=int, default=60000)
    parser.add_argument("--test-limit", type=int, default=10000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        folder = tmp / "fashion"
        num_images = write_split(folder, "train", args.train_limit, 5000) + write_split(folder, "test", args.test_limit, 5000)
        (folder / "classnames.txt").write_text("\n".join(fashion_mnist.CLASS_NAMES) + "\n")
        (folder / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\n")
        export = tmp / "export"
        export_lib.export(args.checkpoint, str(export))
        cold_s, metrics = ours(folder, export, tmp, tmp / "features")
        cached_s, cached_metrics = ours(folder, export, tmp, tmp / "features")
        assert cached_metrics == metrics
        ref = reference(folder, export)
    per_10k = 10_000 / num_images
    rows = [("clip_jax, cold (features + probe)", cold_s, metrics["lp_acc1"]),
            ("clip_jax, features cached (probe)", cached_s, metrics["lp_acc1"]),
            ("OpenCLIP features + scikit-learn", ref["features_s"] + ref["probe_s"], ref["acc1"]),
            ("  of which scikit-learn", ref["probe_s"], ref["acc1"])]
    print(f"{num_images} images ({args.train_limit} train + {args.test_limit} test), {platform.processor() or ''} "
          f"{os.cpu_count()} CPUs")
    print(f"{'pipeline':<36} {'seconds':>8} {'s/10k img':>10} {'top-1':>7}")
    for name, seconds, acc1 in rows:
        print(f"{name:<36} {seconds:8.1f} {seconds * per_10k:10.2f} {100 * acc1:6.2f}%")
    ratio = (ref["features_s"] + ref["probe_s"]) / cold_s
    print(f"reference / clip_jax (cold): {ratio:.2f}x; top-1 difference {100 * (metrics['lp_acc1'] - ref['acc1']):+.2f}"
          " points")
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    report = {"num_images": num_images, "train": args.train_limit, "test": args.test_limit, "ours_cold_s": cold_s,
              "ours_cached_s": cached_s, "ours_metrics": metrics, "reference": ref, "ratio_reference_over_ours": ratio,
              "cpus": os.cpu_count(), "processor": platform.processor()}
    (out / "linear_probe.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
