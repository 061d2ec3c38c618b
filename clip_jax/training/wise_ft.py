"""WiSE-FT: weight-space ensembles of a zero-shot and a fine-tuned model, `theta(alpha) = (1 - alpha) * zero_shot +
alpha * fine_tuned`, leaf by leaf (image tower and head alike), scored over a sweep of alphas.

The sweep's table, one row per alpha with each set's `acc1`, `acc5` and `mean_per_class_recall`, is written as
`wise_ft.json` (`{"rows": [...], "sets": {"test": NAME, "shift": NAME}, "best_shift_alpha": ...}`) and `wise_ft.csv`
(one row per alpha), and plotted as `wise_ft.png` (test against shifted top-1, a point per alpha; matplotlib is the
`report` extra: without it the plot is skipped, said in one line).
"""

import csv
import json
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np

from clip_jax.runtime import ownership

TABLE_JSON, TABLE_CSV, PLOT = "wise_ft.json", "wise_ft.csv", "wise_ft.png"
METRICS = ("acc1", "acc5", "mean_per_class_recall")


def interpolate(zero_shot, fine_tuned, alpha: float):
    """`(1 - alpha) * zero_shot + alpha * fine_tuned` for every leaf of two trees of one structure, as float32."""
    return jax.tree.map(lambda z, f: ((1 - alpha) * np.asarray(z, np.float32)
                                      + alpha * np.asarray(f, np.float32)).astype(np.float32), zero_shot, fine_tuned)


def sweep(zero_shot, fine_tuned, alphas: Sequence[float], score: Callable[[object], dict[str, dict[str, float]]],
          say: Callable[[str], None] = print) -> list[dict]:
    """One row per alpha: `{"alpha": a, "<set>_<metric>": value, ...}` from `score(theta(a))`, which returns each
    set's metrics (`{"test": {...}, "shift": {...}}`)."""
    rows = []
    for alpha in alphas:
        scores = score(interpolate(zero_shot, fine_tuned, alpha))
        row = {"alpha": float(alpha)}
        for name, metrics in scores.items():
            row.update({f"{name}_{k}": float(v) for k, v in metrics.items()})
        say("WiSE-FT alpha {:.2f}: ".format(alpha) + ", ".join(f"{k} {v:.4f}" for k, v in row.items()
                                                             if k.endswith("acc1")))
        rows.append(row)
    return rows


def best_alpha(rows: Sequence[dict], column: str) -> float:
    """The alpha of the highest `column` (ties: the smaller alpha)."""
    return max(rows, key=lambda r: (r[column], -r["alpha"]))["alpha"]


def summary(rows: Sequence[dict], column: str = "shift_acc1") -> dict:
    """Whether an alpha strictly inside (0, 1) beats both endpoints on `column`: the endpoints', the best's."""
    by_alpha = {r["alpha"]: r[column] for r in rows}
    best = best_alpha(rows, column)
    ends = [by_alpha[a] for a in (0.0, 1.0) if a in by_alpha]
    return {"column": column, "best_alpha": best, "best": by_alpha[best], "zero_shot": by_alpha.get(0.0),
            "fine_tuned": by_alpha.get(1.0),
            "beats_both_endpoints": len(ends) == 2 and 0 < best < 1 and by_alpha[best] > max(ends)}


def write_table(run_dir: str, rows: Sequence[dict], sets: dict[str, str]) -> tuple[str, str]:
    """`wise_ft.json` and `wise_ft.csv` in `run_dir`; returns their paths."""
    ownership.claim(run_dir, [TABLE_JSON, TABLE_CSV], writing="the WiSE-FT table", change="give another run name")
    json_path, csv_path = os.path.join(run_dir, TABLE_JSON), os.path.join(run_dir, TABLE_CSV)
    record = {"sets": sets, "rows": list(rows)}
    if "shift_acc1" in rows[0]:
        record["shift_summary"] = summary(rows)
    with open(json_path, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return json_path, csv_path


def write_plot(run_dir: str, rows: Sequence[dict], sets: dict[str, str]) -> str | None:
    """`wise_ft.png`: shifted against test top-1 (or top-1 against alpha without a shift); None, with a line
    said, when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib (pip install 'clipjax-train[report]'): the WiSE-FT plot is skipped; the table is "
              f"{os.path.join(run_dir, TABLE_CSV)}", flush=True)
        return None
    ownership.claim(run_dir, [PLOT], writing="the WiSE-FT plot", change="give another run name")
    alphas = [r["alpha"] for r in rows]
    test = [100 * r["test_acc1"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 4))
    if "shift_acc1" in rows[0]:
        shift = [100 * r["shift_acc1"] for r in rows]
        ax.plot(test, shift, "o-")
        for a, x, y in zip(alphas, test, shift):
            ax.annotate(f"{a:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel(f"top-1 on {sets['test']} (%)")
        ax.set_ylabel(f"top-1 on {sets['shift']} (%)")
    else:
        ax.plot(alphas, test, "o-")
        ax.set_xlabel("alpha")
        ax.set_ylabel(f"top-1 on {sets['test']} (%)")
    ax.set_title("WiSE-FT: (1 - alpha) zero-shot + alpha fine-tuned")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(run_dir, PLOT)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
