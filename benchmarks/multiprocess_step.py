"""The demo's step time as 1 process x 4 CPU devices and as 2 processes x 2 (joined with gloo), the same global
batch: what a multi-process run costs beyond the step's own work.

    PYTHONPATH=. python benchmarks/multiprocess_step.py [--steps 16] [--log-every 5] [--batch 256]
                                                         [--layouts 1x4,2x2] [--data DIR] [--label NAME] [--out DIR]

Each layout trains `configs/demo.py` for `--steps` steps through `launch/local.py` (no zero-shot, no checkpoint
before the end), logging every `--log-every` steps. The steady-state seconds per step are the log windows' wall
time over their steps, read from the run's metrics.jsonl (`samples_per_sec`), leaving out the first window (it
starts right after the first step's compilation). The goal: 2 x 2 within 2x of 1 x 4. A smaller `--batch` (per
device; the demo's 256 by default) makes the cost of everything besides the step's compute stand out. The demo's
Fashion-MNIST shards are written once under `--data` and reused. Prints a table and writes
OUT/cpu-DATE-multiprocess-step[-LABEL].json (OUT: benchmarks/results).
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
DEVICES = 4  # in every layout: the same global batch


def run_layout(processes: int, args, logs: pathlib.Path) -> dict:
    """Trains the demo as `processes` x (DEVICES / processes) devices; its windows and wall time."""
    name = f"{processes}x{DEVICES // processes}"
    command = [
        sys.executable, str(REPO / "launch" / "local.py"), str(processes),
        "--devices-per-process", str(DEVICES // processes), "--log-dir", str(logs / f"{name}-ranks"),
        *(["--loopback-mtu", str(args.loopback_mtu)] if args.loopback_mtu is not None else []), "--",
        sys.executable, "-m", "clip_jax.train", f"--config={REPO}/configs/demo.py", f"--config.name={name}",
        f"--config.logs={logs}", f"--config.train_data={args.data}/train/{{00000..00011}}.tar",
        f"--config.batch_size={args.batch}", f"--config.train_num_samples={args.steps * args.batch * DEVICES}",
        f"--config.log_every_n_steps={args.log_every}", "--config.warmup=2", "--config.save_every_steps=0",
        "--config.zeroshot_data=", "--config.report_to=none"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{name} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    windows = log_windows(logs / name / "metrics.jsonl", args.batch * DEVICES)
    steady = windows[1:]
    return {"layout": name, "processes": processes, "wall_s": wall, "windows": windows,
            "step_s": sum(w["seconds"] for w in steady) / sum(w["steps"] for w in steady)}


def log_windows(metrics_jsonl: pathlib.Path, global_batch: int) -> list[dict]:
    """Each log line's window: its steps and seconds (the first window starts after step 1)."""
    windows, previous = [], 1
    for line in metrics_jsonl.read_text().splitlines():
        record = json.loads(line)
        if "samples_per_sec" in record:
            steps = record["step"] - previous
            windows.append({"step": record["step"], "steps": steps,
                            "seconds": steps * global_batch / record["samples_per_sec"]})
            previous = record["step"]
    return windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--batch", type=int, default=256, help="per device (configs/demo.py: 256)")
    parser.add_argument("--layouts", default="1x4,2x2", help="processes x devices, each with 4 devices in all")
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "clip_jax-demo-data", "fashion-mnist"),
                        help="the demo's shards, in DATA/train: written by the first run, then reused (the demo "
                        "writes only a folder named fashion-mnist/train)")
    parser.add_argument("--label", default="", help="appended to the result file's name (e.g. before)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--loopback-mtu", type=int, default=None,
                        help="launch/local.py --loopback-mtu (default: the launcher's, a private 16 KB loopback where "
                        "one can be made; 0: this machine's loopback, as before section 17's fix)")
    args = parser.parse_args()
    if args.steps < 2 * args.log_every + 1:
        parser.error("--steps must leave at least one log window after the first")
    layouts = [int(layout.split("x")[0]) for layout in args.layouts.split(",")]

    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for processes in layouts:
            runs.append(run_layout(processes, args, pathlib.Path(tmp)))
            print(f"{runs[-1]['layout']}: {runs[-1]['step_s']:.3f} s/step, wall {runs[-1]['wall_s']:.0f} s",
                  flush=True)
    base = runs[0]["step_s"]
    print()
    print(f"demo, global batch {args.batch * DEVICES}, {args.steps} steps, {os.cpu_count()} cores, "
          f"load average {load_at_start:.1f} at start")
    print("| processes x devices | s/step (steady) | vs " + runs[0]["layout"] + " | run wall s |")
    print("| --- | ---: | ---: | ---: |")
    for run in runs:
        print(f"| {run['layout']} | {run['step_s']:.3f} | {run['step_s'] / base:.2f} | {run['wall_s']:.0f} |")
    record = {"host": platform.node(), "cpus": os.cpu_count(), "load_avg": load_at_start, "args": vars(args),
              "runs": runs, "ratio": {run["layout"]: run["step_s"] / base for run in runs}}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"cpu-{datetime.date.today()}-multiprocess-step"
                        + (f"-{args.label}" if args.label else "") + ".json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
