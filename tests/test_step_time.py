"""The step's predicted time: the kernels of a compiled XLA:GPU program are read with their FLOPs, bytes and loop
trips as counted by hand here, each costs its roofline at the GPU's rates, an instruction without a rule is named
and costed as memory-bound, and the planner's `--compiler gpu` plan runs at the predicted speed. The fit of the
rates against H200 measurements is benchmarks/step_time_model.py's (benchmarks/RESULTS.md section 29)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from clip_jax import plan as planner
from clip_jax.plan import step_time
from clip_jax.run_config import default_config
from clip_jax.runtime import hlo_kernels, xla_gpu
from clip_jax.runtime.hardware import get_gpu

pytestmark = pytest.mark.gpu_compile
TINY = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 1000, "width": 64, "heads": 4, "layers": 3},
}
RATES = step_time.KernelRates(gemm_flops={"bf16": 500e12, "f16": 500e12, "f8": 1000e12, "f32": 200e12},
                              attention_flops=100e12, memory_bytes=2e12, launch_s=3e-6, link_bytes=400e9,
                              inter_node_bytes=25e9)


def compile_for_h200(function, *shapes):
    """`function` compiled for one H200 without a GPU, from abstract arguments (shape, dtype)."""
    sharding = SingleDeviceSharding(xla_gpu.devices(get_gpu("h200"), 1, 1)[0])
    arguments = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
    return xla_gpu.compile_lowered(jax.jit(function).lower(*arguments)).as_text()


def test_a_product_and_an_elementwise_fusion_cost_their_hand_counted_flops_and_bytes():
    m, k, n = 256, 512, 1024
    text = compile_for_h200(lambda a, b, c: jnp.tanh(a @ b) + c,
                            ((m, k), jnp.bfloat16), ((k, n), jnp.bfloat16), ((m, n), jnp.bfloat16))
    kernels = hlo_kernels.kernels(text)
    (gemm,) = [kernel for kernel in kernels if kernel.kind == "gemm"]
    (fusion,) = [kernel for kernel in kernels if kernel.kind == "elementwise"]
    assert len(kernels) == 2
    assert (gemm.flops, gemm.dtype, gemm.runs) == (2 * m * k * n, "bf16", 1)
    assert gemm.bytes == 2 * (m * k + k * n + m * n)  # A and B read, C written: cuBLAS's workspace is not data
    assert fusion.bytes == 2 * 3 * m * n  # the product and c read, the sum written

    predicted = step_time.predict(kernels, RATES)
    gemm_s = max(2 * m * k * n / 500e12, 2 * (m * k + k * n + m * n) / 2e12)
    fusion_s = 2 * 3 * m * n / 2e12
    assert predicted.split["gemm"] == pytest.approx(gemm_s)
    assert predicted.split["elementwise"] == pytest.approx(fusion_s)
    assert predicted.split["launch"] == pytest.approx(2 * 3e-6)
    assert predicted.seconds == pytest.approx(gemm_s + fusion_s + 2 * 3e-6)
    assert sum(predicted.split.values()) == pytest.approx(predicted.seconds)


def test_a_scanned_loop_runs_its_kernels_once_per_trip_and_reads_one_layer_of_the_stacked_weights():
    layers, width, batch = 4, 512, 256

    def scanned(weights, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, weights)[0]

    kernels = hlo_kernels.kernels(compile_for_h200(scanned, ((layers, width, width), jnp.bfloat16),
                                                   ((batch, width), jnp.bfloat16)))
    (gemm,) = [kernel for kernel in kernels if kernel.kind == "gemm"]
    assert gemm.runs == layers and gemm.flops == 2 * batch * width * width
    one_layer = 2 * width * width
    # The layer's weights are sliced out of the stack each trip: what that reads and writes is one layer.
    (slicing,) = [kernel for kernel in kernels if "dynamic_slice" in kernel.op_name]
    assert slicing.runs == layers and 2 * one_layer <= slicing.bytes < 2 * one_layer + 64  # the stack: 5 layers


UNKNOWN_HLO = """HloModule m, is_scheduled=true

%fused_add (p0: f32[1024], p1: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = f32[1024]{0} parameter(1)
  ROOT %add.1 = f32[1024]{0} add(%p0, %p1)
}

ENTRY %main (x: f32[1024], y: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %y = f32[1024]{0} parameter(1)
  %magic.1 = f32[1024]{0} custom-call(%x), custom_call_target="__vendor$magic", metadata={op_name="jit(step)/jvp(CLIP)/CLIP.encode_text/magic"}
  ROOT %loop_add_fusion = f32[1024]{0} fusion(%magic.1, %y), kind=kLoop, calls=%fused_add
}
"""


def test_a_kernel_without_a_cost_rule_is_named_and_costed_as_memory_bound():
    kernels = hlo_kernels.kernels(UNKNOWN_HLO)
    magic = next(kernel for kernel in kernels if kernel.name == "magic.1")
    assert not magic.known and magic.kind == "elementwise" and magic.opcode == "__vendor$magic"
    assert magic.bytes == 2 * 4096
    predicted = step_time.predict(kernels, RATES)
    (unknown,) = predicted.unknown
    assert unknown.kernel.name == "magic.1" and unknown.seconds == pytest.approx(2 * 4096 / 2e12)
    assert step_time.model_operation(unknown.kernel.op_name) == "text/magic"


def test_a_pallas_kernel_is_a_custom_call_of_its_own_priced_at_the_memory_bound_rate_until_a_gpu_times_it():
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pallas_triton

    from clip_jax.plan.planner import predicted_step
    from clip_jax.plan.report import profile_lines

    layers, rows, width = 3, 64, 128

    def scaled_add(x_ref, y_ref, out_ref):
        out_ref[...] = x_ref[...] + 2 * y_ref[...]

    def scanned(x, ys):  # the Pallas kernel once per layer, as a model's block would call it
        call = pl.pallas_call(scaled_add, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              compiler_params=pallas_triton.CompilerParams())
        return jax.lax.scan(lambda h, y: (call(h, y), None), x, ys)[0]

    text = compile_for_h200(scanned, ((rows, width), jnp.float32), ((layers, rows, width), jnp.float32))
    (pallas,) = [kernel for kernel in hlo_kernels.kernels(text) if kernel.kind == "custom_call"]
    assert (pallas.callee, pallas.opcode, pallas.runs) == ("scaled_add", "__gpu$xla.gpu.triton", layers)
    assert pallas.known and pallas.bytes == 3 * rows * width * 4  # two operands read, one result written, float32

    untimed = step_time.predict([pallas], RATES)
    assert untimed.split["custom_calls"] == pytest.approx(layers * pallas.bytes / RATES.memory_bytes)
    assert [timed.kernel for timed in untimed.unmeasured] == [pallas] and not untimed.unknown
    timed = step_time.predict([pallas], dataclasses.replace(RATES, custom_call_bytes={"scaled_add": 0.5e12}))
    assert timed.split["custom_calls"] == pytest.approx(layers * pallas.bytes / 0.5e12) and not timed.unmeasured

    # The H200's rates: the fitted memory-bound efficiency until a lease measured the kernel's own.
    h200 = get_gpu("h200")
    fitted = step_time.predict([pallas], step_time.KernelRates.of(h200))
    assert fitted.split["custom_calls"] == pytest.approx(
        layers * pallas.bytes / (h200.target.memory_bandwidth * step_time.H200_FIT.memory))
    measured = dataclasses.replace(step_time.H200_FIT, custom_calls={"scaled_add": 0.25})
    assert step_time.KernelRates.of(h200, measured).custom_call_bytes == {
        "scaled_add": pytest.approx(0.25 * h200.target.memory_bandwidth)}

    (line,) = [line for line in profile_lines(predicted_step(untimed, h200)) if "no GPU has timed" in line]
    share = untimed.split["custom_calls"] / untimed.seconds  # the rest is the launches
    assert line.startswith("  1 Pallas kernels no GPU has timed") and line.endswith(f"scaled_add (pallas_call): "
                                                                                    f"{share:.1%} of the step")
    assert not any("no GPU has timed" in line for line in profile_lines(predicted_step(timed, h200)))


def test_the_h200_fit_scales_with_a_gpus_datasheet():
    h200, a100 = step_time.KernelRates.of(get_gpu("h200")), step_time.KernelRates.of(get_gpu("a100-40gb"))
    fit = step_time.H200_FIT
    assert h200.gemm_flops["bf16"] == pytest.approx(989e12 * fit.gemm_16bit)
    assert h200.gemm_flops["f8"] == pytest.approx(2 * h200.gemm_flops["bf16"])
    assert a100.gemm_flops["f32"] == pytest.approx(156e12 * fit.gemm_tf32)
    assert a100.memory_bytes / h200.memory_bytes == pytest.approx(1.555 / 4.8)


def test_the_planner_runs_the_plan_at_the_speed_predicted_from_the_compiled_program(tmp_path):
    model_file = tmp_path / "tiny.json"
    model_file.write_text(__import__("json").dumps(TINY))
    config = default_config()
    config.update(model=str(model_file), batch_size=8, train_num_samples=4096, epochs=2, workers=1,
                  grad_checkpointing=False)
    result = planner.plan(config, "a100-40gb", 2, compiler="gpu", search_batch=False, xla_flops=False, price=2.0)

    speed, step = result.throughput, result.predicted_step
    assert set(speed.predicted_step_split) == set(step_time.CLASSES)
    assert sum(speed.predicted_step_split.values()) == pytest.approx(step.seconds)
    assert speed.predicted_samples_per_s == pytest.approx(8 / step.seconds)
    assert speed.samples_per_s_per_gpu == speed.predicted_samples_per_s  # the run's length is at the prediction
    assert result.run.days == pytest.approx(result.run.samples_in_steps / (2 * speed.predicted_samples_per_s) / 86400)
    assert speed.mfu_rule_samples_per_s_per_gpu != speed.predicted_samples_per_s
    assert speed.predicted_step_split["collectives"] > 0  # two GPUs: the gradients are all-reduced
    assert "not measured on one" in step.calibration  # an A100 with the H200's efficiencies
    assert len(step.slowest) == 15 and all(row.operation for row in step.slowest)
    assert [row.seconds for row in step.slowest] == sorted((row.seconds for row in step.slowest), reverse=True)
    text = planner.format_plan(result)
    assert "predicted from the compiled XLA:GPU program" in text and "deviceless profile" in text
    ratio = speed.mfu_rule_samples_per_s_per_gpu / speed.predicted_samples_per_s  # which of the two speeds to trust
    assert f"  trust the prediction (the run below takes it): it times this step's own kernels, an MFU of " \
           f"{speed.mfu / ratio:.1%}; the rule assumes {speed.mfu:.1%} for every model, {ratio:.1f}x too fast" in text
    # The JSON holds the prediction and reads back into the same plan.
    again = planner.Plan.from_dict(__import__("json").loads(planner.plan_json(result)))
    assert again == result

    given = planner.plan(config, "a100-40gb", 2, compiler="gpu", search_batch=False, xla_flops=False, mfu=0.3)
    assert given.throughput.samples_per_s_per_gpu == given.throughput.mfu_rule_samples_per_s_per_gpu
    assert dataclasses.asdict(given.throughput)["predicted_samples_per_s"] is not None


def test_a_step_whose_cudnn_attention_xla_gpu_refuses_is_planned_with_xlas_attention_and_says_so(tmp_path):
    model_file = tmp_path / "wide_heads.json"  # one 512-wide head: cuDNN's fused attention takes at most 128
    model_file.write_text(__import__("json").dumps(
        {**TINY, "vision_cfg": {**TINY["vision_cfg"], "width": 512, "head_width": 512}}))
    config = default_config()
    config.update(model=str(model_file), batch_size=4, precision="bf16", grad_checkpointing=False)
    result = planner.plan(config, "h200", 1, compiler="gpu", search_batch=False, xla_flops=False)
    (note,) = result.notes
    assert "cannot compile this step with cuDNN's fused attention for the h200" in note
    assert "head dim must be <= 128" in note and "set attention_impl='xla'" in note
    assert result.setup.attention == "xla" and result.throughput.predicted_samples_per_s > 0
    assert planner.format_plan(result).splitlines()[1] == f"  note: {note}"


def test_the_h200_efficiencies_in_the_code_are_those_the_benchmark_fitted():
    import json
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                        "cpu-2026-12-04-step-time-model.json")
    with open(path) as f:
        fitted = json.load(f)["efficiencies"]
    for name in ("gemm_16bit", "gemm_tf32", "attention", "memory"):
        assert getattr(step_time.H200_FIT, name) == pytest.approx(fitted[name], abs=5e-4), name
    assert step_time.H200_FIT.launch_us == pytest.approx(fitted["launch_us"], abs=5e-3)
