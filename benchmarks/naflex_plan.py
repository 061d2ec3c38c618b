"""SigLIP 2's NaFlex SO400M/16 planned at patch budgets: the planner's memory and samples/s per budget.

    python benchmarks/naflex_plan.py [--budgets 256 576 1024] [--gpu h200] [--gpus 8] [--search-batch]
                                     [--no-reference] [--out DIR]

For each budget, `clip_jax.plan.plan` of `configs/l14_laion2b.py`'s recipe (bf16, remat, per-device batch 224) with
the model `ViT-SO400M-16-SigLIP2-NaFlex` and the sigmoid loss: the train step compiled deviceless by XLA:GPU for
the GPUs (its images NaFlex rows [B, budget, 16 * 16 * 3 + 2]), its memory per device, the speed predicted from its
kernels and the MFU rule's, the analytic train FLOPs per sample (the budget counted whole, padding included). A last
row plans the fixed-resolution `ViT-SO400M-16-SigLIP2-384` (24 x 24 = 576 patches, the same FLOPs as the budget
576): what NaFlex's rows, masks and position-grid resize cost beside it. `--search-batch` also finds each budget's
largest per-device batch (a few more compiles each). Needs jaxlib's CUDA plugin (`pip install -e '.[gpu]'`).
Prints a table and writes DIR/naflex_plan.json (each row's plan as `python -m clip_jax.plan --json` gives it).
"""

import argparse
import dataclasses
import json
import pathlib
import runpy
import time

from clip_jax.runtime import xla_gpu

xla_gpu.prepare()

import jax  # noqa: E402

from clip_jax import plan  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
NAFLEX, FIXED = "ViT-SO400M-16-SigLIP2-NaFlex", "ViT-SO400M-16-SigLIP2-384"


def recipe(model: str):
    """configs/l14_laion2b.py's training config with `model` and the sigmoid loss."""
    config = runpy.run_path(str(REPO / "configs" / "l14_laion2b.py"))["get_config"]()
    config.update(model=model, loss="siglip")
    return config


def row(model: str, budget: int | None, args) -> dict:
    start = time.perf_counter()
    planned = plan.plan(recipe(model), args.gpu, args.gpus, compiler="gpu", max_num_patches=budget,
                        search_batch=args.search_batch, xla_flops=False,
                        progress=lambda message: print(f"  {message}", flush=True))
    m, t = planned.memory_per_device, planned.throughput
    return {"model": model, "max_num_patches": budget, "batch_size": planned.setup.batch_size,
            "attention": planned.setup.attention, "remat": planned.setup.remat_policy,
            "train_gflop_per_sample": planned.flops_per_sample.train_analytic / 1e9,
            "memory_gib": m.total_bytes / 2**30, "temp_gib": m.temp_bytes / 2**30,
            "state_gib": m.state_bytes / 2**30, "usable_gib": m.usable_bytes / 2**30, "fits": m.fits,
            "largest_batch": m.largest_batch, "predicted_samples_per_s_per_gpu": t.predicted_samples_per_s,
            "mfu_rule_samples_per_s_per_gpu": t.mfu_rule_samples_per_s_per_gpu,
            "notes": list(planned.notes), "plan_s": time.perf_counter() - start,
            "plan": dataclasses.asdict(planned)}


def table(rows: list[dict]) -> str:
    lines = [f"{'model':<30}{'patches':>8}{'batch':>6}{'train GF':>10}{'GiB':>8}{'largest':>8}{'pred. s/s':>11}"
             f"{'MFU s/s':>9}{'plan s':>8}"]
    for r in rows:
        largest = "-" if r["largest_batch"] is None else str(r["largest_batch"])
        patches = r["max_num_patches"] or 576  # the fixed tower's 24 x 24
        lines.append(f"{r['model']:<30}{patches:>8}{r['batch_size']:>6}{r['train_gflop_per_sample']:>10.1f}"
                     f"{r['memory_gib']:>8.2f}{largest:>8}{r['predicted_samples_per_s_per_gpu']:>11.1f}"
                     f"{r['mfu_rule_samples_per_s_per_gpu']:>9.1f}{r['plan_s']:>8.0f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 576, 1024])
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--search-batch", action="store_true", help="find each budget's largest per-device batch")
    parser.add_argument("--no-reference", action="store_true", help=f"leave out the {FIXED} row")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "out"))
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")  # XLA:GPU's compile-only devices need no CUDA backend
    if not xla_gpu.cuda_plugin_installed():
        raise SystemExit(f"naflex_plan.py compiles with XLA:GPU: {xla_gpu.INSTALL_HINT}")

    plans = [(NAFLEX, budget) for budget in args.budgets] + ([] if args.no_reference else [(FIXED, None)])
    rows = []
    for model, budget in plans:
        print(f"planning {model}" + (f" at {budget} patches" if budget else ""), flush=True)
        rows.append(row(model, budget, args))
    print(f"\n{args.gpus} x {args.gpu}, deviceless XLA:GPU; train GFLOP per sample, GiB per device, samples/s per "
          "GPU (predicted from the kernels, and the MFU rule's)\n" + table(rows))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "naflex_plan.json").write_text(json.dumps({"gpu": args.gpu, "gpus": args.gpus, "rows": rows}, indent=2))
    print(f"wrote {out / 'naflex_plan.json'}")


if __name__ == "__main__":
    main()
