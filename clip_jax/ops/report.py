"""Plots of a run: `python -m clip_jax.report RUN_DIR [--output PNG]`.

Reads the run's `metrics.jsonl` and writes one PNG (default `RUN_DIR/report.png`) with a panel per quantity over
steps: loss (train and validation), learning rate, logit scale, zero-shot accuracy, validation recall, throughput
and MFU. A panel whose quantity the run never logged is left out. The learning rate is the run's schedule at every
step (its warm-up, then the cosine), from its `config.json` and the steps of an epoch its records show; a logged
value is the mean over a log window, which would put the peak a window after the warm-up ends. Prints a summary table: for each quantity its
first, last, minimum and maximum value and the step of the last one. RUN_DIR may be a bucket URL (`s3://...`,
`gs://...`); the default PNG then goes there too. Needs matplotlib (`pip install 'clipjax-train[report]'`).
"""

import argparse
import fnmatch
import json
import math
import os
import sys
from collections.abc import Sequence

from clip_jax.errors import InvalidInput, MissingInput, require_extra
from clip_jax.runtime import entry, ownership, run_layout, storage

# (title, metric names): one panel each; a name ending in "*" stands for every metric with that prefix.
PANELS = (
    ("loss", ("loss", "val_loss")),
    ("learning rate", ("learning_rate", "lr")),  # "lr": what fine-tuning runs wrote before they wrote the other
    ("logit scale", ("logit_scale",)),
    ("zero-shot accuracy", ("zeroshot_*",)),
    ("validation recall", ("val_*recall*",)),
    ("samples / s", ("samples_per_sec",)),
    ("MFU", ("mfu",)),
)


def read_metrics(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every numeric metric of `RUN_DIR/metrics.jsonl` as (step, value) pairs in file order; a step logged again
    after a resume replaces the earlier value."""
    path = storage.join(run_dir, run_layout.METRICS)
    if not storage.isfile(path):
        raise MissingInput(f"{path} does not exist: give a run directory the trainer wrote (LOGS/NAME)")
    series: dict[str, dict[int, float]] = {}
    with storage.open_file(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidInput(f"{path} line {number} is not JSON ({e})") from e
            step = record.get("step")
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    series.setdefault(key, {})[int(step)] = float(value)
    if not series:
        raise InvalidInput(f"{path} holds no metrics yet")
    return {key: sorted(points.items()) for key, points in series.items()}


def schedule_per_step(run_dir: str, series: dict) -> list[tuple[int, float]] | None:
    """(step, learning rate of that step's update) for steps 1 .. the last logged: the warm-up and cosine of
    `clip_jax.optim.adamw.warmup_cosine_schedule` over the run's `lr`, `warmup` and `epochs` (config.json) and its
    steps per epoch (a record's step / epoch). None where the run directory lacks either."""
    path = storage.join(run_dir, run_layout.CONFIG)
    logged = [(step, epoch) for step, epoch in series.get("epoch", ()) if epoch > 0]
    if not logged or not storage.isfile(path):
        return None
    try:
        config = json.loads(storage.read_text(path))
        lr, warmup, epochs = float(config["lr"]), int(config["warmup"]), int(config["epochs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    step, epoch = logged[-1]
    total_steps = round(step / epoch) * epochs
    if not 0 <= warmup < total_steps:
        return None
    import numpy as np

    from clip_jax.optim.adamw import warmup_cosine_schedule

    last = max(s for points in series.values() for s, _ in points)
    updates = np.arange(last)  # step s is the update from state step s - 1
    rates = np.asarray(warmup_cosine_schedule(lr, warmup, total_steps)(updates), np.float64)
    return [(int(s) + 1, float(rate)) for s, rate in zip(updates, rates)]


def panel_series(series: dict, patterns: Sequence[str]) -> list[str]:
    """The metrics of `series` one panel draws: those its names or shell patterns match, in that order."""
    names = [name for pattern in patterns for name in sorted(series) if fnmatch.fnmatchcase(name, pattern)]
    return list(dict.fromkeys(names))


def summary_rows(series: dict, names: Sequence[str]) -> list[tuple[str, int, float, float, float, float]]:
    """(name, last step, first, last, min, max) of each named metric that has a finite value."""
    rows = []
    for name in names:
        values = [(s, v) for s, v in series.get(name, ()) if math.isfinite(v)]
        if values:
            only = [v for _, v in values]
            rows.append((name, values[-1][0], only[0], only[-1], min(only), max(only)))
    return rows


def format_summary(rows) -> str:
    width = max([6] + [len(r[0]) for r in rows])
    lines = [f"{'metric':<{width}} {'step':>8} {'first':>12} {'last':>12} {'min':>12} {'max':>12}"]
    lines += [f"{name:<{width}} {step:>8} {first:>12.6g} {last:>12.6g} {low:>12.6g} {high:>12.6g}"
              for name, step, first, last, low, high in rows]
    return "\n".join(lines)


def panel_lines(series: dict, schedule: list[tuple[int, float]] | None = None) -> list[tuple[str, list[tuple]]]:
    """(title, [(metric name, label, steps, values)]) of each panel that has data; the learning rate's is
    `schedule` (every step) where given, instead of the logged window means."""
    panels = []
    for title, patterns in PANELS:
        lines = [(name, name, *zip(*series[name])) for name in panel_series(series, patterns)]
        if title == "learning rate" and lines and schedule:
            lines = [(lines[0][0], f"{lines[0][0]} (schedule, per step)", *zip(*schedule))]
        if lines:
            panels.append((title, lines))
    return panels


def write_png(series: dict, output: str, title: str, schedule: list[tuple[int, float]] | None = None) -> list[str]:
    """Draws the panels that have data into `output` (`schedule`: see `panel_lines`); returns the metric names
    drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    panels = panel_lines(series, schedule)
    if not panels:
        raise InvalidInput(f"nothing to plot yet: {title} has no logged metrics (only events or skipped steps)")
    columns = 2
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.2 * rows), squeeze=False)
    drawn = []
    for ax, (panel_title, lines) in zip(axes.flat, panels):
        for name, label, steps, values in lines:
            ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3, label=label)
            drawn.append(name)
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if panel_title == "learning rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        if len(lines) > 1 or lines[0][1] != lines[0][0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    ownership.claim_file(output, writing="the report", change="give another --output")
    if not storage.is_remote(output):
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with storage.open_file(output, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return drawn


def report(run_dir: str, output: str | None = None) -> tuple[str, str]:
    """Writes the PNG; returns (its path, the summary table)."""
    require_extra("matplotlib", "report", "the run report (its PNG)")
    if storage.is_remote(run_dir):
        storage.check_location(run_dir, write=False)
    series = read_metrics(run_dir)
    output = output or storage.join(run_dir, run_layout.REPORT)
    storage.check_output_file(output, what="the report", change="give --output a path you can write to")
    drawn = write_png(series, output, storage.basename(run_dir), schedule_per_step(run_dir, series))
    return output, format_summary(summary_rows(series, drawn))


@entry.command(stopped="before the report was written")
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clip_jax.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run directory (LOGS/NAME) holding metrics.jsonl")
    parser.add_argument("--output", help="the PNG to write (default RUN_DIR/report.png)")
    args = parser.parse_args(argv)
    output, table = report(args.run_dir, args.output)
    print(table)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
