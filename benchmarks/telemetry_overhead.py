"""Spike telemetry's cost: train-step time with the telemetry at its default frequency against without it, measured
in one run.

    python benchmarks/telemetry_overhead.py [--model configs/models/demo-tiny.json] [--batch 64] [--every 100]
                                            [--steps 30] [--precision fp32|bf16|pure_bf16] [--out DIR]

Three builds of the same step (AdamW, no remat, every local device) on the same random batch take turns step by
step, so that other load on the machine hits them alike:

    off      no telemetry (spike_telemetry=False)
    idle     telemetry every 10^9 steps: what every step between two logging steps pays (the `lax.cond` not taken)
    due      telemetry on every step: what a logging step pays (the reductions themselves)

At the default frequency (`--every`, the trainer's log_every_n_steps, 100) a run pays `idle` on every step and the
extra of `due` once per `every` steps: overhead = (idle - off + (due - off) / every) / off, printed from the
medians of the per-round ratios (idle / off, due / off of the same round), of the step times, and of the best
steps, and written to OUT/telemetry_overhead-MODEL-PRECISION-bBATCH.json (OUT: benchmarks/out).
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
from clip_jax.runtime.mesh import create_mesh, make_global_batch
from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step

NEVER = 10**9


def compiled_step(config, telemetry_every: int, batch, mesh, precision: str):
    spec = StepSpec(config, precision, "none", "xla", telemetry_every=telemetry_every,
                    optimizer=OptimizerSpec(lr=1e-4, warmup=10, total_steps=10_000))
    step = build_step(spec, mesh)
    run_step, _, compile_s = compiled_runner(step, step.init(0), make_global_batch(batch, mesh))
    return run_step, compile_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(pathlib.Path(__file__).parent.parent / "configs" / "models"
                                               / "demo-tiny.json"))
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--every", type=int, default=100, help="telemetry frequency (log_every_n_steps)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each after compilation")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "pure_bf16"])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "out"))
    args = parser.parse_args()
    keep_freed_memory_mapped()

    load_at_start = os.getloadavg()[0]
    config = get_model_config(args.model)
    mesh = create_mesh(jax.local_devices())
    batch = random_batch(config, args.batch)
    variants = {"off": 0, "idle": NEVER, "due": 1}
    built = {name: compiled_step(config, every, batch, mesh, args.precision) for name, every in variants.items()}
    times = dict(zip(variants, time_steps([run for run, _ in built.values()], args.steps, args.warmup),
                     strict=True))
    median = {name: statistics.median(seconds) for name, seconds in times.items()}
    best = {name: min(seconds) for name, seconds in times.items()}
    # each round runs the three back to back: the median of the per-round ratios cancels slow drifts in the load
    paired = {name: statistics.median(t / off for t, off in zip(times[name], times["off"], strict=True))
              for name in variants}

    def overhead(t):
        return (t["idle"] - t["off"] + (t["due"] - t["off"]) / args.every) / t["off"]

    device = jax.local_devices()[0]
    print(f"train step, {config.name} b={args.batch} {args.precision}, {jax.device_count()} x {device.device_kind}, "
          f"load average {load_at_start:.1f} at start")
    print(f"{'telemetry':<10}{'compile s':>11}{'median s':>10}{'best s':>9}{'vs off':>9}")
    for name in variants:
        print(f"{name:<10}{built[name][1]:>11.1f}{median[name]:>10.4f}{best[name]:>9.4f}"
              f"{median[name] / median['off']:>9.3f}")
    print(f"{'':<10}{'':>11}{'':>10}{'':>9}  per-round ratios (median): idle {paired['idle']:.3f}, "
          f"due {paired['due']:.3f}")
    print(f"overhead at one telemetry step in {args.every}: {100 * overhead(paired):+.2f}% (per-round ratios), "
          f"{100 * overhead(median):+.2f}% (medians), {100 * overhead(best):+.2f}% (best steps)")

    result = {"benchmark": "telemetry_overhead", "model": config.name, "global_batch": args.batch,
              "precision": args.precision, "every": args.every, "devices": jax.device_count(),
              "device_kind": device.device_kind, "jax": jax.__version__, "python": platform.python_version(),
              "step_times_s": times, "median_s": median, "best_s": best,
              "compile_s": {name: b[1] for name, b in built.items()},
              "paired_ratio": paired, "overhead_paired": overhead(paired), "overhead_median": overhead(median),
              "overhead_best": overhead(best),
              "load_average_1min": {"start": load_at_start, "end": os.getloadavg()[0]}}
    out = pathlib.Path(args.out) / f"telemetry_overhead-{config.name}-{args.precision}-b{args.batch}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
