"""What writing transformers' files beside OpenCLIP's costs an export of ViT-L-14: `python -m clip_jax.export` of one
OpenCLIP checkpoint with both formats (the default) against `--no-transformers` (OpenCLIP's files alone), in one run.

    PYTHONPATH=. python benchmarks/export_formats.py [--model ViT-L-14] [--repeats 3]

The source is an OpenCLIP state_dict of the model with random float32 values (`.safetensors`, written once). Each
repeat exports it both ways into fresh folders, in alternating order, through `clip_jax.interop.export.export` (what
the command runs: read, convert to clip_jax's tree and back, write); the folders are deleted between exports. The
table gives the median wall and CPU seconds and the bytes written; the ratio is the median over the repeats of
both / OpenCLIP alone (the two exports of a repeat run back to back). Writes benchmarks/out/export_formats.json.
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


def timed_export(source: pathlib.Path, out: pathlib.Path, model: str, transformers: bool) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of this process, bytes written) of one export into a fresh `out`."""
    start, cpu = time.perf_counter(), time.process_time()
    _, skipped = export.export(str(source), str(out), model=model, transformers=transformers)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert (skipped is None) == transformers, skipped
    written = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    shutil.rmtree(out)
    return seconds, cpu, written


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ViT-L-14")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    xla_gpu.quiet_cuda_plugin()  # as the command: no CUDA start-up traceback on a machine without a GPU
    seconds, cpu = {"open_clip": [], "both": []}, {"open_clip": [], "both": []}
    sizes = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        tmp = pathlib.Path(tmp)
        source = tmp / "open_clip_model.safetensors"
        source_checkpoint(args.model, source)
        timed_export(source, tmp / "warm-up", args.model, False)  # imports, the first shape trace
        for repeat in range(args.repeats):
            order = ("open_clip", "both") if repeat % 2 == 0 else ("both", "open_clip")
            for kind in order:
                wall, process, sizes[kind] = timed_export(source, tmp / kind, args.model, kind == "both")
                seconds[kind].append(wall)
                cpu[kind].append(process)
                print(f"repeat {repeat}: {kind:<9} {wall:6.2f} s ({process:6.2f} s CPU)", flush=True)
    median = {kind: statistics.median(values) for kind, values in seconds.items()}
    median_cpu = {kind: statistics.median(values) for kind, values in cpu.items()}
    # each repeat's pair ran back to back: its ratio is the least exposed to the load of other jobs drifting
    pair_ratios = [b / o for b, o in zip(seconds["both"], seconds["open_clip"])]
    ratio = statistics.median(pair_ratios)
    print(f"\n{args.model}, {platform.processor() or 'CPU'}, {os.cpu_count()} CPUs, median of {args.repeats}")
    print(f"{'export':<38} {'seconds':>8} {'CPU s':>7} {'GB written':>11}")
    for kind, name in (("open_clip", "OpenCLIP's files (--no-transformers)"), ("both", "OpenCLIP's and transformers'")):
        print(f"{name:<38} {median[kind]:8.2f} {median_cpu[kind]:7.2f} {sizes[kind] / 1e9:11.2f}")
    print(f"both / OpenCLIP alone, median of the repeats' ratios: {ratio:.2f}x (each: "
          f"{', '.join(f'{r:.2f}' for r in pair_ratios)}; goal <= 1.5x); CPU seconds: "
          f"{median_cpu['both'] / median_cpu['open_clip']:.2f}x")
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    report = {"model": args.model, "repeats": args.repeats, "seconds": seconds, "cpu_seconds": cpu,
              "median_s": median, "median_cpu_s": median_cpu, "bytes_written": sizes, "pair_ratios": pair_ratios,
              "ratio_both_over_open_clip": ratio, "cpus": os.cpu_count(), "processor": platform.processor()}
    (out / "export_formats.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
