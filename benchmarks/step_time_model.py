"""The step-time model (clip_jax.plan.step_time) fitted on the H200 measurements, and checked leave-one-out.

    python benchmarks/step_time_model.py [--out DIR] [--cache DIR]
    python benchmarks/step_time_model.py --check results/h200-DAY-NAME.jsonl   # a later lease, held out


Reads every ViT-L/14 clip_jax run the GPU suite recorded on an H200 (benchmarks/results/h200-*.jsonl) and the two
kernel profiles of 2026-12-04 (benchmarks/results/h200-2026-12-04-*.xplane.pb.gz: the device's kernels over two
steps). Compiles today's step at each measured setting for one H200 without a GPU (deviceless XLA:GPU, as the
planner does; the HLO is cached in --cache) and reads its kernels (clip_jax.runtime.hlo_kernels).

The matrix products run at the matmul peak the suite measured for their precision (an 8192^3 product through XLA:
bf16 and TF32; FP8 at twice bf16's, not measured) times one fitted factor for the step's shapes. That factor and
the other three constants (fused-attention efficiency, memory efficiency, launch cost) are fitted by non-negative
least squares on relative errors: one row per measured
setting (its mean step time), one per part of each profiled step (matrix products, attention, memory-bound kernels:
the trace's kernel times). Each kernel counts its compute or its memory term, whichever the current constants make
larger; the fit repeats until no kernel changes side. Then each setting is predicted by a fit without it (and
without its profile, if it has one): leave-one-out. Beside it, the constant-MFU rule the planner had (its bf16 and
fp32 MFU measured on 2026-11-30). Prints the tables and writes DIR/step_time_model.json.

What differs from the device: the measurements ran jax 0.11.2 with autotuning and Triton GEMMs; the deviceless
compile here runs the installed jax without either (so the Triton on/off pair measured on 2026-11-30 is out of
reach and left out), and 2026-11-30's code was a few refactors older (RESULTS 10: < 1% in speed).

--check FILE fits nothing: it predicts the settings FILE measured with the efficiencies clip_jax.plan.step_time
holds (`H200_FIT`, fitted before FILE existed), beside what FILE and the other files measured at each setting, and
each part's time (products, attention, memory-bound) in the kernels FILE's runs traced (gpu_suite.py --profile);
it writes DIR/step_time_check.json.
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

from clip_jax import plan  # noqa: E402
from clip_jax.plan import step_time  # noqa: E402
from clip_jax.plan.cost import MEASURED_MFU  # noqa: E402
from clip_jax.models import get_model_config  # noqa: E402
from clip_jax.models.flops import train_flops  # noqa: E402
from clip_jax.runtime import hlo_kernels  # noqa: E402
from clip_jax.runtime.hardware import get_gpu  # noqa: E402
from clip_jax.runtime.mesh import create_mesh  # noqa: E402
from clip_jax.training.step_factory import StepSpec  # noqa: E402

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
PROFILES = {  # the kernel profiles of 2026-12-04, by setting
    ("bf16", "dots_saveable", "cudnn", 256): "h200-2026-12-04-bf16-dots_saveable-cudnn-256.xplane.pb.gz",
    ("fp32", "dots_saveable", "xla", 256): "h200-2026-12-04-fp32-dots_saveable-xla-256.xplane.pb.gz",
    ("bf16", "nothing_saveable", "cudnn", 512): "h200-2026-12-04-bf16-nothing_saveable-cudnn-512.xplane.pb.gz",
}
PROFILED_STEPS = 2  # benchmarks/gpu_suite.py traced two steps
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


@dataclasses.dataclass
class Setting:
    precision: str
    remat: str
    attention: str
    batch: int
    numerics: tuple = ()  # ((name, value), ...) of StepSpec's numerics options
    measured: list = dataclasses.field(default_factory=list)  # (samples/s, source file)
    superseded: list = dataclasses.field(default_factory=list)  # earlier days' runs of a setting measured again
    kernels: list | None = None

    @property
    def key(self) -> tuple:
        return (self.precision, self.remat, self.attention, self.batch) + tuple(v for _, v in self.numerics)

    @property
    def label(self) -> str:
        extra = "".join(f" {name}={value}" for name, value in self.numerics)
        return f"{self.precision} {self.remat} {self.attention} {self.batch}{extra}"

    @property
    def step_s(self) -> float:
        return self.batch / statistics.mean(rate for rate, _ in self.measured)


def measured_settings(paths=None) -> list[Setting]:
    """Every finished ViT-L/14 clip_jax run on an H200 (in `paths`, else in every results file), grouped by setting
    (Triton-off runs left out). A setting measured on several days keeps its latest day's runs: the step changed in
    between (2026-12-02's lean LayerNorm and GELU halved the memory of the step without remat), and the model
    predicts today's."""
    settings: dict[tuple, Setting] = {}
    for path in sorted(RESULTS.glob("h200-*.jsonl")) if paths is None else paths:
        for line in path.read_text().splitlines():
            run = json.loads(line)
            if (run.get("framework") != "clip_jax" or run.get("status") != "ok" or run.get("model") != "ViT-L-14"
                    or "H200" not in run.get("device_kind", "") or run.get("xla_flags")):
                continue
            setting = Setting(run["precision"], run["remat"], run["attention"], run["batch"], _numerics(run))
            settings.setdefault(setting.key, setting).measured.append((run["samples_per_s"], path.name))
    for setting in settings.values():
        latest = max(_day(source) for _, source in setting.measured)
        setting.superseded = [(rate, source) for rate, source in setting.measured if _day(source) != latest]
        setting.measured = [(rate, source) for rate, source in setting.measured if _day(source) == latest]
    return list(settings.values())


def _numerics(run: dict) -> tuple:
    return tuple((name, run[name]) for name in NUMERICS if run.get(name))


def _key(run: dict) -> tuple:
    return (run["precision"], run["remat"], run["attention"], run["batch"]) + tuple(v for _, v in _numerics(run))


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
        compiled = plan.compile_train_step(spec, create_mesh(xla_gpu.devices(gpu, 1, 1)), setting.batch)
        with gzip.open(path, "wt") as f:
            f.write(compiled.as_text())
        print(f"compiled {setting.label} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return hlo_kernels.kernels(gzip.open(path, "rt").read())


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


def profile_parts(path: pathlib.Path) -> dict[str, float]:
    """Seconds per step the profiled kernels of each part took on the GPU."""
    with tempfile.NamedTemporaryFile(suffix=".xplane.pb") as raw:
        raw.write(gzip.open(path).read())
        raw.flush()
        data = jax.profiler.ProfileData.from_file(raw.name)
    parts: dict[str, float] = collections.defaultdict(float)
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            for line in plane.lines:
                for event in line.events:
                    parts[trace_part(event.name)] += event.duration_ns * 1e-9 / PROFILED_STEPS
    return dict(parts)


def matmul_peaks() -> dict[str, float]:
    """FLOP/s of the 8192^3 products the suite measured on the H200, mean per precision: {"bf16": ..., "f32": ...}."""
    runs = [json.loads(line) for path in sorted(RESULTS.glob("h200-*.jsonl")) for line in path.read_text().splitlines()]
    peaks = {}
    for precision, dtype in (("bf16", "bf16"), ("fp32", "f32")):
        peaks[dtype] = 1e12 * statistics.mean(r["tflops"] for r in runs if r.get("framework") == "matmul"
                                              and r.get("status") == "ok" and r["precision"] == precision)
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


def design_rows(settings: list[Setting], profiles: dict[tuple, dict], theta) -> tuple[list, list, list]:
    """(coefficients, measured seconds, what each row is) for the fit."""
    rows, times, labels = [], [], []
    for setting in settings:
        row = sum(kernel_terms(k, compute_bound(k, theta)) for k in setting.kernels)
        row[COLUMNS.index("launch_us")] = sum(k.runs for k in setting.kernels) * 1e-6  # launch_us: microseconds
        rows.append(row)
        times.append(setting.step_s)
        labels.append(f"step {setting.label}")
        for part, seconds in profiles.get(setting.key, {}).items():
            members = [k for k in setting.kernels if _profile_part(k) == part]
            rows.append(sum((kernel_terms(k, compute_bound(k, theta)) for k in members), np.zeros(len(COLUMNS))))
            times.append(seconds)
            labels.append(f"profile {setting.label}: {part}")
    return rows, times, labels


def _profile_part(kernel) -> str:
    return kernel.kind if kernel.kind in ("gemm", "attention") else "memory"


def fit(settings: list[Setting], profiles: dict[tuple, dict]) -> tuple[np.ndarray, list[str]]:
    """The inverse rates that make the model's relative errors smallest (non-negative least squares)."""
    theta = None
    for _ in range(10):
        rows, times, labels = design_rows(settings, profiles, theta)
        a = np.array(rows) / np.array(times)[:, None]
        scale = a.max(axis=0)
        scale[scale == 0] = 1.0
        solution, _ = nnls(a / scale, np.ones(len(times)))
        new = solution / scale
        if theta is not None and np.allclose(new, theta, rtol=1e-9, atol=0):
            break
        theta = new
    return theta, labels


def efficiencies(theta: np.ndarray, fitted_on: str) -> step_time.Efficiencies:
    """The fitted inverse rates as fractions of the datasheet figures `step_time` scales."""
    gemm = 1.0 / theta[COLUMNS.index("gemm")]  # of the measured matmul peak
    rate = lambda name: 1.0 / theta[COLUMNS.index(name)] / DATASHEET[name]
    return step_time.Efficiencies(gemm_16bit=gemm * PEAKS["bf16"] / DATASHEET["gemm_16bit"],
                                  gemm_tf32=gemm * PEAKS["f32"] / DATASHEET["gemm_tf32"],
                                  attention=rate("attention"), memory=rate("memory"),
                                  launch_us=float(theta[COLUMNS.index("launch_us")]), fitted_on=fitted_on)


def predicted_step_s(setting: Setting, fitted: step_time.Efficiencies) -> step_time.StepTime:
    return step_time.predict(setting.kernels, step_time.KernelRates.of(GPU, fitted))


def constant_mfu_rate(setting: Setting) -> float:
    """The planner's rule before this model: samples/s = MFU x peak / model FLOPs, its measured MFU per precision."""
    precision = "fp32" if setting.precision == "fp32" else "bf16"
    mfu = MEASURED_MFU[(GPU.name, precision)][0]
    return mfu * GPU.peak_tflops(setting.precision) * 1e12 / train_flops(get_model_config("ViT-L-14"))


def check(path: pathlib.Path, cache: pathlib.Path, out: pathlib.Path) -> None:
    """The settings `path` measured, predicted by the efficiencies step_time.py holds (see the module's doc)."""
    held_out = measured_settings([path])
    before = {s.key: s for s in measured_settings([p for p in sorted(RESULTS.glob("h200-*.jsonl"))
                                                   if p.resolve() != path.resolve()])}
    lines = [f"{path.name}, predicted with step_time.H200_FIT ({step_time.H200_FIT.fitted_on})", "",
             f"{'setting':<52}{'measured':>12}{'before':>10}{'predicted':>11}{'error':>8}{'before err':>12}"]
    rows = []
    for setting in held_out:
        setting.kernels = compile_kernels(setting, cache)
        predicted = step_time.predict(setting.kernels, step_time.KernelRates.of(GPU))
        rate = setting.batch / predicted.seconds
        measured = statistics.mean(r for r, _ in setting.measured)
        earlier = before.get(setting.key)
        earlier_rate = statistics.mean(r for r, _ in earlier.measured) if earlier else None
        rows.append({"setting": setting.label, "key": list(setting.key), "measured": [r for r, _ in setting.measured],
                     "measured_before": [[r, s] for r, s in earlier.measured] if earlier else [],
                     "predicted": rate, "error": rate / measured - 1,
                     "error_before": rate / earlier_rate - 1 if earlier else None, "split_s": predicted.split})
        lines.append(f"{setting.label:<52}{measured:>12.1f}{earlier_rate or float('nan'):>10.1f}{rate:>11.1f}"
                     f"{rate / measured - 1:>8.1%}" + (f"{rate / earlier_rate - 1:>12.1%}" if earlier else ""))
    worst = max(rows, key=lambda r: abs(r["error"]))
    lines.append(f"largest error {worst['error']:.1%} ({worst['setting']})")
    # The kernel times each run's trace summed (gpu_suite.py --profile: per kernel name, over its traced steps).
    profile_rows = []
    lines += ["", "per part, ms per step: the run's traced kernels | predicted"]
    lines.append(f"{'setting':<52}" + "".join(f"{part:>19}" for part in ("gemm", "attention", "memory")))
    runs = [json.loads(line) for line in path.read_text().splitlines()]
    for setting in held_out:
        traced = [r["kernels"]["ops"] for r in runs if r.get("framework") == "clip_jax" and r.get("status") == "ok"
                  and "ops" in (r.get("kernels") or {}) and _key(r) == setting.key]
        if not traced:
            continue
        parts = collections.defaultdict(float)
        for ops in traced:
            for name, op in ops.items():
                parts[trace_part(name)] += op["us"] * 1e-6 / len(traced)
        predicted = step_time.predict(setting.kernels, step_time.KernelRates.of(GPU))
        modelled = {"gemm": predicted.split["gemm"], "attention": predicted.split["attention"],
                    "memory": predicted.split["elementwise"] + predicted.split["optimizer"]}
        profile_rows.append({"setting": setting.label, "traced_s": dict(parts), "predicted_s": modelled,
                             "predicted_launch_s": predicted.split["launch"]})
        lines.append(f"{setting.label:<52}" + "".join(
            f"{parts[part] * 1e3:>10.1f} |{modelled[part] * 1e3:>7.1f}" for part in ("gemm", "attention", "memory")))
    table = "\n".join(lines)
    print(table)
    result = {"gpu": GPU.name, "checked": path.name, "efficiencies": dataclasses.asdict(step_time.H200_FIT),
              "settings": rows, "profiles": profile_rows}
    (out / "step_time_check.json").write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "out"))
    parser.add_argument("--cache", default=str(pathlib.Path(__file__).parent / "out" / "step_time_hlo"))
    parser.add_argument("--check", help="a GPU suite results file: its settings predicted by step_time.H200_FIT")
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")
    out, cache = pathlib.Path(args.out), pathlib.Path(args.cache)
    out.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    if args.check:
        return check(pathlib.Path(args.check), cache, out)

    settings = measured_settings()
    for setting in settings:
        setting.kernels = compile_kernels(setting, cache)
    profiles = {key: profile_parts(RESULTS / name) for key, name in PROFILES.items()}
    by_key = {s.key: s for s in settings}

    theta, labels = fit(settings, profiles)
    fitted = efficiencies(theta, f"{len(settings)} settings, {len(profiles)} profiles")
    lines = [f"matmul peaks measured (8192^3 through XLA): bf16 {PEAKS['bf16'] / 1e12:.1f}, TF32 "
             f"{PEAKS['f32'] / 1e12:.1f} TFLOP/s; FP8 taken as {step_time.FP8_OVER_BF16:g} x bf16",
             "fitted on every row (" + ", ".join(labels) + "):",
             f"  products at {1 / theta[0]:.3f} x the measured matmul peak",
             f"  attention {fitted.attention:.3f} of the bf16 peak ({fitted.attention * DATASHEET['attention'] / 1e12:.0f}"
             " TFLOP/s)",
             f"  memory    {fitted.memory:.3f} of {DATASHEET['memory'] / 1e12:g} TB/s "
             f"({fitted.memory * DATASHEET['memory'] / 1e12:.2f} TB/s)",
             f"  launch    {fitted.launch_us:.2f} us per kernel run",
             f"  as step_time.Efficiencies: gemm_16bit={fitted.gemm_16bit:.3f}, gemm_tf32={fitted.gemm_tf32:.3f}, "
             f"attention={fitted.attention:.3f}, memory={fitted.memory:.3f}, launch_us={fitted.launch_us:.2f}"]

    # Leave-one-out: each setting predicted by a fit without it and without its profile.
    rows = []
    for setting in settings:
        others = [s for s in settings if s is not setting]
        held_theta, _ = fit(others, {k: v for k, v in profiles.items() if k != setting.key})
        held = efficiencies(held_theta, "leave-one-out")
        predicted = setting.batch / predicted_step_s(setting, held).seconds
        in_sample = setting.batch / predicted_step_s(setting, fitted).seconds
        measured = statistics.mean(rate for rate, _ in setting.measured)
        mfu_rate = constant_mfu_rate(setting)
        rows.append({"setting": setting.label, "key": list(setting.key), "measured": [r for r, _ in setting.measured],
                     "measured_on": sorted({_day(s) for _, s in setting.measured}),
                     "superseded": [r for r, _ in setting.superseded],
                     "measured_mean": measured, "predicted_loo": predicted, "predicted_all": in_sample,
                     "error_loo": predicted / measured - 1, "constant_mfu": mfu_rate,
                     "constant_mfu_error": mfu_rate / measured - 1,
                     "split_s": predicted_step_s(setting, fitted).split})
    for setting in settings:
        if setting.superseded:
            lines.append(f"  {setting.label}: {', '.join(f'{r:.1f} ({s})' for r, s in setting.superseded)} left out, "
                         f"measured again on {_day(setting.measured[0][1])}")
    lines += ["", f"{'setting':<52}{'measured':>18}{'LOO':>8}{'error':>8}{'all':>8}{'const MFU':>11}{'error':>8}"]
    for r in rows:
        measured = "/".join(f"{m:.0f}" for m in r["measured"])
        lines.append(f"{r['setting']:<52}{measured:>18}{r['predicted_loo']:>8.1f}{r['error_loo']:>8.1%}"
                     f"{r['predicted_all']:>8.1f}{r['constant_mfu']:>11.1f}{r['constant_mfu_error']:>8.1%}")
    worst = max(rows, key=lambda r: abs(r["error_loo"]))
    worst_mfu = max(rows, key=lambda r: abs(r["constant_mfu_error"]))
    lines.append(f"largest leave-one-out error {worst['error_loo']:.1%} ({worst['setting']}); constant MFU's "
                 f"{worst_mfu['constant_mfu_error']:.1%} ({worst_mfu['setting']})")

    levers = []
    lines += ["", f"{'lever (samples/s ratio)':<58}{'measured':>10}{'LOO':>8}{'error':>8}{'const MFU':>11}"]
    for name, fast, slow in LEVERS:
        a, b = (next(r for r in rows if tuple(r["key"][:4]) == key and len(r["key"]) == 4) for key in (fast, slow))
        measured = a["measured_mean"] / b["measured_mean"]
        predicted = a["predicted_loo"] / b["predicted_loo"]
        mfu = a["constant_mfu"] / b["constant_mfu"]
        levers.append({"lever": name, "measured": measured, "predicted_loo": predicted,
                       "error": predicted / measured - 1, "constant_mfu": mfu})
        lines.append(f"{name:<58}{measured:>10.3f}{predicted:>8.3f}{predicted / measured - 1:>8.1%}{mfu:>11.3f}")

    profile_rows = []
    for key, parts in profiles.items():
        predicted = predicted_step_s(by_key[key], fitted)
        modelled = {"gemm": predicted.split["gemm"], "attention": predicted.split["attention"],
                    "memory": predicted.split["elementwise"] + predicted.split["optimizer"]}
        profile_rows.append({"setting": by_key[key].label, "profiled_s": parts, "predicted_s": modelled,
                             "predicted_launch_s": predicted.split["launch"]})
        lines.append("")
        lines.append(f"profile {by_key[key].label}, ms per step (GPU kernels | model fitted on all rows):")
        for part in ("gemm", "attention", "memory"):
            lines.append(f"  {part:<10}{parts.get(part, 0) * 1e3:>9.1f}{modelled[part] * 1e3:>9.1f}")
        lines.append(f"  {'launch':<10}{'-':>9}{predicted.split['launch'] * 1e3:>9.1f}")

    unmeasured = []
    lines += ["", "predicted, not measured (one GPU; the fitted efficiencies over each GPU's datasheet):",
              f"{'gpu':<11}{'setting':<38}{'samples/s':>10}{'step ms':>9}  split (ms)"]
    for gpu_name, *key in PREDICT_ONLY:
        setting = Setting(*key)
        setting.kernels = compile_kernels(setting, cache, get_gpu(gpu_name))
        predicted = step_time.predict(setting.kernels, step_time.KernelRates.of(get_gpu(gpu_name), fitted))
        unmeasured.append({"gpu": gpu_name, "setting": setting.label, "samples_per_s": setting.batch / predicted.seconds,
                           "split_s": predicted.split})
        split = " ".join(f"{part} {seconds * 1e3:.0f}" for part, seconds in predicted.split.items() if seconds)
        lines.append(f"{gpu_name:<11}{setting.label:<38}{setting.batch / predicted.seconds:>10.1f}"
                     f"{predicted.seconds * 1e3:>9.1f}  {split}")

    table = "\n".join(lines)
    print(table)
    result = {"gpu": GPU.name, "jax_here": jax.__version__, "efficiencies": dataclasses.asdict(fitted),
              "settings": rows, "levers": levers, "profiles": profile_rows, "predicted_only": unmeasured}
    (out / "step_time_model.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "step_time_model.txt").write_text(table + "\n")


if __name__ == "__main__":
    main()
