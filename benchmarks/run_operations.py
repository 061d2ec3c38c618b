"""Telemetry and validation overhead: the trainer with both off and with both on, at the default frequencies, in one
run.

    PYTHONPATH=. python benchmarks/run_operations.py [--steps-per-epoch 200] [--epochs 3] [--val-images 128]
                                                     [--repeats 2] [--out DIR]

Trains a small CLIP (2+2 layers, width 32, 28 px) on Fashion-MNIST shards on every local device, once with
`device_telemetry=False` and no `val_data` ("off") and once with `device_telemetry=True` and `val_data` of
`--val-images` held-out Fashion-MNIST test images validated every epoch (`val_frequency=1`, "on"), both logging
every 100 steps (the default `log_every_n_steps`). The two take turns `--repeats` times, so that other load on the
machine hits both alike. The throughput is samples over the summed wall time of the log windows (after the first
step's compilation): it includes the in-loop validations (those that run between log lines) and each log line's
telemetry. The validation towers are compiled once before the first timed run (a long run compiles them once). Also
prints the measured cost of one telemetry reading and one validation. Writes OUT/run_operations-DEVICE.json (OUT:
benchmarks/out).
"""

import argparse
import contextlib
import io
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import jax

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from clip_jax.data import make_shards  # noqa: E402
from clip_jax.training import trainer as train_lib  # noqa: E402
from clip_jax.training.config_checks import default_config  # noqa: E402

MODEL = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 28, "patch_size": 7, "width": 32, "layers": 2, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


def config_for(root: pathlib.Path, name: str, args, *, on: bool):
    c = default_config()
    c.model = str(root / "model.json")
    c.train_data = str(root / "train" / "{00000..00003}.tar")
    c.dataset_resampled = True
    c.workers = 0
    c.batch_size = args.batch
    c.train_num_samples = args.steps_per_epoch * args.batch * jax.device_count()
    c.epochs = args.epochs
    c.warmup = 10
    c.precision = "fp32"
    c.grad_checkpointing = False
    c.logs, c.name = str(root / "logs"), name
    c.report_to = "none"
    c.zeroshot_frequency = 0
    c.device_telemetry = on
    c.val_data = str(root / "val" / "00000.tar") if on else ""
    return c


def window_throughput(run_dir: pathlib.Path, global_batch: int) -> float:
    """Samples / s over all log windows: each window's samples_per_sec weighs by its duration."""
    samples = seconds = 0.0
    previous = None
    with open(run_dir / "metrics.jsonl") as f:
        for line in f:
            record = json.loads(line)
            if "samples_per_sec" not in record:
                continue
            steps = record["step"] - (previous if previous is not None else 1)  # the first window starts after step 1
            samples += steps * global_batch
            seconds += steps * global_batch / record["samples_per_sec"]
            previous = record["step"]
    return samples / seconds


def timed_run(root, name, args, *, on: bool) -> dict:
    config = config_for(root, name, args, on=on)
    telemetry_s, validate_s = [], []
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = train_lib.Trainer(config)
        with trainer:
            if trainer.device_telemetry is not None:
                sample = trainer.device_telemetry.sample

                def timed_sample():
                    start = time.perf_counter()
                    out = sample()
                    telemetry_s.append(time.perf_counter() - start)
                    return out

                trainer.device_telemetry.sample = timed_sample
            validate = trainer.validate

            def timed_validate():
                start = time.perf_counter()
                out = validate()
                validate_s.append(time.perf_counter() - start)
                return out

            trainer.validate = timed_validate
            start = time.perf_counter()
            trainer.train()
            wall = time.perf_counter() - start
    global_batch = config.batch_size * jax.device_count()
    throughput = window_throughput(root / "logs" / name, global_batch)
    loop_s = (args.steps_per_epoch * args.epochs - 1) * global_batch / throughput  # the log windows' wall time
    in_loop = sum(telemetry_s) + sum(validate_s[:-1])  # the last validation runs after the loop
    return {"on": on, "wall_s": wall, "samples_per_sec": throughput, "telemetry_s": telemetry_s,
            "validate_s": validate_s, "loop_s": loop_s, "in_run_overhead": in_loop / max(loop_s - in_loop, 1e-9)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps-per-epoch", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="per device")
    parser.add_argument("--val-images", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        (root / "model.json").write_text(json.dumps(MODEL))
        make_shards.write_shards(make_shards.fashion_mnist_samples("train", limit=2048), str(root / "train"), 512)
        make_shards.write_shards(make_shards.fashion_mnist_samples("test", limit=args.val_images), str(root / "val"),
                                 args.val_images)
        with contextlib.redirect_stdout(io.StringIO()):  # compiles the validation towers once, untimed
            with train_lib.Trainer(config_for(root, "warmup", args, on=True)) as trainer:
                trainer.validate()
        runs = []
        for repeat in range(args.repeats):
            for on in (False, True):
                runs.append(timed_run(root, f"{'on' if on else 'off'}{repeat}", args, on=on))
                print(f"repeat {repeat} {'on ' if on else 'off'}: {runs[-1]['samples_per_sec']:,.0f} samples/s, "
                      f"wall {runs[-1]['wall_s']:.1f} s", flush=True)

    best = {on: max(r["samples_per_sec"] for r in runs if r["on"] == on) for on in (False, True)}
    overhead = 1 - best[True] / best[False]
    telemetry = [t for r in runs for t in r["telemetry_s"]]
    in_loop_validations = [v for r in runs if r["on"] for v in r["validate_s"][:-1]]  # the last runs after the loop
    step_s = args.batch * jax.device_count() / best[False]
    epoch_s = args.steps_per_epoch * step_s
    record = {
        "device": jax.devices()[0].device_kind, "num_devices": jax.device_count(), "host": platform.node(),
        "load_avg": os.getloadavg()[0], "args": vars(args), "runs": runs,
        "samples_per_sec_off": best[False], "samples_per_sec_on": best[True], "overhead": overhead,
        "telemetry_sample_ms_median": 1e3 * statistics.median(telemetry),
        "validation_s_median": statistics.median(in_loop_validations),
        "telemetry_fraction": statistics.median(telemetry) / (100 * step_s),
        "validation_fraction": statistics.median(in_loop_validations) / epoch_s,
        "in_run_overhead_median": statistics.median(r["in_run_overhead"] for r in runs if r["on"]),
    }
    print()
    print("| setting | samples/s (best of {}) | ratio |".format(args.repeats))
    print("| --- | ---: | ---: |")
    print(f"| telemetry and validation off | {best[False]:,.0f} | 1.000 |")
    print(f"| telemetry on, validation every epoch | {best[True]:,.0f} | {best[True] / best[False]:.3f} |")
    print()
    print(f"overhead {100 * overhead:.2f}% (on/off throughput), {100 * record['in_run_overhead_median']:.2f}% "
          "within the on runs (time in telemetry and in-loop validation / the rest of the loop's time)")
    print(f"one telemetry reading {record['telemetry_sample_ms_median']:.2f} ms = "
          f"{100 * record['telemetry_fraction']:.4f}% of 100 steps; one validation of {args.val_images} images "
          f"{record['validation_s_median']:.2f} s = {100 * record['validation_fraction']:.2f}% of an epoch "
          f"({args.steps_per_epoch} steps of {step_s * 1e3:.1f} ms)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"run_operations-{jax.devices()[0].platform}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
