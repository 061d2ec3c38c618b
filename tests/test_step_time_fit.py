"""The step-time model's fit (benchmarks/step_time_model.py, RESULTS 35) changes only with a GPU's rows: what else a
results file holds changes none of its rows, and the fitted inverse rates are the least-squares solution numpy finds
in float64 on the same rows, written out here. Kernels are made up: no step is compiled."""

import json
import shutil

import benchmark_scripts
import numpy as np
import pytest

from clip_jax.runtime import xla_gpu
from clip_jax.runtime.hlo_kernels import Kernel

RESULTS = benchmark_scripts.BENCHMARKS / "results"


@pytest.fixture(scope="module")
def model():
    return benchmark_scripts.load("step_time_model")


# A kernel of each part as a trace names it (cuBLAS's, cuDNN's, an XLA fusion)
TRACED_NAMES = {"gemm": "nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", "attention": "cudnn_generated_fort_native_sdpa",
                "memory": "loop_add_convert_fusion"}


def made_up_kernels(key: tuple) -> list[Kernel]:
    """A product, a fused attention and a memory-bound kernel whose sizes depend on the setting."""
    size = sum(len(str(part)) for part in key)
    common = dict(dtype="bf16", op_name="jit(step)/jvp(CLIP)/x")
    return [Kernel(name="gemm", kind="gemm", opcode="gemm", flops=1e12 * size, bytes=1e6, runs=24, **common),
            Kernel(name="fmha", kind="attention", opcode="fmha", flops=1e11 * (1 + size % 5), bytes=1e6, runs=24,
                   **common),
            Kernel(name="fusion", kind="elementwise", opcode="fusion:loop", flops=0.0, bytes=1e9 * (3 + size % 7),
                   runs=48, **common)]


def fitted(model, settings) -> np.ndarray:
    for setting in settings:
        setting.kernels = made_up_kernels(setting.key)
    return model.fit(settings)[0]


def test_rows_no_h200_measured_change_nothing_and_a_new_h200_row_changes_the_fit(model, tmp_path):
    files = [tmp_path / path.name for path in model.lease_files()]
    for path in model.lease_files():
        shutil.copy(path, tmp_path / path.name)
    for trace in set(model.RAW_TRACES.values()):
        (tmp_path / trace).symlink_to(RESULTS / trace)
    before = model.measured_settings(files)

    h200 = json.loads((RESULTS / "h200-2026-12-04-heldout.jsonl").read_text().splitlines()[1])  # a traced run
    not_rows = [
        {**h200, "device_kind": "cpu"},  # the suite's CPU smoke test
        {**h200, "device_kind": "NVIDIA H100 80GB HBM3"},  # another GPU
        {**h200, "status": "oom"},
        {**h200, "framework": "open_clip"},
        {**h200, "model": {"embed_dim": 32}},  # --tiny's model
        {**h200, "xla_flags": "--xla_gpu_enable_triton_gemm=false"},  # a flag the deviceless compile cannot set
    ]
    with files[-1].open("a") as f:
        f.writelines(json.dumps(run) + "\n" for run in not_rows)
    after = model.measured_settings(files)
    assert [(s.key, s.measured, s.profiled) for s in after] == [(s.key, s.measured, s.profiled) for s in before]
    assert np.array_equal(fitted(model, after), fitted(model, before))

    # An H200 row the fit did not have changes it: here the same step with the adopted flags, a setting of its own.
    adopted = xla_gpu.xla_flags_text(xla_gpu.ADOPTED_FLAGS)
    with files[-1].open("a") as f:
        f.write(json.dumps({**h200, "xla_flags": adopted, "samples_per_s": 650.0}) + "\n")
    grown = model.measured_settings(files)
    (new,) = [s for s in grown if s.xla_flags]
    assert dict(new.xla_flags) == xla_gpu.ADOPTED_FLAGS and new.measured[0][0] == 650.0
    assert len(new.profiled) == 1  # its trace came with it
    assert not np.allclose(fitted(model, grown), fitted(model, before))


def test_the_fit_is_the_float64_least_squares_solution_of_the_relative_errors(model):
    theta = np.array([1.3, 1 / 120e12, 1 / 3.0e12, 4.0])  # products x the matmul peak, attention, memory, launch us
    settings = []
    for number, (precision, remat, batch) in enumerate([("bf16", "none", 256), ("bf16", "dots_saveable", 256),
                                                        ("bf16", "nothing_saveable", 128), ("bf16", "none", 512),
                                                        ("bf16", "dots_saveable", 384)]):
        setting = model.Setting(precision, remat, "cudnn", batch)
        setting.kernels = made_up_kernels(setting.key)
        gemm, fmha, fusion = setting.kernels
        terms = {"gemm": gemm.flops * gemm.runs / model.PEAKS["bf16"] * theta[0],
                 "attention": fmha.flops * fmha.runs * theta[1], "memory": fusion.bytes * fusion.runs * theta[2]}
        launches = sum(k.runs for k in setting.kernels) * theta[3] * 1e-6
        noise = 1 + 0.03 * np.sin(number + 1)  # measured steps are not exactly the model's
        setting.measured = [(batch / ((sum(terms.values()) + launches) * noise), "h200-2026-12-07-x.jsonl")]
        if number % 2 == 0:  # a traced run: each part's kernel, its time off by a part's own amount
            setting.profiled = [model.Trace({TRACED_NAMES[part]: seconds * (1 + 0.05 * np.cos(number + i))
                                             for i, (part, seconds) in enumerate(terms.items())},
                                            "h200-2026-12-07-x.jsonl")]
        settings.append(setting)

    # The rows written out again: each measured time divided into its coefficients, to come out as 1.
    rows, targets = [], []
    for setting in settings:
        gemm, fmha, fusion = setting.kernels
        coefficients = {"gemm": [gemm.flops * gemm.runs / model.PEAKS["bf16"], 0, 0, 0],
                        "attention": [0, fmha.flops * fmha.runs, 0, 0],
                        "memory": [0, 0, fusion.bytes * fusion.runs, 0]}
        step = np.sum(list(coefficients.values()), axis=0) + [0, 0, 0, 96e-6]
        rows.append(step / (setting.batch / setting.measured[0][0]))
        for trace in setting.profiled:
            rows += [np.array(coefficients[part], dtype=np.float64) / trace.kernels[TRACED_NAMES[part]]
                     for part in ("gemm", "attention", "memory")]
    a = np.array(rows, dtype=np.float64)
    scale = np.abs(a).max(axis=0)
    expected = np.linalg.lstsq(a / scale, np.ones(len(a)), rcond=None)[0] / scale
    assert (expected > 0).all()  # the bound is not active: non-negative least squares finds the same

    solution = model.fit(settings)[0]
    np.testing.assert_allclose(solution, expected, rtol=1e-9)
    assert not np.allclose(solution, theta, rtol=1e-3)  # the noise moved it: a fit, not the made-up rates back
    assert abs(solution[0] / theta[0] - 1) < 0.1 and abs(solution[2] / theta[2] - 1) < 0.1


def test_a_pallas_kernel_a_lease_traced_is_priced_at_the_bandwidth_share_it_reached(model):
    setting = model.Setting("bf16", "none", "cudnn", 256)
    common = dict(kind="custom_call", opcode="__gpu$xla.gpu.triton", dtype="bf16", flops=0.0, op_name="pallas_call")
    setting.kernels = made_up_kernels(setting.key) + [
        Kernel(name="ln.1", bytes=2e9, runs=24, callee="layer_norm_backward", **common),
        Kernel(name="ln.2", bytes=1e9, runs=24, callee="layer_norm_backward", **common),
        Kernel(name="gelu.1", bytes=1e9, runs=24, callee="gelu_backward", **common)]
    setting.profiled = [model.Trace({"layer_norm_backward": 0.030, "loop_add_convert_fusion": 0.1}, "a.jsonl"),
                        model.Trace({"layer_norm_backward": 0.036}, "b.jsonl")]
    timed = model.timed_custom_calls([setting])
    bandwidth = 4.8e12  # the H200's datasheet
    assert timed == {"layer_norm_backward": pytest.approx((72e9 / 0.030 + 72e9 / 0.036) / 2 / bandwidth)}
    fit = model.efficiencies(np.array([1.0, 1e-14, 1e-12, 4.0]), "made up", timed)
    assert fit.custom_calls == timed  # gelu_backward, never traced, stays at the fitted memory-bound efficiency
