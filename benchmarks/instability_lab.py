"""The instability lab: `configs/demo_unstable.py` trained once per treatment, side by side, on the bundled
Fashion-MNIST; what each treatment does to the loss, measured.

    python benchmarks/instability_lab.py [--treatments baseline,rollback,fp32,stable_adamw,grad_clip]
                                         [--samples 5120] [--batch 64] [--jobs N] [--out DIR] [--set FIELD=VALUE ...]

Treatments (each a change to the unstable config, everything else equal: data order, seed, steps):

    baseline            the config as it is: no rollback, non-finite steps skipped
    rollback            automatic rollback to the last checkpoint on 3 non-finite steps in a row or a loss spike
                        above 1.15 x the recent mean
    fp32                fp32 weights and compute instead of pure bf16 (the reference run's fix)
    stable_adamw        StableAdamW instead of AdamW (opt="stable_adamw")
    grad_clip           global-norm gradient clipping at 1.0
    warmup              60 warm-up steps instead of 30 (a control: the rate rises half as fast)
    qk_norm             LayerNorm on queries and keys (model option, OpenCLIP's vision_cfg/text_cfg "qk_norm")
    scaled_cosine_attn  cosine attention with a learned per-head logit scale (OpenCLIP's "scaled_cosine_attn")

Per treatment: final loss (mean of the last 5 logged steps; chance is ln(batch)), the lowest loss, non-finite
(skipped) steps, rollbacks, loss spikes (a finite step above SPIKE_FACTOR x the mean of the 10 finite steps before
it, counted from the log whether or not the run reacts to it; 1.15 sits above this batch's step-to-step noise), the
largest such ratio ("jump"), zero-shot top-1 on the first --zeroshot-samples test images, and wall time (with
--jobs N the treatments run N at a time in processes of their own, sharing the machine). Prints a table, writes
OUT/instability_lab.json and a loss-curve plot OUT/instability_lab.png (matplotlib: `pip install -e .[bench]`).
A model option the build does not support yet is reported as refused.
"""

import argparse
import contextlib
import io
import json
import math
import os
import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from clip_jax.errors import UserError  # noqa: E402
from clip_jax.training import trainer as train_lib  # noqa: E402

CONFIG = REPO / "configs" / "demo_unstable.py"
SPIKE_FACTOR, SPIKE_HISTORY = 1.15, 10
MODEL_OPTIONS = {"qk_norm": {"qk_norm": True}, "scaled_cosine_attn": {"scaled_cosine_attn": True}}
TREATMENTS = {
    "baseline": {},
    "rollback": {"nan_patience": 3, "loss_spike_factor": SPIKE_FACTOR, "on_instability": "rollback"},
    "fp32": {"precision": "fp32"},
    "stable_adamw": {"opt": "stable_adamw"},
    "grad_clip": {"grad_clip_norm": 1.0},
    "warmup": {"warmup": 60},
    **{name: {} for name in MODEL_OPTIONS},
}


def load_config():
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_unstable", CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def model_with_options(model_file: str, options: dict, out_dir: pathlib.Path) -> str:
    """The config's OpenCLIP model .json with `options` set in both towers (vision_cfg and text_cfg)."""
    with open(model_file) as f:
        model = json.load(f)
    for tower in ("vision_cfg", "text_cfg"):
        model[tower] = {**model[tower], **options}
    path = out_dir / f"model-{'-'.join(options)}.json"
    path.write_text(json.dumps(model, indent=2))
    return str(path)


def count_spikes(losses: list[float]) -> int:
    history, spikes = [], 0
    for loss in losses:
        if not math.isfinite(loss):
            continue
        if len(history) >= SPIKE_HISTORY and loss > SPIKE_FACTOR * sum(history[-SPIKE_HISTORY:]) / SPIKE_HISTORY:
            spikes += 1
        history.append(loss)
    return spikes


def largest_jump(losses: list[float]) -> float:
    """The largest ratio of a finite loss to the mean of the SPIKE_HISTORY finite losses before it: how far above the
    spike rule's threshold (or below it) the worst jump came."""
    history, largest = [], float("nan")
    for loss in losses:
        if not math.isfinite(loss):
            continue
        if len(history) >= SPIKE_HISTORY:
            ratio = loss / (sum(history[-SPIKE_HISTORY:]) / SPIKE_HISTORY)
            largest = ratio if not largest >= ratio else largest
        history.append(loss)
    return largest


def read_run(run_dir: pathlib.Path) -> tuple[dict[int, float], list[dict]]:
    """(loss per step, the last logged one kept after a rollback replays a step; the event records)."""
    losses, events = {}, []
    with open(run_dir / "metrics.jsonl") as f:
        for line in f:
            record = json.loads(line)
            if "event" in record:
                events.append(record)
            elif "loss" in record:
                losses[record["step"]] = record["loss"]
    return losses, events


def _parse_value(text: str, kind: type, field: str):
    """`--set FIELD=VALUE` as the field's type (bool("False") would be True)."""
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise SystemExit(f"--set {field}={text}: give true or false")
        return text.lower() in ("true", "1")
    return kind(text)


def run_treatment(name: str, args, work: pathlib.Path) -> dict:
    config = load_config()
    config.logs, config.name = str(work), name
    config.train_num_samples, config.batch_size = args.samples, args.batch
    config.zeroshot_samples = args.zeroshot_samples
    config.zeroshot_data = "demo" if args.zeroshot_samples else ""
    for assignment in args.set:
        field, value = assignment.split("=", 1)
        config[field] = _parse_value(value, type(config[field]), field)
    for field, value in TREATMENTS[name].items():
        config[field] = value
    if name in MODEL_OPTIONS:
        config.model = model_with_options(config.model, MODEL_OPTIONS[name], work)
    print(f"== {name}", flush=True)
    start = time.perf_counter()
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            result = train_lib.train(config)
        outcome = "completed"
    except train_lib.TrainingUnstable as e:
        result, outcome = {}, f"stopped: {e}"
    except UserError as e:
        return {"treatment": name, "outcome": f"refused: {e}".splitlines()[0], "changes": TREATMENTS[name]}
    wall = time.perf_counter() - start
    print("\n".join(stdout.getvalue().splitlines()[-3:]), flush=True)
    losses, events = read_run(work / name)
    steps = sorted(losses)
    curve = [losses[s] for s in steps]
    final = [x for x in curve[-5:] if math.isfinite(x)]
    return {
        "treatment": name, "outcome": outcome, "changes": TREATMENTS[name] or None,
        "final_loss": sum(final) / len(final) if final else float("nan"),
        "min_loss": min((x for x in curve if math.isfinite(x)), default=float("nan")),
        "non_finite_steps": sum(e["event"] == "non_finite_step" for e in events),
        "rollbacks": sum(e["event"] == "rollback" for e in events),
        "spikes": count_spikes(curve), "largest_jump": largest_jump(curve),
        "zeroshot_top1": result.get("zeroshot_top1"),
        "wall_s": wall, "steps": steps, "losses": curve,
        "chance_loss": math.log(config.batch_size),  # one device: the global batch
    }


def print_table(rows: list[dict]) -> None:
    print(f"\n{'treatment':<20} {'final loss':>10} {'min loss':>9} {'non-finite':>10} {'rollbacks':>9} "
          f"{'spikes':>6} {'jump':>5} {'zero-shot':>9} {'wall s':>7}  outcome")
    for r in rows:
        if "final_loss" not in r:
            print(f"{r['treatment']:<20} {'':>10} {'':>9} {'':>10} {'':>9} {'':>6} {'':>5} {'':>9} {'':>7}  "
                  f"{r['outcome']}")
            continue
        zeroshot = "" if r["zeroshot_top1"] is None else f"{100 * r['zeroshot_top1']:.1f}%"
        print(f"{r['treatment']:<20} {r['final_loss']:>10.3f} {r['min_loss']:>9.3f} {r['non_finite_steps']:>10d} "
              f"{r['rollbacks']:>9d} {r['spikes']:>6d} {r['largest_jump']:>5.2f} {zeroshot:>9} {r['wall_s']:>7.0f}  "
              f"{r['outcome'][:60]}")


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for r in rows:
        if r.get("steps"):
            ax.plot(r["steps"], r["losses"], label=r["treatment"], linewidth=1.2)
    chance = next((r["chance_loss"] for r in rows if "chance_loss" in r), None)
    if chance is not None:
        ax.axhline(chance, color="grey", linestyle=":", linewidth=1, label="chance (ln batch)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("configs/demo_unstable.py: tiny CLIP, Fashion-MNIST, pure bf16, AdamW b2 0.999, lr 5e-3")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_in_processes(names: list[str], args, out: pathlib.Path) -> list[dict]:
    """Each treatment in a process of its own (this script, one treatment, no plot), `args.jobs` at a time; their
    rows in the order asked. A process per run also keeps one run's JAX caches out of the next one's time."""
    import subprocess

    common = [f"--samples={args.samples}", f"--batch={args.batch}", f"--zeroshot-samples={args.zeroshot_samples}",
              "--no-plot", *(f"--set={a}" for a in args.set)]
    pending, running = list(names), {}
    while pending or running:
        while pending and len(running) < args.jobs:
            name = pending.pop(0)
            part = out / "parts" / name
            part.mkdir(parents=True, exist_ok=True)
            log = open(part / "log.txt", "w")
            running[name] = (subprocess.Popen([sys.executable, __file__, f"--treatments={name}", f"--out={part}",
                                               *common], stdout=log, stderr=subprocess.STDOUT), log)
        for name, (process, log) in list(running.items()):
            if process.poll() is not None:
                log.close()
                del running[name]
                print(f"== {name}: exit {process.returncode}", flush=True)
        time.sleep(1)
    rows = []
    for name in names:
        part = out / "parts" / name / "instability_lab.json"
        rows += json.loads(part.read_text())["rows"] if part.exists() else [
            {"treatment": name, "outcome": f"failed: see {part.parent / 'log.txt'}", "changes": TREATMENTS[name]}]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--treatments", default="baseline,rollback,fp32,stable_adamw,grad_clip,qk_norm,"
                        "scaled_cosine_attn", help="comma-separated, from: " + ", ".join(TREATMENTS))
    parser.add_argument("--samples", type=int, default=5120, help="training samples per run (steps x batch)")
    parser.add_argument("--jobs", type=int, default=1, help="treatments run at once, each in its own process")
    parser.add_argument("--no-plot", action="store_true", help="write the JSON only")
    parser.add_argument("--batch", type=int, default=64, help="per device (the lab runs on one CPU device)")
    parser.add_argument("--zeroshot-samples", type=int, default=1000, help="0: no zero-shot evaluation")
    parser.add_argument("--set", action="append", default=[], help="FIELD=VALUE for every treatment")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    args = parser.parse_args()
    names = args.treatments.split(",")
    unknown = [n for n in names if n not in TREATMENTS]
    if unknown:
        parser.error(f"unknown treatments {unknown}; choose from {list(TREATMENTS)}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.jobs > 1:
        rows = run_in_processes(names, args, out)
    else:
        with tempfile.TemporaryDirectory() as work:
            rows = [run_treatment(name, args, pathlib.Path(work)) for name in names]
    print_table(rows)
    (out / "instability_lab.json").write_text(json.dumps(
        {"config": str(CONFIG.relative_to(REPO)), "samples": args.samples, "batch": args.batch,
         "overrides": args.set, "spike_rule": f"> {SPIKE_FACTOR} x mean of the previous {SPIKE_HISTORY} finite",
         "rows": rows}, indent=1))
    if not args.no_plot:
        plot(rows, out / "instability_lab.png")
    print(f"wrote {out / 'instability_lab.json'}" + ("" if args.no_plot else f" and {out / 'instability_lab.png'}"))


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
