"""The planner's XLA:GPU memory, compiled without a GPU, against the allocator's peak measured on the GPU.

    python benchmarks/planner_vs_gpu.py benchmarks/results/h200-2026-11-30-*.jsonl [--out DIR]

For every clip_jax run of the GPU suite that finished (benchmarks/gpu_suite.py), compiles the same train step (model,
precision, remat, attention, batch, one device) with XLA:GPU for the GPU the run was on, on this machine, from abstract
inputs (`clip_jax.plan.compile_train_step` over `clip_jax.runtime.xla_gpu` devices), and sets its memory next to the
peak JAX's allocator reported on the GPU. Needs jaxlib's CUDA plugin (`pip install -e '.[gpu]'`). Prints a table and
writes DIR/planner_vs_gpu.json.
"""

import argparse
import json
import pathlib
import time

from clip_jax.runtime import xla_gpu

xla_gpu.prepare()

import jax  # noqa: E402

from clip_jax import plan  # noqa: E402
from clip_jax.models import get_model_config  # noqa: E402
from clip_jax.runtime.hardware import gpu_for_device_kind  # noqa: E402
from clip_jax.runtime.mesh import create_mesh  # noqa: E402
from clip_jax.training.step_factory import StepSpec  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", help="gpu_suite.jsonl files")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "out"))
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")

    runs = [json.loads(line) for path in args.results for line in open(path) if line.strip()]
    runs = [r for r in runs if r["framework"] == "clip_jax" and r["status"] == "ok" and not r.get("xla_flags")]
    rows, seen = [], set()
    for run in runs:
        key = (run["device_kind"], run["precision"], run["remat"], run["attention"], run["batch"])
        if key in seen:
            continue
        seen.add(key)
        gpu = gpu_for_device_kind(run["device_kind"])
        mesh = create_mesh(xla_gpu.devices(gpu, 1, 1))
        setup = StepSpec(get_model_config(run["model"]), run["precision"], run["remat"],
                         attention_impl="xla" if run["attention"] in ("xla", "auto") else run["attention"])
        start = time.perf_counter()
        planned = plan.StepMemory.of(plan.compile_train_step(setup, mesh, run["batch"])).total
        rows.append({"gpu": gpu.name, "precision": run["precision"], "remat": run["remat"],
                     "attention": run["attention"], "batch": run["batch"], "planned_bytes": planned,
                     "gpu_xla_bytes": run["xla_memory"]["total"], "gpu_peak_bytes": run["peak_bytes_in_use"],
                     "ratio": planned / run["peak_bytes_in_use"], "compile_s": time.perf_counter() - start})
        print(f"compiled {key} in {rows[-1]['compile_s']:.0f} s", flush=True)

    lines = [f"{'gpu':<6}{'prec':<6}{'remat':<18}{'attn':<7}{'batch':>6}{'planned GiB':>13}{'GPU peak GiB':>14}"
             f"{'planned/peak':>14}"]
    for r in rows:
        lines.append(f"{r['gpu']:<6}{r['precision']:<6}{r['remat']:<18}{r['attention']:<7}{r['batch']:>6}"
                     f"{r['planned_bytes'] / 2**30:>13.2f}{r['gpu_peak_bytes'] / 2**30:>14.2f}{r['ratio']:>14.3f}")
    print("\n".join(lines))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner_vs_gpu.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
