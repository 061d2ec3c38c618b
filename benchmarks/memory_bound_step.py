"""The step's memory-bound work, change by change: ViT-L/14's bf16 train step compiled for XLA:GPU without a GPU,
its memory-bound bytes and its samples/s predicted by the step-time model, with each change of issue 54 undone in
turn (the first row undoes them all: the step as it was), then rows with every change and the switches on: the Pallas
switch (`fused_kernels="pallas"`: the residual adds and LayerNorms as Triton kernels,
`clip_jax.models.fused_layer_norm`), then the towers' blocks unrolled (`unroll_layers`) without and with it.

    python benchmarks/memory_bound_step.py [--out DIR] [--cache DIR] [--rows N] [--settings N] [--no-switch]
                                           [--no-unroll]

Settings: one H200 at 256 with cuDNN attention, `dots_saveable` and no remat; one A100-40GB at 224 with
`nothing_saveable` (the LAION-2B recipe's). A row's changes are cumulative: row k has the first k changes. A
change is undone in this process only (a patched function, other compiler options), never in the library.
Memory-bound bytes: every kernel the reader (`clip_jax.runtime.hlo_kernels`) does not count as a product, fused
attention or collective, every run counted, read plus written, Pallas kernels (custom calls) at their operand and
result bytes, also listed on their own. Predicted samples/s: `clip_jax.plan.step_time` with
`H200_FIT` scaled to each GPU's datasheet. Needs jaxlib's CUDA plugin (`pip install -e '.[gpu]'`); each compile
takes 20-70 s on two cores (the HLO is cached in --cache, keyed by the row, the setting and the model's source).
Each compile's seconds are kept with its HLO (a setting's compile time, scanned against unrolled).
Prints a table and writes DIR/memory_bound_step.json.
"""

import argparse
import contextlib
import gzip
import hashlib
import json
import pathlib
import sys
import time
from unittest import mock

from clip_jax.runtime import xla_gpu

xla_gpu.prepare()

import jax  # noqa: E402

from clip_jax import plan  # noqa: E402
from clip_jax.models import layers  # noqa: E402
from clip_jax.plan import step_time  # noqa: E402
from clip_jax.runtime import hlo_kernels  # noqa: E402
from clip_jax.runtime.hardware import get_gpu  # noqa: E402
from clip_jax.runtime.mesh import create_mesh  # noqa: E402
from clip_jax.training.step_factory import StepSpec  # noqa: E402

SETTINGS = [  # (gpu, remat, per-GPU batch)
    ("h200", "dots_saveable", 256),
    ("h200", "none", 256),
    ("a100-40gb", "nothing_saveable", 224),
]
SOURCES = pathlib.Path(layers.__file__).parent  # the model's code: a change there is another cache key


def autodiff_gelu_input_gradient(x, cotangent, quick, approximate):
    """The GELU backward as the step had it: autodiff's pullback of the float32 GELU."""
    _, pullback = jax.vjp(lambda x32: layers._gelu(x32, quick, approximate), x)
    return pullback(cotangent)[0]


def without_gelu_written_out():
    return mock.patch.object(layers, "_gelu_input_gradient", autodiff_gelu_input_gradient)


def without_adopted_flags():
    return mock.patch.object(xla_gpu, "COMPILER_OPTIONS", dict(xla_gpu.DEVICELESS_OPTIONS))


# Issue 54's changes in the order they landed: (row name, how to undo it here).
CHANGES = [
    ("GELU' written out (Phi(x) + x phi(x))", without_gelu_written_out),
    ("+ Triton multi-output fusions (adopted flag)", without_adopted_flags),
]
SWITCH_ROW = "+ fused_kernels='pallas' (the switch on)"
UNROLL_ROWS = [("+ unroll_layers (the blocks unrolled; the switch off)", "off"),
               ("+ unroll_layers and fused_kernels='pallas'", "pallas")]


def undone(row: int) -> contextlib.ExitStack:
    """The step with the first `row` changes and without the rest."""
    stack = contextlib.ExitStack()
    for _, undo in CHANGES[row:]:
        stack.enter_context(undo())
    return stack


def source_key() -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCES.glob("*.py")) + [pathlib.Path(xla_gpu.__file__)]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def compiled_kernels(row: int, fused_kernels: str, unroll: bool, gpu_name: str, remat: str, batch: int,
                     cache: pathlib.Path) -> tuple[list, float, float | None]:
    """(kernels, GiB per device, compile seconds) of the step at a setting with the first `row` changes,
    `fused_kernels` and the blocks unrolled or not."""
    switch = ("" if fused_kernels == "off" else f"_{fused_kernels}") + ("_unrolled" if unroll else "")
    path = cache / f"row{row}{switch}_{gpu_name}_{remat}_{batch}_{source_key()}.json.gz"
    if not path.exists():
        spec = StepSpec.for_model("ViT-L-14", "bf16", remat, attention_impl="cudnn", fused_kernels=fused_kernels,
                                  unroll_layers=unroll)
        start = time.perf_counter()
        with undone(row):
            compiled = plan.compile_train_step(spec, create_mesh(xla_gpu.devices(get_gpu(gpu_name), 1, 1)), batch)
        seconds = time.perf_counter() - start
        gib = plan.StepMemory.of(compiled).total / 2**30
        with gzip.open(path, "wt") as f:
            json.dump({"hlo": compiled.as_text(), "gib": gib, "compile_s": seconds}, f)
        print(f"compiled row {row}{switch} {gpu_name} {remat} {batch} in {seconds:.0f} s", file=sys.stderr,
              flush=True)
    saved = json.load(gzip.open(path, "rt"))
    return hlo_kernels.kernels(saved["hlo"]), saved["gib"], saved.get("compile_s")


def measure(row: int, fused_kernels: str, unroll: bool, gpu_name: str, remat: str, batch: int,
            cache: pathlib.Path) -> dict:
    kernels, gib, compile_s = compiled_kernels(row, fused_kernels, unroll, gpu_name, remat, batch, cache)
    predicted = step_time.predict(kernels, step_time.KernelRates.of(get_gpu(gpu_name)))
    memory_bound = sum(k.step_bytes for k in kernels if k.kind not in ("gemm", "attention", "collective"))
    custom_calls = sum(k.step_bytes for k in kernels if k.kind == "custom_call")
    return {"gpu": gpu_name, "remat": remat, "batch": batch, "memory_bound_gb": memory_bound / 1e9,
            "custom_call_gb": custom_calls / 1e9,
            "samples_per_s": batch / predicted.seconds, "step_ms": predicted.seconds * 1e3, "device_gib": gib,
            "compile_s": compile_s,
            "kernel_runs": sum(k.runs for k in kernels), "split_ms": {p: s * 1e3 for p, s in predicted.split.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "out"))
    parser.add_argument("--cache", default=str(pathlib.Path(__file__).parent / "out" / "memory_bound_hlo"))
    parser.add_argument("--rows", type=int, default=len(CHANGES) + 1, help="only the first N rows of changes")
    parser.add_argument("--settings", type=int, default=len(SETTINGS), help="only the first N settings")
    parser.add_argument("--no-switch", action="store_true", help="without the row with the Pallas switch on")
    parser.add_argument("--no-unroll", action="store_true", help="without the rows with the blocks unrolled")
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")
    out, cache = pathlib.Path(args.out), pathlib.Path(args.cache)
    out.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)

    names = ["today (none of the changes)"] + [name for name, _ in CHANGES]
    settings = SETTINGS[:args.settings]
    plan_rows = [(names[row], row, "off", False) for row in range(min(args.rows, len(names)))]
    if not args.no_switch:
        plan_rows.append((SWITCH_ROW, len(CHANGES), "pallas", False))
    if not args.no_unroll:
        plan_rows += [(name, len(CHANGES), fused, True) for name, fused in UNROLL_ROWS
                      if fused == "off" or not args.no_switch]
    rows = [{"change": name, "fused_kernels": fused, "unroll_layers": unroll,
             "settings": [measure(row, fused, unroll, *setting, cache) for setting in settings]}
            for name, row, fused, unroll in plan_rows]

    header = "".join(f"{f'{g} {r} {b}':>38}" for g, r, b in settings)
    lines = ["ViT-L/14 bf16, cuDNN attention; per setting: memory-bound GB, predicted samples/s (x the first row),"
             " GiB per device", f"{'change':<56}{header}"]
    for row in rows:
        cells = []
        for setting, base in zip(row["settings"], rows[0]["settings"]):
            ratio = setting["samples_per_s"] / base["samples_per_s"]
            cells.append(f"{setting['memory_bound_gb']:>9.1f} GB {setting['samples_per_s']:>7.1f}/s "
                         f"({ratio:.3f}x) {setting['device_gib']:>5.1f}")
        lines.append(f"{row['change']:<56}" + "".join(f"{c:>38}" for c in cells))
        if any(s["custom_call_gb"] for s in row["settings"]):
            lines.append(f"{'  of which Pallas kernels (custom calls)':<56}"
                         + "".join(f"{s['custom_call_gb']:>9.1f} GB{'':>27}" for s in row["settings"]))
    lines.append("compile seconds here (a setting's whole train step; '-': cached by an older run)")
    for row in rows:
        lines.append(f"{row['change']:<56}" + "".join(
            f"{'-' if s['compile_s'] is None else format(s['compile_s'], '.0f') + ' s':>38}" for s in row["settings"]))
    table = "\n".join(lines)
    print(table)
    result = {"jax": jax.__version__, "efficiencies": step_time.H200_FIT.fitted_on,
              "compiler_options": xla_gpu.COMPILER_OPTIONS, "rows": rows}
    (out / "memory_bound_step.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
