"""XLA:GPU without a GPU: the planner's GPU path compiles the very step a direct deviceless compile does, cuDNN's
fused attention compiles for every registered model, FSDP's gradients are reduce-scattered, the collectives are
counted per step, and bad input gets one line and exit status 2. jaxlib's CUDA plugin is part of the test set-up
(`.[gpu]`); these tests fail, not skip, without it."""

import dataclasses
import math
import os
import re
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from clip_jax import plan as planner
from clip_jax.models import create_model, get_model_config, init_params, is_resnet, layers, list_models, param_shapes
from clip_jax.run_config import default_config
from clip_jax.runtime import xla_gpu
from clip_jax.runtime.hardware import GPUS, get_gpu
from clip_jax.runtime.mesh import create_mesh, state_shardings
from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step, mesh_for
from clip_jax.training.train_step import init_train_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 1000, "width": 64, "heads": 4, "layers": 3},
}


def gpu_devices(gpu: str, nodes: int, per_node: int):
    return xla_gpu.devices(get_gpu(gpu), nodes, per_node)


@pytest.mark.gpu_compile
def test_the_cuda_plugin_is_installed_and_loads_without_a_gpu():
    assert xla_gpu.cuda_plugin_installed()
    devices = gpu_devices("h100", 2, 4)
    assert len(devices) == 8 and {d.platform for d in devices} == {"gpu"}
    assert "H100" in devices[0].device_kind


@pytest.mark.gpu_compile
@pytest.mark.parametrize("gpu", [name for name, gpu in GPUS.items() if gpu.target])
def test_every_target_config_compiles_a_matmul_for_its_gpu(gpu):
    devices = gpu_devices(gpu, 1, 2)
    sharding = NamedSharding(Mesh(np.array(devices), ("data",)), P("data"))
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=sharding)
    compiled = xla_gpu.compile_lowered(jax.jit(lambda x: (x @ x.T).sum()).lower(x))
    assert compiled.memory_analysis().argument_size_in_bytes == 64 * 256 * 2 // 2
    assert xla_gpu.collectives(compiled.as_text()).count["all-reduce"] >= 1


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_planner_gpu_memory_is_a_direct_deviceless_compile_of_the_same_step(tmp_path):
    """The planner's XLA:GPU figure equals the memory analysis of the step built by hand, compiled by JAX's own
    deviceless API over the same target config and topology (the planner compiles that very program text)."""
    model_file = tmp_path / "tiny.json"
    model_file.write_text(__import__("json").dumps(TINY))
    config = default_config()
    config.update(model=str(model_file), batch_size=4, precision="bf16", grad_checkpointing=True, fsdp=True,
                  train_num_samples=1000, epochs=1, workers=1)
    compiles = []  # (lowered, compiler options, compiled) of every compile the planner runs
    with mock.patch.object(jax.stages.Lowered, "compile", recording(compiles)):
        result = planner.plan(config, "a100-40gb", 8, compiler="gpu", topology="2x4", search_batch=False,
                              xla_flops=False)
    memory = result.memory_per_device
    assert memory.compiler == "gpu" and "XLA:GPU" in memory.measured_by
    assert result.setup.attention == "cudnn"  # auto, on a GPU, in bf16

    topology = topologies.get_topology_desc(platform="cuda", target_config=GPUS["a100-40gb"].target_config(),
                                            topology="1x2x4")
    mesh = create_mesh(topology.devices)
    # The step function itself from the factory; its devices, state layout, batch and compile options by hand.
    # The trainer's step carries the spike telemetry (on by default, every log_every_n_steps) and the config's
    # optimizer (a constant learning rate: no run length is planned).
    optimizer = OptimizerSpec(config.opt, lr=config.lr, warmup=config.warmup, weight_decay=config.wd,
                              b1=config.beta1, b2=config.beta2, eps=config.eps,
                              grad_clip_norm=config.grad_clip_norm or None)
    built = build_step(StepSpec.for_model(str(model_file), "bf16", "nothing_saveable", "cudnn", fsdp=True,
                                          optimizer=optimizer, telemetry_every=config.log_every_n_steps), mesh)
    shapes = jax.eval_shape(lambda rng: init_train_state(init_params(built.model, rng), built.optimizer),
                            jax.random.key(0))
    shardings = state_shardings(shapes, mesh, fsdp=True)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    batch_sharding = NamedSharding(mesh, P("data"))
    batch = {"images": jax.ShapeDtypeStruct((32, 32, 32, 3), jnp.float32, sharding=batch_sharding),
             "tokens": jax.ShapeDtypeStruct((32, 16), jnp.int32, sharding=batch_sharding)}
    # That program compiled with the options a deviceless compile needs: the planner has compiled it (the same
    # program text, the same options), so its compile is the direct one and is not run a second time here.
    hand_built = program_text(built.update.lower(state, batch))
    same = [compiled for lowered, options, compiled in compiles if program_text(lowered) == hand_built
            and options == {"xla_gpu_unsupported_enable_triton_multi_output_fusion": True,
                            "xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}]
    assert len(same) == 1, f"the planner compiled the hand-built step {len(same)} times, not once"
    direct = same[0].memory_analysis()
    assert memory.argument_bytes == direct.argument_size_in_bytes
    assert memory.temp_bytes == direct.temp_size_in_bytes
    assert memory.total_bytes == (direct.argument_size_in_bytes + direct.output_size_in_bytes
                                  - direct.alias_size_in_bytes + direct.temp_size_in_bytes)
    program = result.step_program
    assert program.fused_attention_calls["forward"] >= 2 and program.fused_attention_calls["backward"] >= 2
    assert program.collectives.count["reduce-scatter"] >= 1


def recording(compiles: list):
    """`jax.stages.Lowered.compile` that also appends (lowered, compiler options, compiled) to `compiles`."""
    compile_lowered = jax.stages.Lowered.compile

    def compile_and_record(lowered, compiler_options=None, **kwargs):
        compiled = compile_lowered(lowered, compiler_options, **kwargs)
        compiles.append((lowered, compiler_options, compiled))
        return compiled

    return compile_and_record


def program_text(lowered) -> str:
    """The lowered program's text, the custom partitioning calls (cuDNN's attention) without the ids of their
    Python callbacks, which differ from one lowering to the next."""
    return re.sub(r'(@CustomSPMDPartitioning\([^)]*\) \{api_version = \d+ : i32, backend_config = )"\d+"',
                  r'\1"callback"', lowered.as_text())


def fused_attention_shapes(hlo: str) -> dict[str, set[int]]:
    """The dimensions of cuDNN's attention outputs ([B, N, T, H] or [B, T, N, H]), forward and backward calls."""
    dims = {"forward": set(), "backward": set()}
    for line in hlo.splitlines():
        target = re.search(r'custom_call_target="__cudnn\$fmha(\w*)"', line)
        if target:
            shape = re.search(r"bf16\[(\d+),(\d+),(\d+),(\d+)\]", line)
            dims["backward" if "Backward" in target[1] else "forward"].update(int(d) for d in shape.groups())
    return dims


# ResNet image towers attend in their pool only, one query over the grid: no fused-attention kernel to check there.
# Of the SigLIP models (the same towers at other sizes, ~13 s a compile) the one the planner is shown with.
@pytest.mark.gpu_compile
@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in list_models() if not is_resnet(get_model_config(name))
                                  and (not get_model_config(name).vision.attention_pool
                                       or name == "ViT-SO400M-14-SigLIP")])
def test_cudnn_attention_compiles_for_every_registered_model_in_both_towers_forward_and_backward(name):
    config = get_model_config(name)
    model = create_model(name, dtype=jnp.bfloat16, attention_impl="cudnn")
    mesh = create_mesh(gpu_devices("h100", 1, 1))
    replicated = NamedSharding(mesh, P())
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
                          param_shapes(model))
    size = config.vision.image_size
    images = jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32, sharding=replicated)
    tokens = jax.ShapeDtypeStruct((2, config.text.context_length), jnp.int32, sharding=replicated)

    def loss(params, images, tokens):
        image_features, text_features, scale, *_ = model.apply({"params": params}, images, tokens)  # SigLIP: bias
        return jnp.sum(scale * image_features @ text_features.T)

    hlo = xla_gpu.compile_lowered(jax.jit(jax.grad(loss)).lower(params, images, tokens)).as_text()
    padded = lambda t: -(-t // 8) * 8  # noqa: E731
    towers = {padded(config.vision.num_tokens), padded(config.text.context_length)}
    shapes = fused_attention_shapes(hlo)
    assert towers <= shapes["forward"], (towers, shapes)
    assert towers <= shapes["backward"], (towers, shapes)


def param_bytes(setup, dtype_bytes: int) -> int:
    shapes = param_shapes(create_model(setup.model))
    return dtype_bytes * sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def gradient_reduction_bytes(moved, dtype: str) -> int:
    return sum(moved.bytes_by_dtype[kind].get(dtype, 0) for kind in ("all-reduce", "reduce-scatter"))


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_gradients_cross_devices_in_float32_reduce_scattered_under_fsdp_all_reduced_in_a_replica():
    """On 8 GPUs, bf16 compute: the gradients are summed across devices in float32 by default (as OpenCLIP's DDP
    sums them), none in bf16. FSDP sends each weight's gradient through a reduce-scatter (the float32 size of the
    model per step) and all-reduces next to nothing; a replica all-reduces the whole gradient in float32, or in
    bf16, half the bytes, with `grad_reduce_dtype="bfloat16"`."""
    mesh = create_mesh(gpu_devices("a100-40gb", 1, 8))
    fsdp = StepSpec.for_model("ViT-B-32", "bf16", "nothing_saveable", attention_impl="cudnn", fsdp=True)
    weights = param_bytes(fsdp, 4)
    sharded = xla_gpu.collectives(planner.compile_train_step(fsdp, mesh, 4).as_text())
    assert 0.8 * weights <= sharded.bytes_by_dtype["reduce-scatter"]["f32"] <= 1.05 * weights
    assert sharded.bytes["all-reduce"] < 0.02 * weights
    assert gradient_reduction_bytes(sharded, "bf16") == 0
    # Every split weight is gathered twice (forward, and again where remat recomputes the forward), in bf16.
    assert 0.8 * weights <= sharded.bytes["all-gather"] <= 1.05 * weights

    replica = dataclasses.replace(fsdp, fsdp=False)
    plain = xla_gpu.collectives(planner.compile_train_step(replica, mesh, 4).as_text())
    assert 0.98 * weights <= plain.bytes_by_dtype["all-reduce"]["f32"] <= 1.05 * weights
    assert plain.bytes["reduce-scatter"] < 0.01 * weights  # the loss's feature gradients only
    assert gradient_reduction_bytes(plain, "bf16") == 0

    narrow = xla_gpu.collectives(planner.compile_train_step(
        dataclasses.replace(replica, grad_reduce_dtype="bfloat16"), mesh, 4).as_text())
    assert 0.98 * weights / 2 <= narrow.bytes_by_dtype["all-reduce"]["bf16"] <= 1.05 * weights / 2
    assert narrow.bytes_by_dtype["all-reduce"].get("f32", 0) < 0.02 * weights


# ViT-B-32's step without remat at 64 per H200 with cuDNN attention: the activation test compiles it in bf16 with
# and without the 16-bit LayerNorm/GELU path, the FP8 test in fp8 and bf16; the bf16 one is shared (a fixture: a
# deviceless XLA:GPU executable cannot be read back from the persistent compilation cache).
B32_H200_BATCH = 64


def b32_step_on_an_h200(precision: str):
    return planner.compile_train_step(StepSpec.for_model("ViT-B-32", precision, "none", attention_impl="cudnn"),
                                      create_mesh(gpu_devices("h200", 1, 1)), B32_H200_BATCH)


@pytest.fixture(scope="module")
def b32_bf16_step_on_an_h200():
    """That step in bf16, compiled once for the two tests that read it."""
    return b32_step_on_an_h200("bf16")


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_a_bf16_step_without_remat_keeps_about_half_the_activation_bytes_of_autodiffs_layer_norm_and_gelu(
        b32_bf16_step_on_an_h200):
    """ViT-B-32, bf16, no remat, 64 per H200: beyond the train state, the step keeps 2.44 GiB with the LayerNorms'
    and GELUs' 16-bit path (their custom VJPs) against 4.44 GiB with autodiff's float32 copies (measured; ViT-L/14
    at 256: 66.4 against 126.6 GiB, benchmarks/RESULTS.md section 19)."""
    lean = planner.StepMemory.of(b32_bf16_step_on_an_h200)
    with mock.patch.object(layers, "is_16_bit", lambda dtype: False):
        plain = planner.StepMemory.of(b32_step_on_an_h200("bf16"))
    assert lean.argument == plain.argument
    assert (lean.total - lean.argument) <= 0.65 * (plain.total - plain.argument), (lean, plain)


@pytest.mark.gpu_compile
def test_fp8_runs_the_residual_blocks_matmuls_as_cublaslt_fp8_gemms_on_an_h200(b32_bf16_step_on_an_h200):
    """ViT-B-32's step at 64 per H200: per tower, the scanned block's four forward products and their four
    input-gradient products are FP8 GEMMs; the weight gradients and the rest stay 16-bit. The bf16 step (the
    activation test's, compiled once for both) has none."""
    gemms = {}
    for precision, step in (("fp8", b32_step_on_an_h200("fp8")), ("bf16", b32_bf16_step_on_an_h200)):
        gemms[precision] = re.findall(r'custom_call_target="(__cublas\$lt\$matmul[^"]*)"', step.as_text())
    assert gemms["fp8"].count("__cublas$lt$matmul$f8") == 2 * 8
    assert "__cublas$lt$matmul$f8" not in gemms["bf16"]
    assert len(gemms["fp8"]) == len(gemms["bf16"])


def test_the_planner_refuses_fp8_for_a_gpu_without_it_before_compiling():
    config = default_config()
    config.precision = "fp8"
    with pytest.raises(ValueError, match="precision='fp8' needs FP8 matmuls"):
        planner.plan(config, "a100-40gb", 8, compiler="gpu")


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_fsdp_state_of_vit_l_14_shrinks_about_n_fold_on_384_gpus():
    """ViT-L-14's 1024 and 4096 wide kernels have no dimension 384 divides: FSDP splits them 128 ways over a
    3 x 128 grid, the rest 384 ways, so the state per device shrinks more than 128-fold (it stayed at 2.55 GiB, a
    1.9-fold shrink, when those kernels were kept whole); the step compiles and all-reduces next to nothing."""
    devices = gpu_devices("a100-40gb", 96, 4)
    fsdp = StepSpec.for_model("ViT-L-14", "bf16", "nothing_saveable", attention_impl="cudnn", fsdp=True)
    grid = mesh_for(fsdp, devices)
    assert dict(grid.shape) == {"replica": 3, "data": 128}
    replica = planner.state_bytes_per_device(dataclasses.replace(fsdp, fsdp=False), create_mesh(devices))
    sharded = planner.state_bytes_per_device(fsdp, grid)
    assert replica / sharded > 128, (replica, sharded)

    step = planner.compile_train_step(fsdp, grid, 8)
    moved = xla_gpu.collectives(step.as_text())
    assert moved.bytes["all-reduce"] < 0.005 * param_bytes(fsdp, 4)
    assert planner.StepMemory.of(step).argument < replica / 50


@pytest.mark.gpu_compile
def test_collectives_in_a_loop_count_every_trip():
    mesh = create_mesh(gpu_devices("h200", 1, 4))
    x = jax.ShapeDtypeStruct((5, 64, 128), jnp.float32, sharding=NamedSharding(mesh, P(None, "data")))

    def body(carry, layer):  # [64, 128] split over the devices, gathered whole: an all-gather per trip
        whole = jax.lax.with_sharding_constraint(layer, NamedSharding(mesh, P()))
        return carry + jnp.sum(jnp.sin(whole) @ jnp.cos(whole).T), None

    hlo = xla_gpu.compile_lowered(jax.jit(lambda x: jax.lax.scan(body, 0.0, x)[0]).lower(x)).as_text()
    counted = xla_gpu.collectives(hlo)
    assert counted.count["all-gather"] == 5
    assert counted.bytes["all-gather"] == 5 * 64 * 128 * 4


def test_synchronous_collectives_count_the_whole_buffer_of_every_group_form():
    hlo = """HloModule m

ENTRY %main (p: f32[64]) -> (f32[8], f32[8], f32[16], f32[64]) {
  %p = f32[64]{0} parameter(0)
  %a = f32[8]{0} reduce-scatter(%p), replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}
  %b = f32[8]{0} reduce-scatter(%p), replica_groups=[1,8]<=[8], dimensions={0}
  %c = f32[16]{0} reduce-scatter(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  ROOT %d = f32[64]{0} all-reduce(%p), replica_groups={{0,1,2,3,4,5,6,7}}
}
"""
    counted = xla_gpu.collectives(hlo)
    assert counted.count["reduce-scatter"] == 3 and counted.count["all-reduce"] == 1
    assert counted.bytes["reduce-scatter"] == 3 * 64 * 4  # each scatters the whole 64-float input
    assert counted.bytes["all-reduce"] == 64 * 4


def test_topology_parsing_and_its_errors():
    assert xla_gpu.parse_topology("96x4", 384) == (96, 4)
    assert xla_gpu.parse_topology(None, 384) == (48, 8)
    assert xla_gpu.parse_topology(None, 6) == (1, 6)
    with pytest.raises(ValueError, match="holds 32 GPUs, not the 384"):
        xla_gpu.parse_topology("8x4", 384)
    with pytest.raises(ValueError, match="NODESxGPUS_PER_NODE"):
        xla_gpu.parse_topology("96*4", 384)


def run_planner(*args, hide_cuda_plugin: bool = False) -> subprocess.CompletedProcess:
    hide = ("import sys\n"
            "class Hide:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.startswith('jax_plugins.xla_cuda'): raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Hide())\n") if hide_cuda_plugin else ""
    code = hide + ("import runpy, sys\nsys.argv = ['clip_jax.plan', *sys.argv[1:]]\n"
                   "runpy.run_module('clip_jax.plan', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code, "--config", os.path.join(REPO, "configs/l14_laion2b.py"),
                           *args], capture_output=True, text=True, cwd=REPO, timeout=300, check=False)


@pytest.mark.gpu_compile
@pytest.mark.subprocess
@pytest.mark.parametrize("args, hide, message", [
    (["--gpu", "p100", "--gpus", "8"], False, "unknown GPU 'p100'; known: a100-40gb"),
    (["--gpu", "h100", "--gpus", "384", "--topology", "96x8"], False, "topology 96x8 holds 768 GPUs, not the 384"),
    (["--gpu", "h100", "--gpus", "8", "--compiler", "gpu"], True, "--compiler=gpu needs jaxlib's CUDA plugin"),
])
def test_bad_planner_input_gets_one_line_and_exit_status_2(args, hide, message):
    done = run_planner(*args, hide_cuda_plugin=hide)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], done.stderr[-2000:]


@pytest.mark.gpu_compile
@pytest.mark.subprocess
@pytest.mark.slow
def test_the_command_line_planner_takes_xla_gpu_when_the_plugin_is_there(tmp_path):
    # XLA's FLOP count (XLA:CPU compiles beside the XLA:GPU one) is test_plan.py's: not asked for here.
    model_file = tmp_path / "tiny.json"
    model_file.write_text(__import__("json").dumps(TINY))
    config_file = tmp_path / "tiny_run.py"
    config_file.write_text("from clip_jax.run_config import default_config\n"
                           "def get_config():\n"
                           "    c = default_config()\n"
                           f"    c.update(model={str(model_file)!r}, batch_size=2, train_num_samples=1000, epochs=1,\n"
                           "             workers=1, grad_checkpointing=False)\n"
                           "    return c\n")
    done = subprocess.run([sys.executable, "-m", "clip_jax.plan", f"--config={config_file}", "--gpu=h200",
                           "--gpus=16", "--topology=4x4", "--nosearch_batch", "--noxla_flops"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("XLA:GPU memory analysis of the train step compiled for 16 x h200 (4 nodes x 4, deviceless XLA:GPU)"
            in done.stdout)
    assert "cuDNN fused attention: " in done.stdout and "collectives: " in done.stdout
    assert "31.7%" in done.stdout  # the H200's measured MFU, not the reference run's
    assert "XLA (not counted: --noxla_flops)" in done.stdout


def test_the_planner_plans_with_the_memory_fraction_the_launcher_sets():
    env_sh = open(os.path.join(REPO, "launch/env.sh")).read()
    fraction = re.search(r'XLA_PYTHON_CLIENT_MEM_FRACTION="\$\{XLA_PYTHON_CLIENT_MEM_FRACTION:-([\d.]+)\}"', env_sh)
    assert float(fraction[1]) == planner.DEFAULT_MEMORY_FRACTION


@pytest.mark.gpu_compile
def test_fp16_is_planned_for_a_t4_with_xlas_attention_float16_products_and_its_fp16_peak(tmp_path):
    model_file = tmp_path / "tiny.json"
    model_file.write_text(__import__("json").dumps(TINY))
    config = default_config()
    config.update(model=str(model_file), batch_size=4, precision="fp16", train_num_samples=1000, epochs=1, workers=1)
    compiles = []
    with mock.patch.object(jax.stages.Lowered, "compile", recording(compiles)):
        result = planner.plan(config, "t4", 2, compiler="gpu", topology="1x2", search_batch=False, xla_flops=False)
    assert result.setup.attention == "xla"  # auto: cuDNN's fused attention needs compute capability 8.0
    assert result.throughput.peak_tflops == 65 and result.throughput.predicted_samples_per_s > 0
    hlo = compiles[-1][2].as_text()
    # the program planned for a GPU keeps float16 products (a CPU program would widen them): cuBLAS's, to float16
    float16_gemms = [line for line in hlo.splitlines()
                     if '"__cublas$' in line and re.search(r"= \(f16\[[\d,]+\]\{[\d,]*\}, s8\[", line)]
    assert len(float16_gemms) >= 10, "the T4 program runs too few float16 products"
    for precision, gpu, said in (("bf16", "t4", "precision='bf16' needs bfloat16 matmuls .* a t4 .* "
                                  "--config.precision=fp16"),
                                 ("fp16", "v100", "planning for a v100 .* CUDA 12's")):
        config.precision = precision
        with pytest.raises(ValueError, match=said):
            planner.plan(config, gpu, 2, compiler="gpu", topology="1x2", search_batch=False, xla_flops=False)
