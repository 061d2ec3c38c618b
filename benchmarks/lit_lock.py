"""LiT locking: train-state size, step FLOPs and step time with a locked image tower, against the same step unlocked.

    python benchmarks/lit_lock.py [--model ViT-B-32] [--batch 4] [--steps 4] [--state-models ViT-B-32,ViT-L-14]
                                  [--out DIR]

Train-state bytes come from the abstract state (nothing allocated) for each of `--state-models` under no lock,
`lock_image`, `lock_image` with 2 unlocked groups and `lock_text`. For `--model` the step is built unlocked and with
the image tower locked, on the same random batch (fp32, AdamW, no remat, every local device); XLA's FLOPs of each
compiled step, then the two take turns step by step. Prints a table and writes OUT/lit_lock-MODEL-bBATCH.json (OUT:
benchmarks/out).
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
from clip_jax.optim.lock import LockSpec
from clip_jax.runtime.mesh import create_mesh, make_global_batch
from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step

LOCKS = {"none": LockSpec(), "lock_image": LockSpec(image=True),
         "lock_image, 2 groups unlocked": LockSpec(image=True, image_unlocked_groups=2),
         "lock_text": LockSpec(text=True)}
ADAMW = OptimizerSpec(lr=1e-3, warmup=10, total_steps=10_000)


def state_bytes(model: str, lock: LockSpec) -> dict:
    step = build_step(StepSpec.for_model(model, optimizer=ADAMW, lock=lock), create_mesh(jax.local_devices()[:1]))
    size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    return {"params": size(step.abstract_state.params), "opt_state": size(step.abstract_state.opt_state)}


def compiled_step(model: str, lock: LockSpec, batch, mesh) -> tuple:
    step = build_step(StepSpec.for_model(model, optimizer=ADAMW, lock=lock), mesh)
    run_step, compiled, compile_s = compiled_runner(step, step.init(0), make_global_batch(batch, mesh))
    return run_step, {"compile_s": compile_s, "flops": compiled.cost_analysis()["flops"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--batch", type=int, default=4, help="global batch size")
    parser.add_argument("--steps", type=int, default=4, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each after compilation")
    parser.add_argument("--state-models", default="ViT-B-32,ViT-L-14")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "out"))
    args = parser.parse_args()
    keep_freed_memory_mapped()
    load_at_start = os.getloadavg()[0]

    print(f"{'model':<10}{'lock':<32}{'params MiB':>12}{'opt state MiB':>15}{'vs none':>9}")
    states = {}
    for model in args.state_models.split(","):
        states[model] = {name: state_bytes(model, lock) for name, lock in LOCKS.items()}
        for name, record in states[model].items():
            ratio = record["opt_state"] / states[model]["none"]["opt_state"]
            print(f"{model:<10}{name:<32}{record['params'] / 2**20:>12.1f}{record['opt_state'] / 2**20:>15.1f}"
                  f"{ratio:>8.2f}x")

    mesh = create_mesh(jax.local_devices())
    batch = random_batch(get_model_config(args.model), args.batch)
    steps = [compiled_step(args.model, LOCKS[name], batch, mesh) for name in ("lock_image", "none")]
    times = time_steps([run for run, _ in steps], args.steps, args.warmup)
    device = jax.local_devices()[0]
    print(f"\ntrain step, {args.model} b={args.batch} fp32, {jax.device_count()} x {device.device_kind}, load "
          f"average {load_at_start:.1f} at start")
    print(f"{'lock':<14}{'GFLOP':>10}{'compile s':>11}{'median s':>10}{'best s':>9}{'samples/s':>11}")
    records = {}
    for name, (_, record), seconds in zip(("lock_image", "none"), steps, times, strict=True):
        step_s = statistics.median(seconds)
        record.update(step_times_s=seconds, step_s=step_s, samples_per_s=args.batch / step_s)
        records[name] = record
        print(f"{name:<14}{record['flops'] / 1e9:>10.1f}{record['compile_s']:>11.1f}{step_s:>10.3f}"
              f"{min(seconds):>9.3f}{record['samples_per_s']:>11.3f}")
    locked, full = records["lock_image"], records["none"]
    ratio = locked["samples_per_s"] / full["samples_per_s"]
    flops_ratio = full["flops"] / locked["flops"]
    print(f"samples/s locked / unlocked: {ratio:.2f}x (medians); FLOPs unlocked / locked {flops_ratio:.2f}x")

    result = {"benchmark": "lit_lock", "model": args.model, "global_batch": args.batch, "precision": "fp32",
              "devices": jax.device_count(), "device_kind": device.device_kind, "jax": jax.__version__,
              "python": platform.python_version(), "state_bytes": states, "steps": records, "ratio": ratio,
              "flops_ratio": flops_ratio, "load_average_1min": {"start": load_at_start, "end": os.getloadavg()[0]}}
    out = pathlib.Path(args.out) / f"lit_lock-{args.model}-b{args.batch}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
