"""The step-time model (clip_jax.plan.step_time) fitted on the H200 measurements, and checked on rows it was not
fitted on.

    python benchmarks/step_time_model.py [--out DIR] [--cache DIR] [--before FIT.json] [--held-out FILE ...]
    python benchmarks/step_time_model.py --check results/h200-DAY-NAME.jsonl   # a later lease, the saved fit

The refit runs whenever a lease's results arrive: put its gpu_suite.jsonl in benchmarks/results as
h200-DAY-NAME.jsonl (its kept traces beside it, named in RAW_TRACES where its lines do not name their kernels) and
run the first command. Its rows are GPU measurements only: every finished ViT-L/14 clip_jax run an H200 recorded
(benchmarks/results/h200-*.jsonl; runs with XLA flags other than the adopted ones left out), each setting's mean step
time one row, and each part of each traced run (gpu_suite.py --profile: matrix products, attention, memory-bound
kernels, from the run's results line or its kept trace) one row more. Anything else a results file holds (a CPU
smoke run, a failed run, another GPU's) changes nothing. Compiles today's step at each measured setting for one H200
without a GPU (deviceless XLA:GPU, as the planner does, with the run's adopted XLA flags; the HLO is cached in
--cache) and reads its kernels (clip_jax.runtime.hlo_kernels).

The matrix products run at the matmul peak the suite measured for their precision (an 8192^3 product through XLA:
bf16 and TF32; FP8 at twice bf16's, not measured) times one fitted factor for the step's shapes. That factor and
the other three constants (fused-attention efficiency, memory efficiency, launch cost) are fitted by non-negative
least squares on relative errors. Each kernel counts its compute or its memory term, whichever the current constants
make larger; the fit repeats until no kernel changes side. Custom calls (Pallas kernels) count as memory-bound.

Checked two ways: each setting predicted by a fit without it and its traces (leave-one-out), and each results file
of the newest day (--held-out: any) predicted by a fit on every other file's rows, as a later lease is. Every table
sets the fit before this one (--before; by default the newest results/cpu-DAY-step-time-model.json, the fit
step_time.H200_FIT holds) beside the refit. Prints the tables and writes DIR/step_time_model.json and .txt.

What differs from the device: the measurements ran jax 0.11.2 with autotuning and Triton GEMMs; the deviceless
compile here runs the installed jax without either (so the Triton on/off pair measured on 2026-11-30 is out of
reach and left out), and 2026-11-30's code was a few refactors older (RESULTS 10: < 1% in speed).

--check FILE fits nothing: it predicts the settings FILE measured with the efficiencies clip_jax.plan.step_time
holds (`H200_FIT`), beside what FILE and the other files measured at each setting, and each part's time (products,
attention, memory-bound) in the kernels FILE's runs traced; it writes DIR/step_time_check.json.
"""

import argparse
import collections
import dataclasses
import gzip
import json
import pathlib
import statistics
import sys
import tempfile
import time

from clip_jax.runtime import xla_gpu

xla_gpu.prepare()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from scipy.optimize import nnls  # noqa: E402

from clip_jax.plan import step_time  # noqa: E402
from clip_jax.plan.cost import MEASURED_MFU  # noqa: E402
from clip_jax.models import get_model_config  # noqa: E402
from clip_jax.models.flops import train_flops  # noqa: E402
from clip_jax.runtime import hlo_kernels  # noqa: E402
from clip_jax.runtime.hardware import get_gpu  # noqa: E402
from clip_jax.runtime.mesh import create_mesh  # noqa: E402
from clip_jax.training.step_factory import StepSpec, build_step  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
GPU = get_gpu("h200")
NUMERICS = ("grad_reduce_dtype", "residual_dtype")
# The fitted constants, as inverse rates: seconds per FLOP of the measured matmul peak (products), per FLOP
# (attention), per byte, per launch (in microseconds).
COLUMNS = ("gemm", "attention", "memory", "launch_us")
DATASHEET = {"gemm_16bit": GPU.bf16_tflops * 1e12, "gemm_tf32": GPU.tf32_tflops * 1e12,
             "attention": GPU.bf16_tflops * 1e12, "memory": GPU.target.memory_bandwidth}
# The lever ratios a model must get right (the issue's): (name, faster setting, slower setting).
LEVERS = [
    ("cuDNN over XLA attention (nothing_saveable, 256)", ("bf16", "nothing_saveable", "cudnn", 256),
     ("bf16", "nothing_saveable", "xla", 256)),
    ("bf16 cuDNN over fp32 XLA attention (dots_saveable, 256)", ("bf16", "dots_saveable", "cudnn", 256),
     ("fp32", "dots_saveable", "xla", 256)),
    ("no remat over dots_saveable (bf16, cuDNN, 256)", ("bf16", "none", "cudnn", 256),
     ("bf16", "dots_saveable", "cudnn", 256)),
    ("batch 512 over 128 (nothing_saveable, cuDNN)", ("bf16", "nothing_saveable", "cudnn", 512),
     ("bf16", "nothing_saveable", "cudnn", 128)),
]
# The raw traces the suite kept (the first clip_jax run of a call with --profile), by (results file, setting). A run
# whose results line lists its kernels by name (`hlo_op` beside each) is split into parts from that line; the first
# lease of 2026-12-04 recorded them by the CUDA graph they ran in, so only its kept traces split its runs.
RAW_TRACES = {
    ("h200-2026-12-04-next.jsonl", ("bf16", "dots_saveable", "cudnn", 256)):
        "h200-2026-12-04-bf16-dots_saveable-cudnn-256.xplane.pb.gz",
    ("h200-2026-12-04-after.jsonl", ("fp32", "dots_saveable", "xla", 256)):
        "h200-2026-12-04-fp32-dots_saveable-xla-256.xplane.pb.gz",
    ("h200-2026-12-04-heldout.jsonl", ("bf16", "nothing_saveable", "cudnn", 512)):
        "h200-2026-12-04-bf16-nothing_saveable-cudnn-512.xplane.pb.gz",
}
PROFILED_STEPS = 2  # benchmarks/gpu_suite.py traced two steps
# The fits this benchmark saved (results/cpu-DAY-step-time-model.json), the newest of them being the one
# step_time.H200_FIT holds: "before" in a refit's tables unless --before names another.
SAVED_FITS = "cpu-*-step-time-model.json"
# Steps no GPU has measured, predicted with the fit: (gpu, precision, remat, attention, per-GPU batch). The recipe's
# 224 per A100-40GB (OpenCLIP's run: 72.6 samples/s per GPU on 384, fp16 AMP) and the H100 beside the H200.
PREDICT_ONLY = [
    ("a100-40gb", "bf16", "nothing_saveable", "cudnn", 224),
    ("a100-40gb", "bf16", "dots_saveable", "cudnn", 224),
    ("h100", "bf16", "nothing_saveable", "cudnn", 224),
    ("h100", "bf16", "dots_saveable", "cudnn", 224),
    ("h200", "bf16", "nothing_saveable", "cudnn", 224),
    ("h200", "bf16", "dots_saveable", "cudnn", 224),
    ("h200", "bf16", "none", "cudnn", 224),
    ("h200", "bf16", "dots_saveable", "cudnn", 384),
]


@dataclasses.dataclass(frozen=True)
class Trace:
    """One traced run's device kernels: seconds per step by kernel name, and the results file it came from."""

    kernels: dict
    source: str

    @property
    def parts(self) -> dict[str, float]:
        """Seconds per step of each part: gemm, attention, memory (trace_part)."""
        parts: dict[str, float] = collections.defaultdict(float)
        for name, seconds in self.kernels.items():
            parts[trace_part(name)] += seconds
        return dict(parts)


@dataclasses.dataclass
class Setting:
    precision: str
    remat: str
    attention: str
    batch: int
    numerics: tuple = ()  # ((name, value), ...) of StepSpec's numerics options
    xla_flags: tuple = ()  # ((flag, value), ...): the adopted XLA:GPU flags the run set (xla_gpu.ADOPTED_FLAGS)
    measured: list = dataclasses.field(default_factory=list)  # (samples/s, source file)
    superseded: list = dataclasses.field(default_factory=list)  # earlier days' runs of a setting measured again
    profiled: list = dataclasses.field(default_factory=list)  # a Trace per traced run
    kernels: list | None = None

    @property
    def key(self) -> tuple:
        return ((self.precision, self.remat, self.attention, self.batch) + tuple(v for _, v in self.numerics)
                + tuple(f"{name}={value}" for name, value in self.xla_flags))

    @property
    def label(self) -> str:
        extra = "".join(f" {name}={value}" for name, value in self.numerics + self.xla_flags)
        return f"{self.precision} {self.remat} {self.attention} {self.batch}{extra}"

    @property
    def step_s(self) -> float:
        return self.batch / statistics.mean(rate for rate, _ in self.measured)


def lease_files(results: pathlib.Path = RESULTS) -> list[pathlib.Path]:
    """The GPU suite's results files of H200 leases, oldest first."""
    return sorted(results.glob("h200-*.jsonl"))


def measured_settings(paths=None) -> list[Setting]:
    """Every finished ViT-L/14 clip_jax run on an H200 (in `paths`, else in every results file), grouped by setting
    (Triton-off runs left out), with the parts of each traced run. A setting measured on several days keeps its
    latest day's runs: the step changed in between (2026-12-02's lean LayerNorm and GELU halved the memory of the
    step without remat), and the model predicts today's. Only a GPU's measurements are rows: whatever else a results
    file holds (a CPU smoke run, a failed or flagged run, another GPU's) changes nothing."""
    settings: dict[tuple, Setting] = {}
    for path in lease_files() if paths is None else paths:
        for line in path.read_text().splitlines():
            run = json.loads(line)
            if not is_h200_row(run):
                continue
            setting = Setting(run["precision"], run["remat"], run["attention"], run["batch"], _numerics(run),
                              _flags(run))
            setting = settings.setdefault(setting.key, setting)
            setting.measured.append((run["samples_per_s"], path.name))
            kernels = traced_kernels(run, path)
            if kernels is not None:
                setting.profiled.append(Trace(kernels, path.name))
    for setting in settings.values():
        latest = max(_day(source) for _, source in setting.measured)
        setting.superseded = [(rate, source) for rate, source in setting.measured if _day(source) != latest]
        setting.measured = [(rate, source) for rate, source in setting.measured if _day(source) == latest]
        setting.profiled = [trace for trace in setting.profiled if _day(trace.source) == latest]
    return list(settings.values())


def is_h200_row(run: dict) -> bool:
    """A finished ViT-L/14 clip_jax step an H200 measured, with no XLA flags but adopted ones (the compile here
    sets those as the run did; others, such as Triton GEMMs off, it cannot tell from the step without them)."""
    return (run.get("framework") == "clip_jax" and run.get("status") == "ok" and run.get("model") == "ViT-L-14"
            and "H200" in (run.get("device_kind") or "")
            and set(xla_gpu.parse_xla_flags(run.get("xla_flags") or "")) <= set(xla_gpu.ADOPTED_FLAGS))


def traced_kernels(run: dict, path: pathlib.Path) -> dict[str, float] | None:
    """Seconds per step of each device kernel a run traced, by name: from its results line where that names every
    kernel, else from the raw trace the suite kept of it; None if neither."""
    ops = (run.get("kernels") or {}).get("ops")
    if ops and all("hlo_op" in op for op in ops.values()):
        return {name: op["us"] * 1e-6 for name, op in ops.items()}
    raw = RAW_TRACES.get((path.name, _key(run)))
    return profile_kernels(path.parent / raw) if raw else None


def _numerics(run: dict) -> tuple:
    return tuple((name, run[name]) for name in NUMERICS if run.get(name))


def _flags(run: dict) -> tuple:
    return tuple(sorted(xla_gpu.parse_xla_flags(run.get("xla_flags") or "").items()))


def _key(run: dict) -> tuple:
    return Setting(run["precision"], run["remat"], run["attention"], run["batch"], _numerics(run), _flags(run)).key


def _day(source: str) -> str:
    return source.removeprefix("h200-")[:10]  # h200-2026-11-30-core.jsonl -> 2026-11-30


def compile_kernels(setting: Setting, cache: pathlib.Path, gpu=GPU) -> list:
    """Today's step at the setting, compiled for one GPU without a GPU: its kernels (the HLO text is cached)."""
    name = "_".join(str(part) for part in setting.key) + ("" if gpu is GPU else f"_{gpu.name}")
    path = cache / (name + ".hlo.txt.gz")
    if not path.exists():
        spec = StepSpec(get_model_config("ViT-L-14"), setting.precision, setting.remat,
                        attention_impl=setting.attention, **dict(setting.numerics))
        start = time.perf_counter()
        step = build_step(spec, create_mesh(xla_gpu.devices(gpu, 1, 1)))
        lowered = step.update.lower(step.abstract_state, step.abstract_batch(setting.batch))
        compiled = lowered.compile(compiler_options=compile_options(setting))
        with gzip.open(path, "wt") as f:
            f.write(compiled.as_text())
        print(f"compiled {setting.label} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return hlo_kernels.kernels(gzip.open(path, "rt").read())


def compile_options(setting: Setting) -> dict:
    """A deviceless compile's options with the adopted XLA flags as the run had them: those it did not set are
    compiled as XLA's defaults (an adopted flag changes one: a boolean's default is its other value)."""
    unset = {name: not value for name, value in xla_gpu.ADOPTED_FLAGS.items() if isinstance(value, bool)}
    return {**xla_gpu.COMPILER_OPTIONS, **unset, **dict(setting.xla_flags)}


def trace_part(kernel_name: str) -> str:
    """The part of the step a profiled kernel belongs to, from its name alone (the trace's names for cuBLAS and
    cuDNN kernels are the libraries', not the HLO's)."""
    name = kernel_name.lower()
    if "sdpa" in name or "cudnn::fusion" in name or "fmha" in name or "flash" in name:
        return "attention"
    if (name.startswith(("nvjet", "sm90_xmma", "sm80_xmma", "gemm_fusion")) or "cutlass" in name
            or "xmma_gemm" in name or "convertTensor" in kernel_name):
        return "gemm"
    return "memory"  # XLA's fusions, copies, memsets


def profile_kernels(path: pathlib.Path) -> dict[str, float]:
    """Seconds per step each profiled kernel took on the GPU, by name, from a kept trace."""
    with tempfile.NamedTemporaryFile(suffix=".xplane.pb") as raw:
        raw.write(gzip.open(path).read())
        raw.flush()
        data = jax.profiler.ProfileData.from_file(raw.name)
    kernels: dict[str, float] = collections.defaultdict(float)
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            for line in plane.lines:
                for event in line.events:
                    kernels[event.name[:160]] += event.duration_ns * 1e-9 / PROFILED_STEPS  # as the suite keys them
    return dict(kernels)


def matmul_peaks() -> dict[str, float]:
    """FLOP/s of the 8192^3 products the suite measured on the H200, mean per precision: {"bf16": ..., "f32": ...}."""
    runs = [json.loads(line) for path in lease_files() for line in path.read_text().splitlines()]
    peaks = {}
    for precision, dtype in (("bf16", "bf16"), ("fp32", "f32")):
        peaks[dtype] = 1e12 * statistics.mean(r["tflops"] for r in runs if r.get("framework") == "matmul"
                                              and r.get("status") == "ok" and r["precision"] == precision
                                              and "H200" in (r.get("device_kind") or ""))
    return peaks


PEAKS = matmul_peaks()


def kernel_terms(kernel, compute_bound: bool) -> np.ndarray:
    """One kernel's coefficients on the inverse rates (COLUMNS), every run counted."""
    row = np.zeros(len(COLUMNS))
    if kernel.kind == "gemm" and compute_bound:
        peak = PEAKS["f32"] if kernel.dtype == "f32" else PEAKS["bf16"]
        row[COLUMNS.index("gemm")] = kernel.flops / peak / (step_time.FP8_OVER_BF16 if kernel.dtype == "f8" else 1)
    elif kernel.kind == "attention" and compute_bound:
        row[COLUMNS.index("attention")] = kernel.flops
    else:
        row[COLUMNS.index("memory")] = kernel.bytes
    return row * kernel.runs


def compute_bound(kernel, theta: np.ndarray | None) -> bool:
    if kernel.kind not in ("gemm", "attention"):
        return False
    if theta is None:
        return True
    terms = kernel_terms(kernel, True)
    return float(terms @ theta) >= kernel.bytes * kernel.runs * theta[COLUMNS.index("memory")]


def design_rows(settings: list[Setting], theta) -> tuple[list, list, list]:
    """(coefficients, measured seconds, what each row is) for the fit: one row per setting (its mean step), one per
    part of each traced run."""
    rows, times, labels = [], [], []
    for setting in settings:
        row = sum(kernel_terms(k, compute_bound(k, theta)) for k in setting.kernels)
        row[COLUMNS.index("launch_us")] = sum(k.runs for k in setting.kernels) * 1e-6  # launch_us: microseconds
        rows.append(row)
        times.append(setting.step_s)
        labels.append(f"step {setting.label}")
        for trace in setting.profiled:
            for part, seconds in trace.parts.items():
                members = [k for k in setting.kernels if _profile_part(k) == part]
                rows.append(sum((kernel_terms(k, compute_bound(k, theta)) for k in members), np.zeros(len(COLUMNS))))
                times.append(seconds)
                labels.append(f"profile {setting.label} ({trace.source}): {part}")
    return rows, times, labels


def _profile_part(kernel) -> str:
    return kernel.kind if kernel.kind in ("gemm", "attention") else "memory"


def fit(settings: list[Setting]) -> tuple[np.ndarray, list[str]]:
    """The inverse rates that make the model's relative errors smallest (non-negative least squares)."""
    theta = None
    for _ in range(10):
        rows, times, labels = design_rows(settings, theta)
        a = np.array(rows) / np.array(times)[:, None]
        scale = a.max(axis=0)
        scale[scale == 0] = 1.0
        solution, _ = nnls(a / scale, np.ones(len(times)))
        new = solution / scale
        if theta is not None and np.allclose(new, theta, rtol=1e-9, atol=0):
            break
        theta = new
    return theta, labels


def efficiencies(theta: np.ndarray, fitted_on: str, custom_calls: dict | None = None) -> step_time.Efficiencies:
    """The fitted inverse rates as fractions of the datasheet figures `step_time` scales (and the Pallas kernels a
    lease timed, `timed_custom_calls`)."""
    gemm = 1.0 / theta[COLUMNS.index("gemm")]  # of the measured matmul peak
    rate = lambda name: 1.0 / theta[COLUMNS.index(name)] / DATASHEET[name]
    return step_time.Efficiencies(gemm_16bit=gemm * PEAKS["bf16"] / DATASHEET["gemm_16bit"],
                                  gemm_tf32=gemm * PEAKS["f32"] / DATASHEET["gemm_tf32"],
                                  attention=rate("attention"), memory=rate("memory"),
                                  launch_us=float(theta[COLUMNS.index("launch_us")]), fitted_on=fitted_on,
                                  custom_calls=dict(custom_calls or {}))


def timed_custom_calls(settings: list[Setting]) -> dict[str, float]:
    """The share of the memory bandwidth each Pallas kernel reached where a traced run timed it: its operand and
    result bytes (every run in the step) over the seconds the trace gives the kernel of its name, the mean over the
    runs that traced it. step_time prices a kernel found here at its own rate, and the others at the fitted
    memory-bound efficiency."""
    shares: dict[str, list[float]] = collections.defaultdict(list)
    for setting in settings:
        moved: dict[str, float] = collections.defaultdict(float)
        for kernel in setting.kernels:
            if kernel.kind == "custom_call":
                moved[kernel.callee] += kernel.step_bytes
        for trace in setting.profiled:
            for callee, step_bytes in moved.items():
                if trace.kernels.get(callee):
                    shares[callee].append(step_bytes / trace.kernels[callee] / DATASHEET["memory"])
    return {callee: statistics.mean(values) for callee, values in shares.items()}


def predicted_step_s(setting: Setting, fitted: step_time.Efficiencies) -> step_time.StepTime:
    return step_time.predict(setting.kernels, step_time.KernelRates.of(GPU, fitted))


def constant_mfu_rate(setting: Setting) -> float:
    """The planner's rule before this model: samples/s = MFU x peak / model FLOPs, its measured MFU per precision."""
    precision = "fp32" if setting.precision == "fp32" else "bf16"
    mfu = MEASURED_MFU[(GPU.name, precision)][0]
    return mfu * GPU.peak_tflops(setting.precision) * 1e12 / train_flops(get_model_config("ViT-L-14"))




def with_kernels(settings: list[Setting], cache: pathlib.Path) -> list[Setting]:
    for setting in settings:
        setting.kernels = compile_kernels(setting, cache)
    return settings


def saved_fit(path: pathlib.Path) -> step_time.Efficiencies:
    """The efficiencies a run of this benchmark saved (its JSON's `efficiencies`)."""
    return step_time.Efficiencies(**json.loads(path.read_text())["efficiencies"])


def newest_saved_fit() -> pathlib.Path:
    return max(RESULTS.glob(SAVED_FITS), key=lambda p: p.name)


def modelled_parts(predicted: step_time.StepTime) -> dict[str, float]:
    """A prediction's parts as a trace splits them: products, attention, the memory-bound rest (custom calls in it)."""
    split = predicted.split
    return {"gemm": split["gemm"], "attention": split["attention"],
            "memory": split["elementwise"] + split["optimizer"] + split["custom_calls"]}


def mean_parts(setting: Setting) -> dict[str, float]:
    """Each part's seconds per step, averaged over the setting's traced runs."""
    return {part: statistics.mean(trace.parts.get(part, 0.0) for trace in setting.profiled)
            for part in ("gemm", "attention", "memory")}


def rate(setting: Setting, fitted: step_time.Efficiencies) -> float:
    return setting.batch / predicted_step_s(setting, fitted).seconds


def measured_rate(setting: Setting) -> float:
    return statistics.mean(r for r, _ in setting.measured)


def check(path: pathlib.Path, cache: pathlib.Path, out: pathlib.Path) -> None:
    """The settings `path` measured, predicted by the efficiencies step_time.py holds (see the module's doc)."""
    held_out = with_kernels(measured_settings([path]), cache)
    before = {s.key: s for s in measured_settings([p for p in lease_files() if p.resolve() != path.resolve()])}
    lines = [f"{path.name}, predicted with step_time.H200_FIT ({step_time.H200_FIT.fitted_on})", "",
             f"{'setting':<52}{'measured':>12}{'before':>10}{'predicted':>11}{'error':>8}{'before err':>12}"]
    rows = []
    for setting in held_out:
        predicted = step_time.predict(setting.kernels, step_time.KernelRates.of(GPU))
        predicted_rate = setting.batch / predicted.seconds
        measured = measured_rate(setting)
        earlier = before.get(setting.key)
        earlier_rate = measured_rate(earlier) if earlier else None
        rows.append({"setting": setting.label, "key": list(setting.key), "measured": [r for r, _ in setting.measured],
                     "measured_before": [[r, s] for r, s in earlier.measured] if earlier else [],
                     "predicted": predicted_rate, "error": predicted_rate / measured - 1,
                     "error_before": predicted_rate / earlier_rate - 1 if earlier else None,
                     "split_s": predicted.split})
        lines.append(f"{setting.label:<52}{measured:>12.1f}{earlier_rate or float('nan'):>10.1f}"
                     f"{predicted_rate:>11.1f}{predicted_rate / measured - 1:>8.1%}"
                     + (f"{predicted_rate / earlier_rate - 1:>12.1%}" if earlier else ""))
    worst = max(rows, key=lambda r: abs(r["error"]))
    lines.append(f"largest error {worst['error']:.1%} ({worst['setting']})")
    # The kernel times each run's trace summed (gpu_suite.py --profile: per kernel name, over its traced steps).
    profile_rows = []
    lines += ["", "per part, ms per step: the run's traced kernels | predicted"]
    lines.append(f"{'setting':<52}" + "".join(f"{part:>19}" for part in ("gemm", "attention", "memory")))
    for setting in held_out:
        if not setting.profiled:
            continue
        parts = mean_parts(setting)
        predicted = step_time.predict(setting.kernels, step_time.KernelRates.of(GPU))
        modelled = modelled_parts(predicted)
        profile_rows.append({"setting": setting.label, "traced_s": parts, "predicted_s": modelled,
                             "predicted_launch_s": predicted.split["launch"]})
        lines.append(f"{setting.label:<52}" + "".join(
            f"{parts[part] * 1e3:>10.1f} |{modelled[part] * 1e3:>7.1f}" for part in ("gemm", "attention", "memory")))
    table = "\n".join(lines)
    print(table)
    result = {"gpu": GPU.name, "checked": path.name, "efficiencies": dataclasses.asdict(step_time.H200_FIT),
              "settings": rows, "profiles": profile_rows}
    (out / "step_time_check.json").write_text(json.dumps(result, indent=2) + "\n")


def held_out_check(path: pathlib.Path, cache: pathlib.Path, before: step_time.Efficiencies) -> dict:
    """The settings one results file measured, predicted by a fit on every other file's rows (none of its runs or
    traces), beside the fit before this one."""
    others = with_kernels(measured_settings([p for p in lease_files() if p.resolve() != path.resolve()]), cache)
    held = efficiencies(fit(others)[0], f"all rows but {path.name}'s")
    settings = []
    for setting in with_kernels(measured_settings([path]), cache):
        measured = measured_rate(setting)
        row = {"setting": setting.label, "key": list(setting.key), "measured": measured,
               "before": rate(setting, before), "held_out": rate(setting, held)}
        row.update(error_before=row["before"] / measured - 1, error_held_out=row["held_out"] / measured - 1)
        if setting.profiled:
            row["traced_s"] = mean_parts(setting)
            row["before_s"] = modelled_parts(predicted_step_s(setting, before))
            row["held_out_s"] = modelled_parts(predicted_step_s(setting, held))
        settings.append(row)
    return {"file": path.name, "efficiencies": dataclasses.asdict(held), "settings": settings}


def efficiency_lines(before: step_time.Efficiencies, after: step_time.Efficiencies) -> list[str]:
    lines = [f"{'efficiency (of the datasheet)':<34}{'before':>9}{'after':>9}"]
    for name in ("gemm_16bit", "gemm_tf32", "attention", "memory", "launch_us"):
        lines.append(f"  {name:<32}{getattr(before, name):>9.3f}{getattr(after, name):>9.3f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "out"))
    parser.add_argument("--cache", default=str(pathlib.Path(__file__).parent / "out" / "step_time_hlo"))
    parser.add_argument("--check", help="a GPU suite results file: its settings predicted by step_time.H200_FIT")
    parser.add_argument("--before", help="the fit to set beside this one: a JSON this benchmark wrote (default: "
                                         f"the newest results/{SAVED_FITS})")
    parser.add_argument("--held-out", nargs="*", default=None,
                        help="results files each predicted by a fit without its rows (default: the newest day's)")
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")
    out, cache = pathlib.Path(args.out), pathlib.Path(args.cache)
    out.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    if args.check:
        return check(pathlib.Path(args.check), cache, out)

    before_path = pathlib.Path(args.before) if args.before else newest_saved_fit()
    before = saved_fit(before_path)
    settings = with_kernels(measured_settings(), cache)
    theta, labels = fit(settings)
    traced = [(s, trace.source) for s in settings for trace in s.profiled]
    fitted = efficiencies(theta, f"ViT-L/14 train steps on one H200 ({len(settings)} settings, {len(traced)} "
                                 "traced runs; benchmarks/RESULTS.md section 35)", timed_custom_calls(settings))
    pallas = sorted({k.callee for s in settings for k in s.kernels if k.kind == "custom_call"})

    def pallas_note(name: str) -> str:
        if name in fitted.custom_calls:
            return f"{name} (timed: {fitted.custom_calls[name]:.3f} of the bandwidth)"
        return f"{name} (not timed: at the fitted memory-bound efficiency)"

    lines = [f"matmul peaks measured (8192^3 through XLA): bf16 {PEAKS['bf16'] / 1e12:.1f}, TF32 "
             f"{PEAKS['f32'] / 1e12:.1f} TFLOP/s; FP8 taken as {step_time.FP8_OVER_BF16:g} x bf16",
             f"rows: {len(settings)} settings' mean steps and {len(labels) - len(settings)} parts of {len(traced)} "
             f"traced runs ({', '.join(sorted({source for _, source in traced}))})",
             f"fitted on every row: products at {1 / theta[0]:.3f} x the measured matmul peak; attention "
             f"{fitted.attention * DATASHEET['attention'] / 1e12:.0f} TFLOP/s; memory "
             f"{fitted.memory * DATASHEET['memory'] / 1e12:.2f} TB/s; launch {fitted.launch_us:.2f} us per kernel run",
             "Pallas kernels in the measured steps: " + (", ".join(map(pallas_note, pallas)) or "none"),
             f"before: {before_path.name} ({before.fitted_on})", *efficiency_lines(before, fitted)]

    # Leave-one-out: each setting predicted by a fit without it and without its traces.
    rows = []
    for setting in settings:
        held = efficiencies(fit([s for s in settings if s is not setting])[0], "leave-one-out")
        measured = measured_rate(setting)
        row = {"setting": setting.label, "key": list(setting.key), "measured": [r for r, _ in setting.measured],
               "measured_on": sorted({_day(s) for _, s in setting.measured}),
               "superseded": [r for r, _ in setting.superseded], "measured_mean": measured,
               "predicted_before": rate(setting, before), "predicted_all": rate(setting, fitted),
               "predicted_loo": rate(setting, held), "constant_mfu": constant_mfu_rate(setting),
               "split_s": predicted_step_s(setting, fitted).split}
        for name in ("before", "all", "loo"):
            row[f"error_{name}"] = row[f"predicted_{name}"] / measured - 1
        row["constant_mfu_error"] = row["constant_mfu"] / measured - 1
        rows.append(row)
    for setting in settings:
        if setting.superseded:
            lines.append(f"  {setting.label}: {', '.join(f'{r:.1f} ({s})' for r, s in setting.superseded)} left out, "
                         f"measured again on {_day(setting.measured[0][1])}")
    lines += ["", f"{'setting':<52}{'measured':>18}{'before':>8}{'error':>8}{'after':>8}{'error':>8}{'LOO':>8}"
                  f"{'error':>8}"]
    for r in rows:
        measured = "/".join(f"{m:.0f}" for m in r["measured"])
        lines.append(f"{r['setting']:<52}{measured:>18}" + "".join(
            f"{r[f'predicted_{name}']:>8.1f}{r[f'error_{name}']:>8.1%}" for name in ("before", "all", "loo")))
    for name in ("before", "all", "loo"):
        worst = max(rows, key=lambda r: abs(r[f"error_{name}"]))
        lines.append(f"largest error, {name}: {worst[f'error_{name}']:.1%} ({worst['setting']})")

    levers = []
    lines += ["", f"{'lever (samples/s ratio)':<58}{'measured':>10}{'before':>8}{'LOO':>8}{'error':>8}"]
    for name, fast, slow in LEVERS:
        a, b = (next(r for r in rows if tuple(r["key"][:4]) == key and len(r["key"]) == 4) for key in (fast, slow))
        measured = a["measured_mean"] / b["measured_mean"]
        predicted = a["predicted_loo"] / b["predicted_loo"]
        levers.append({"lever": name, "measured": measured, "before": a["predicted_before"] / b["predicted_before"],
                       "predicted_loo": predicted, "error": predicted / measured - 1})
        lines.append(f"{name:<58}{measured:>10.3f}{levers[-1]['before']:>8.3f}{predicted:>8.3f}"
                     f"{predicted / measured - 1:>8.1%}")

    # Each lease file held out in turn: its settings predicted by a fit on every other file's rows.
    newest_day = max(_day(p.name) for p in lease_files())
    held_out_paths = ([pathlib.Path(p) for p in args.held_out] if args.held_out is not None
                      else [p for p in lease_files() if _day(p.name) == newest_day])
    held_out = [held_out_check(path, cache, before) for path in held_out_paths]
    for check_result in held_out:
        lines += ["", f"held out: {check_result['file']}, predicted by a fit on every other file's rows",
                  f"{'setting':<52}{'measured':>9}{'before':>8}{'error':>8}{'held out':>9}{'error':>8}"
                  "   traced | before | held out (ms: products, attention, memory-bound)"]
        for r in check_result["settings"]:
            parts = ""
            if "traced_s" in r:
                parts = "   " + ", ".join(f"{r['traced_s'][p] * 1e3:.0f} | {r['before_s'][p] * 1e3:.0f} | "
                                          f"{r['held_out_s'][p] * 1e3:.0f}" for p in ("gemm", "attention", "memory"))
            lines.append(f"{r['setting']:<52}{r['measured']:>9.1f}{r['before']:>8.1f}{r['error_before']:>8.1%}"
                         f"{r['held_out']:>9.1f}{r['error_held_out']:>8.1%}{parts}")

    profile_rows = []
    lines += ["", "traced runs, ms per step: GPU kernels | before | after (products, attention, memory-bound)"]
    for setting in settings:
        after_parts = modelled_parts(predicted_step_s(setting, fitted))
        before_parts = modelled_parts(predicted_step_s(setting, before))
        for trace in setting.profiled:
            parts, source = trace.parts, trace.source
            profile_rows.append({"setting": setting.label, "source": source, "traced_s": parts,
                                 "before_s": before_parts, "after_s": after_parts})
            lines.append(f"{setting.label:<52}{source:<32}" + ", ".join(
                f"{parts.get(p, 0) * 1e3:.0f} | {before_parts[p] * 1e3:.0f} | {after_parts[p] * 1e3:.0f}"
                for p in ("gemm", "attention", "memory")))

    unmeasured = []
    lines += ["", "predicted, not measured (one GPU; the fitted efficiencies over each GPU's datasheet):",
              f"{'gpu':<11}{'setting':<38}{'before':>8}{'after':>8}  after's split (ms)"]
    for gpu_name, *key in PREDICT_ONLY:
        setting = Setting(*key)
        setting.kernels = compile_kernels(setting, cache, get_gpu(gpu_name))
        gpu = get_gpu(gpu_name)
        was = step_time.predict(setting.kernels, step_time.KernelRates.of(gpu, before))
        now = step_time.predict(setting.kernels, step_time.KernelRates.of(gpu, fitted))
        unmeasured.append({"gpu": gpu_name, "setting": setting.label, "before": setting.batch / was.seconds,
                           "samples_per_s": setting.batch / now.seconds, "split_s": now.split})
        split = " ".join(f"{part} {seconds * 1e3:.0f}" for part, seconds in now.split.items() if seconds)
        lines.append(f"{gpu_name:<11}{setting.label:<38}{setting.batch / was.seconds:>8.1f}"
                     f"{setting.batch / now.seconds:>8.1f}  {split}")

    table = "\n".join(lines)
    print(table)
    result = {"gpu": GPU.name, "jax_here": jax.__version__, "efficiencies": dataclasses.asdict(fitted),
              "before": {"file": before_path.name, "efficiencies": dataclasses.asdict(before)}, "rows": labels,
              "settings": rows, "levers": levers, "held_out": held_out, "profiles": profile_rows,
              "predicted_only": unmeasured}
    (out / "step_time_model.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "step_time_model.txt").write_text(table + "\n")


if __name__ == "__main__":
    main()
