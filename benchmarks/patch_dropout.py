"""Patch dropout (FLIP): train-step samples/s with and without it, measured in one run.

    python benchmarks/patch_dropout.py [--model ViT-B-16] [--batch 4] [--patch-dropout 0.5] [--steps 4]
                                       [--precision fp32|bf16] [--out DIR]

Builds the same step twice (AdamW, no remat, every local device; attention as the trainer's "auto" picks it for
the precision and device), once with the image tower keeping
max(1, int(N * (1 - p))) patches per sample and once with every patch, on the same random batch. The two take
turns step by step, so that other load on the machine hits both alike. Prints a table (median and best step
time, samples/s, the analytic train FLOPs per sample that count the kept tokens) and the ratio of samples/s,
and writes OUT/patch_dropout-MODEL-PRECISION-bBATCH-pP.json (OUT: benchmarks/out).
"""

import argparse
import json
import os
import pathlib
import platform
import statistics

import jax
from train_step import compiled_runner, keep_freed_memory_mapped, random_batch, time_steps

from clip_jax.models import get_model_config
from clip_jax.models.flops import image_tokens, train_flops
from clip_jax.models.attention import choose_attention_impl
from clip_jax.models.precision import get_policy
from clip_jax.runtime.mesh import create_mesh, make_global_batch
from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step


def compiled_step(config, patch_dropout: float, batch, mesh, precision: str) -> tuple:
    """(run_step, record) of the step with `patch_dropout`."""
    attention = choose_attention_impl("auto", mesh.devices.flat[0].platform, get_policy(precision).compute_dtype)
    spec = StepSpec.for_model(config, precision, "none", attention, patch_dropout=patch_dropout,
                              optimizer=OptimizerSpec(lr=1e-3, warmup=10, total_steps=10_000))
    step = build_step(spec, mesh)
    run_step, compiled, compile_s = compiled_runner(step, step.init(0), make_global_batch(batch, mesh))
    return run_step, {"patch_dropout": patch_dropout, "compile_s": compile_s, "attention": attention,
                      "image_tokens": image_tokens(spec.model.vision, train=True),
                      "train_flops_per_sample": train_flops(spec.model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="ViT-B-16")
    parser.add_argument("--batch", type=int, default=4, help="global batch size")
    parser.add_argument("--patch-dropout", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each after compilation")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "pure_bf16"])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "out"))
    args = parser.parse_args()
    keep_freed_memory_mapped()

    load_at_start = os.getloadavg()[0]
    config = get_model_config(args.model)
    mesh = create_mesh(jax.local_devices())
    batch = random_batch(config, args.batch)
    steps = [compiled_step(config, p, batch, mesh, args.precision) for p in (args.patch_dropout, 0.0)]
    times = time_steps([run for run, _ in steps], args.steps, args.warmup)

    device = jax.local_devices()[0]
    print(f"train step, {args.model} b={args.batch} {args.precision}, {jax.device_count()} x {device.device_kind}, "
          f"load average {load_at_start:.1f} at start")
    print(f"{'patch dropout':<15}{'tokens':>8}{'GFLOP/sample':>14}{'compile s':>11}{'median s':>10}{'best s':>9}"
          f"{'samples/s':>11}")
    records = []
    for (_, record), seconds in zip(steps, times, strict=True):
        step_s = statistics.median(seconds)
        record.update(step_times_s=seconds, step_s=step_s, samples_per_s=args.batch / step_s)
        records.append(record)
        print(f"{record['patch_dropout']:<15g}{record['image_tokens']:>8}"
              f"{record['train_flops_per_sample'] / 1e9:>14.1f}{record['compile_s']:>11.1f}{step_s:>10.3f}"
              f"{min(seconds):>9.3f}{record['samples_per_s']:>11.3f}")
    dropped, full = records
    ratio = dropped["samples_per_s"] / full["samples_per_s"]
    best_ratio = min(full["step_times_s"]) / min(dropped["step_times_s"])
    flops_ratio = full["train_flops_per_sample"] / dropped["train_flops_per_sample"]
    print(f"samples/s with / without patch dropout: {ratio:.2f}x (medians), {best_ratio:.2f}x (best steps); "
          f"analytic FLOPs ratio {flops_ratio:.2f}x")

    result = {"benchmark": "patch_dropout", "model": args.model, "global_batch": args.batch,
              "precision": args.precision,
              "devices": jax.device_count(), "device_kind": device.device_kind, "jax": jax.__version__,
              "python": platform.python_version(), "with": dropped, "without": full, "ratio": ratio,
              "best_step_ratio": best_ratio, "flops_ratio": flops_ratio,
              "load_average_1min": {"start": load_at_start, "end": os.getloadavg()[0]}}
    name = f"patch_dropout-{args.model}-{args.precision}-b{args.batch}-p{args.patch_dropout:g}.json"
    out = pathlib.Path(args.out) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
