"""Precision policies against each other over whole runs, several seeds each: the demo and the instability lab.

    python benchmarks/precision_runs.py [--precisions bf16,fp8] [--seeds 0,1,2] [--parts demo,lab]
                                        [--lab-samples 5120] [--out DIR]

demo: `python -m clip_jax.train --config configs/demo.py --config.precision=P --config.seed=S` in a fresh log
      directory; from its metrics.jsonl, the last logged training loss, the final zero-shot top-1 and top-5 on
      the 10,000 Fashion-MNIST test images, the median logged training speed (samples/s, this machine's), and under
      a loss-scaled policy (fp16) the steps skipped for an overflow and the final loss scale.
lab:  `benchmarks/instability_lab.py --treatments baseline --set precision=P --set seed=S` (configs/demo_unstable.py
      at precision P instead of its pure_bf16): final loss (mean of the last 5 steps), lowest loss, spikes, the
      largest jump and zero-shot top-1 on the first 1,000 test images.

The seed sets the initial weights and the data order. Every run is a process of its own, one at a time (run the
script under `nice`), and writes OUT/parts/PART-PRECISION-sSEED.json; a run whose file exists is read back, not
run again, so an interrupted measurement continues where it stopped. Prints per part a table (each seed, the mean,
the min-max spread) and, for every precision other than the first, whether its mean lies within the first's seed
spread; writes OUT/precision_runs.json.
"""

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "configs" / "demo.py"
LAB = REPO / "benchmarks" / "instability_lab.py"
METRICS = {"demo": ("final_loss", "zeroshot_top1", "zeroshot_top5", "samples_per_s"),
           "lab": ("final_loss", "min_loss", "spikes", "largest_jump", "zeroshot_top1")}


def read_demo_metrics(path: pathlib.Path) -> dict:
    """The last logged training loss, its step, the last zero-shot top-1/top-5, the median logged samples/s, and
    the last logged loss scale and count of steps skipped for an overflow (absent without a loss scale) of a run's
    metrics.jsonl."""
    row, speeds = {}, []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if "loss" in record and "event" not in record:
                row["final_loss"], row["final_loss_step"] = record["loss"], record["step"]
                if "samples_per_sec" in record:
                    speeds.append(record["samples_per_sec"])
            for key, name in (("zeroshot_top1",) * 2, ("zeroshot_top5",) * 2, ("loss_scale", "final_loss_scale"),
                              ("overflow", "skipped_steps")):
                if key in record:
                    row[name] = record[key]
    row["samples_per_s"] = statistics.median(speeds) if speeds else float("nan")
    return row


def run_demo(precision: str, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as logs:
        command = [sys.executable, "-m", "clip_jax.train", f"--config={DEMO_CONFIG}",
                   f"--config.precision={precision}", f"--config.seed={seed}", f"--config.logs={logs}",
                   "--config.name=run", "--config.resume="]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"demo {precision} seed {seed} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return read_demo_metrics(pathlib.Path(logs) / "run" / "metrics.jsonl")


def run_lab(precision: str, seed: int, samples: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, str(LAB), "--treatments=baseline", f"--samples={samples}", "--no-plot",
                   f"--set=precision={precision}", f"--set=seed={seed}", f"--out={out}"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"lab {precision} seed {seed} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        (row,) = json.loads((pathlib.Path(out) / "instability_lab.json").read_text())["rows"]
    if not row.get("outcome", "").startswith("completed"):
        raise SystemExit(f"lab {precision} seed {seed}: {row.get('outcome')}")
    return {k: row[k] for k in (*METRICS["lab"], "non_finite_steps", "steps", "losses")}


def measured(part: str, precision: str, seed: int, args, parts: pathlib.Path) -> dict:
    path = parts / f"{part}-{precision}-s{seed}.json"
    if path.exists():
        return json.loads(path.read_text())
    print(f"== {part} {precision} seed {seed}", flush=True)
    start = time.perf_counter()
    row = run_demo(precision, seed) if part == "demo" else run_lab(precision, seed, args.lab_samples)
    row = {"part": part, "precision": precision, "seed": seed, **row, "wall_s": time.perf_counter() - start}
    path.write_text(json.dumps(row, indent=1))
    scaled = [f"{k} {row[k]:g}" for k in ("skipped_steps", "final_loss_scale") if k in row]
    said = [f"{k} {row[k]:.4g}" for k in METRICS[part]] + scaled
    print(f"   {time.perf_counter() - start:.0f} s: " + ", ".join(said), flush=True)
    return row


def summary(rows: list[dict], metric: str) -> dict:
    values = [r[metric] for r in rows if r.get(metric) is not None and math.isfinite(r[metric])]
    if not values:
        return {"mean": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "n": len(values)}


def print_part(part: str, rows: list[dict], precisions: list[str], seeds: list[int]) -> dict:
    """The part's table and, per metric, the summaries and whether each later precision's mean lies within the
    first precision's min-max over its seeds."""
    metrics = METRICS[part]
    print(f"\n{part}: " + ", ".join(metrics))
    print(f"{'precision':<10} {'seed':>8} " + " ".join(f"{m:>15}" for m in metrics))
    summaries = {}
    for precision in precisions:
        mine = [r for r in rows if r["precision"] == precision]
        for seed in seeds:
            r = next(r for r in mine if r["seed"] == seed)
            print(f"{precision:<10} {seed:>8} " + " ".join(f"{r.get(m, math.nan):>15.4f}" for m in metrics))
        summaries[precision] = {m: summary(mine, m) for m in metrics}
        s = summaries[precision]
        print(f"{precision:<10} {'mean':>8} " + " ".join(f"{s[m]['mean']:>15.4f}" for m in metrics))
        print(f"{precision:<10} {'min-max':>8} " +
              " ".join(f"{s[m]['min']:>7.4f}-{s[m]['max']:<7.4f}" for m in metrics))
    reference = precisions[0]
    verdicts = {}
    for precision in precisions[1:]:
        verdicts[precision] = {}
        for m in metrics:
            if m == "samples_per_s":  # a speed, this machine's: compared as a ratio, not a spread
                ratio = summaries[precision][m]["mean"] / summaries[reference][m]["mean"]
                print(f"{precision} mean samples/s {ratio:.3f}x {reference}'s, on this machine in this run")
                continue
            ref, mean = summaries[reference][m], summaries[precision][m]["mean"]
            inside = ref["min"] - 1e-9 <= mean <= ref["max"] + 1e-9  # a mean of equal values may round below them
            verdicts[precision][m] = inside
            print(f"{precision} mean {m} {mean:.4f} {'within' if inside else 'OUTSIDE'} {reference}'s seed spread "
                  f"{ref['min']:.4f}-{ref['max']:.4f}")
    return {"summaries": summaries, f"within_{reference}_spread": verdicts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precisions", default="bf16,fp8",
                        help="comma-separated; the first is the reference whose seed spread the others are held to")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--parts", default="demo,lab", help="demo, lab or both (in this order)")
    parser.add_argument("--lab-samples", type=int, default=5120, help="the lab's training samples (80 steps of 64)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "precision_runs"))
    args = parser.parse_args()
    precisions, seeds = args.precisions.split(","), [int(s) for s in args.seeds.split(",")]
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in METRICS]
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose from demo, lab")
    out = pathlib.Path(args.out)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    result = {"precisions": precisions, "seeds": seeds, "lab_samples": args.lab_samples, "parts": {}}
    for part in parts:
        rows = [measured(part, p, s, args, out / "parts") for p in precisions for s in seeds]
        result["parts"][part] = {"rows": [{k: v for k, v in r.items() if k not in ("steps", "losses")} for r in rows],
                                 **print_part(part, rows, precisions, seeds)}
    (out / "precision_runs.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'precision_runs.json'}")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
