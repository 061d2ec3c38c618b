"""What writing transformers' files beside OpenCLIP's costs an export of ViT-L-14: `python -m clip_jax.export` of one
OpenCLIP checkpoint with both formats (the default) against `--no-transformers` (OpenCLIP's files alone), in one run.

    PYTHONPATH=. python benchmarks/export_formats.py [--model ViT-L-14] [--repeats 3]

The source is an OpenCLIP state_dict of the model with random float32 values (`.safetensors`, written once). Each
repeat exports it both ways into fresh folders, in alternating order, through `clip_jax.interop.export.export` (what
the command runs: read, convert to clip_jax's tree and back, write); the folders are deleted between exports. The
table gives the median seconds and the bytes written; the ratio is both / OpenCLIP alone. Writes
benchmarks/out/export_formats.json.
"""

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import tempfile
import time

import numpy as np

from clip_jax.interop import convert, export
from clip_jax.interop.weight_files import write_safetensors
from clip_jax.runtime import xla_gpu

HERE = pathlib.Path(__file__).resolve().parent


def source_checkpoint(model: str, path: pathlib.Path) -> None:
    rng = np.random.default_rng(0)
    shapes = convert.open_clip_shapes(model)
    write_safetensors(str(path), {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()})


def timed_export(source: pathlib.Path, out: pathlib.Path, model: str, transformers: bool) -> tuple[float, int]:
    start = time.perf_counter()
    _, skipped = export.export(str(source), str(out), model=model, transformers=transformers)
    seconds = time.perf_counter() - start
    assert (skipped is None) == transformers, skipped
    written = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    shutil.rmtree(out)
    return seconds, written


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ViT-L-14")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    xla_gpu.quiet_cuda_plugin()  # as the command: no CUDA start-up traceback on a machine without a GPU
    seconds = {"open_clip": [], "both": []}
    sizes = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        tmp = pathlib.Path(tmp)
        source = tmp / "open_clip_model.safetensors"
        source_checkpoint(args.model, source)
        timed_export(source, tmp / "warm-up", args.model, False)  # imports, the first shape trace
        for repeat in range(args.repeats):
            order = ("open_clip", "both") if repeat % 2 == 0 else ("both", "open_clip")
            for kind in order:
                s, sizes[kind] = timed_export(source, tmp / kind, args.model, kind == "both")
                seconds[kind].append(s)
                print(f"repeat {repeat}: {kind:<9} {s:6.2f} s", flush=True)
    median = {kind: statistics.median(values) for kind, values in seconds.items()}
    ratio = median["both"] / median["open_clip"]
    print(f"\n{args.model}, {platform.processor() or 'CPU'}, {os.cpu_count()} CPUs, median of {args.repeats}")
    print(f"{'export':<34} {'seconds':>8} {'GB written':>11}")
    for kind, name in (("open_clip", "OpenCLIP's files (--no-transformers)"), ("both", "OpenCLIP's and transformers'")):
        print(f"{name:<34} {median[kind]:8.2f} {sizes[kind] / 1e9:11.2f}")
    print(f"both / OpenCLIP alone: {ratio:.2f}x (goal <= 1.5x)")
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    report = {"model": args.model, "repeats": args.repeats, "seconds": seconds, "median_s": median,
              "bytes_written": sizes, "ratio_both_over_open_clip": ratio, "cpus": os.cpu_count(),
              "processor": platform.processor()}
    (out / "export_formats.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
