"""The resource planner: what fits on a GPU, how fast it runs, how long the run takes and what it costs.

    python -m clip_jax.plan --config configs/l14_laion2b.py --gpu a100-40gb --gpus 384 [--price 2.0] [--json]
    python -m clip_jax.plan --config configs/l14_laion2b.py --gpu h100 --gpus 64 --config.precision=fp32

Measured and modelled, as the output labels them:

- parameters: counted from the parameter tree;
- memory per device: XLA's memory analysis of the train step `clip_jax.train` runs, compiled for the planned number
  of devices with abstract inputs, so nothing is allocated. With jaxlib's CUDA plugin installed (`.[gpu]`) XLA:GPU
  compiles it for the planned GPU and topology without a GPU (`clip_jax.xla_gpu`; on an H200 its figures were within
  8% of the allocator's peak); otherwise XLA:CPU does, over one simulated device per GPU, whose fusions and
  attention (no cuDNN) differ: an estimate that runs far higher (23.2 against 13.5 GiB for the reference step);
- the largest per-device batch: bisection on that compiled memory;
- with XLA:GPU, the collectives of the step (count and bytes per device, loop trips counted) and cuDNN's fused
  attention;
- FLOPs per sample: analytic (`clip_jax.models.flops`) and XLA:CPU's cost analysis of the compiled programs (XLA:GPU
  gives none);
- speed: a model, samples/s = MFU x peak FLOP/s / model FLOPs per sample, at a stated MFU;
- data loading: the input pipeline's measured rate per CPU core;
- time, GPU-hours and cost: arithmetic on the above.
"""

import dataclasses
import functools
import json
import math
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clip_jax import xla_gpu
from clip_jax.hardware import GPU, GPUS, get_gpu
from clip_jax.models import CLIPConfig, create_model, get_model_config, param_shapes
from clip_jax.models.flops import forward_flops, image_tokens, train_flops
from clip_jax.models.layers import Transformer
from clip_jax.parallel import create_mesh
from clip_jax.precision import get_policy
from clip_jax.step_factory import StepSpec, build_step, mesh_for

# OpenCLIP's ViT-L/14 LAION-2B run: 72.6 samples/s per A100-40GB (27,862 on 384). Without a measurement of our own,
# the default MFU is the model FLOP rate that run reached, as a fraction of the A100's peak for the planned precision.
REFERENCE_SAMPLES_PER_S = 72.6
REFERENCE_GPU = "a100-40gb"
REFERENCE_MODEL = "ViT-L-14"
# clip_jax's own GPU measurements, (gpu, precision) -> (MFU, where it was recorded); used before the reference.
MEASURED_MFU: dict[tuple[str, str], tuple[float, str]] = {
    ("h200", "bf16"): (0.317, "measured: clip_jax's ViT-L-14 bf16 step on one H200, remat dots_saveable, cuDNN "
                              "attention, batch 256: 596.7 samples/s (benchmarks/RESULTS.md, 2026-11-30)"),
    ("h200", "fp32"): (0.282, "measured: clip_jax's ViT-L-14 fp32 step on one H200, remat dots_saveable, batch 256: "
                              "264.7 samples/s (benchmarks/RESULTS.md, 2026-11-30)"),
}
# benchmarks/data_pipeline.py, 2026-11-30: read + decode + RandomResizedCrop(224) + normalise + tokenize + batch,
# 256 px JPEGs, samples per CPU-second on one core of an Intel Xeon (larger source images decode slower).
PIPELINE_SAMPLES_PER_CORE_S = 329.0
# The fraction of GPU memory JAX may take: launch/env.sh sets XLA_PYTHON_CLIENT_MEM_FRACTION to the same (JAX's own
# default is 0.75); plan with the fraction the run will have.
DEFAULT_MEMORY_FRACTION = 0.92
MAX_SIMULATED_DEVICES = 4096
TOWERS = ("image", "text")


class BatchDoesNotFit(ValueError):
    """Even one sample per device needs more memory than the budget."""


# -- what is compiled ------------------------------------------------------------------------------------------


def planned_spec(config, compiler: str = "cpu") -> StepSpec:
    """The step the trainer would build from `config` on the planned GPUs; where XLA:CPU compiles it, with XLA's
    attention (XLA:CPU has no cuDNN)."""
    spec = StepSpec.from_config(config, platform="gpu")
    return spec if compiler == "gpu" else dataclasses.replace(spec, attention_impl="xla")


def compile_train_step(spec: StepSpec, mesh, per_device_batch: int):
    """The train step of `spec`, compiled for `mesh` from abstract inputs."""
    return build_step(spec, mesh).compile(per_device_batch)


# -- memory ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes per device from XLA's memory analysis of a compiled program."""

    argument: int
    output: int
    alias: int  # outputs written into donated arguments (the train state)
    temp: int

    @property
    def total(self) -> int:
        # What the program holds at once; XLA:CPU's peak_memory_in_bytes is not meaningful.
        return self.argument + self.output - self.alias + self.temp

    @classmethod
    def of(cls, compiled) -> "StepMemory":
        m = compiled.memory_analysis()
        return cls(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes)


def state_bytes_per_device(spec: StepSpec, mesh) -> int:
    """Params + optimizer state + step counter held by one device, from the tree and its shardings."""
    total = 0
    for leaf in jax.tree.leaves(build_step(spec, mesh).abstract_state):
        total += math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total


def batch_bytes_per_device(config: CLIPConfig, per_device_batch: int) -> int:
    image_bytes = config.vision.image_size**2 * 3 * 4  # float32
    return per_device_batch * (image_bytes + config.text.context_length * 4)  # int32 tokens


def largest_fitting_batch(memory_of: Callable[[int], int], budget: int, *, guess: int = 1,
                          limit: int = 1 << 16) -> int:
    """The largest batch b <= `limit` with memory_of(b) <= budget, for memory growing with b.

    Brackets the answer between a batch that fits and one that does not (doubling from `guess`), then shrinks the
    bracket in rounds of three probes: the affine interpolation of the bracket's ends at the budget, its neighbour
    on the other side of the budget (compiled memory is close to affine in the batch, so these two usually settle
    it), and the midpoint, which keeps the search logarithmic when they do not. The result fits and the next batch
    does not (unless it is `limit`). Raises BatchDoesNotFit when even b = 1 does not fit.
    """
    probes: dict[int, int] = {}

    def fits(b: int) -> bool:
        if b not in probes:
            probes[b] = memory_of(b)
        return probes[b] <= budget

    if not fits(1):
        raise BatchDoesNotFit(f"batch 1 needs {probes[1]:,} bytes, more than the budget of {budget:,}")
    lo, hi = 1, None
    b = min(max(guess, 2), limit)
    while hi is None:
        if fits(b):
            lo = b
            if b == limit:
                return limit
            b = min(2 * b, limit)
        else:
            hi = b
    round_probe = 0
    while hi - lo > 1:
        if round_probe == 0:  # interpolate
            slope = (probes[hi] - probes[lo]) / (hi - lo)
            b = lo + int((budget - probes[lo]) / slope) if slope > 0 else (lo + hi) // 2
        elif round_probe == 1:  # the neighbour across the budget of the interpolated batch
            b = b + 1 if b == lo else b - 1
        else:
            b = (lo + hi) // 2
        b = min(max(b, lo + 1), hi - 1)
        if fits(b):
            lo = b
        else:
            hi = b
        round_probe = (round_probe + 1) % 3
    return lo


# -- FLOPs -----------------------------------------------------------------------------------------------------
#
# XLA's cost analysis counts the body of a while loop once, whatever its trip count, and the residual blocks of each
# tower run as one scanned loop (nn.scan): the forward loop, and in the step the backward loop too. The full count
# is therefore the compiled program's count plus (depth - 1) x one block's count, where one block's count is that of
# the same scanned stack compiled alone at depth 2 (still a loop, so one body: forward, or forward and backward with
# the step's remat policy, dtype and per-device batch). Blocks are identical, so this is exact up to the few ops
# outside the loops that the alone-compiled stack adds (a sum). Whether this XLA counts loop bodies once is checked
# (a depth-2 and a depth-3 stack counting the same); where it counts every trip, nothing is added.


@functools.cache
def loop_bodies_counted_once() -> bool:
    """True when XLA's cost analysis ignores trip counts (a depth-3 stack counts as much as a depth-2 one)."""
    def cost(depth: int) -> float:
        stack = Transformer(width=64, layers=depth, heads=2, mlp_width=256)
        x = jax.ShapeDtypeStruct((4, 8, 64), jnp.float32)
        params = jax.eval_shape(stack.init, jax.random.key(0), x)
        return jax.jit(stack.apply).lower(params, x).compile().cost_analysis()["flops"]

    two, three = cost(2), cost(3)
    return three - two < 0.5 * two


def _tower(config: CLIPConfig, tower: str) -> tuple[int, int, int, int, int, bool]:
    """(width, heads, mlp_width, tokens, layers, causal) of a tower's residual stack."""
    if tower == "image":
        v = config.vision
        return v.width, v.heads, v.mlp_width, v.num_tokens, v.layers, False
    t = config.text
    return t.width, t.heads, t.mlp_width, t.context_length, t.layers, True


def block_flops(setup: StepSpec, tower: str, per_device_batch: int, *, train: bool) -> float:
    """XLA's count for one residual block of `tower` (a depth-2 scanned stack, whose loop body is counted once)."""
    width, heads, mlp_width, tokens, _, causal = _tower(setup.model, tower)
    if train and tower == "image":
        tokens = image_tokens(setup.model.vision, train=True)  # the step's blocks see only the kept patches
    policy = get_policy(setup.precision)
    stack = Transformer(width, 2, heads, mlp_width, causal=causal, quick_gelu=setup.model.quick_gelu,
                        dtype=policy.compute_dtype, param_dtype=policy.param_dtype, remat_policy=setup.remat_policy)
    x = jax.ShapeDtypeStruct((per_device_batch, tokens, width), policy.compute_dtype)
    params = jax.eval_shape(stack.init, jax.random.key(0), x)
    if train:
        fn = jax.grad(lambda p, x: jnp.sum(stack.apply(p, x).astype(jnp.float32)), argnums=(0, 1))
    else:
        fn = stack.apply
    return jax.jit(fn).lower(params, x).compile().cost_analysis()["flops"]


def loop_corrected_flops(compiled, setup: StepSpec, per_device_batch: int, *, train: bool) -> float:
    """FLOPs per sample of a compiled forward (train=False) or train step, every block counted."""
    flops = compiled.cost_analysis()["flops"]
    if loop_bodies_counted_once():
        for tower in TOWERS:
            layers = _tower(setup.model, tower)[4]
            if layers > 1:
                flops += (layers - 1) * block_flops(setup, tower, per_device_batch, train=train)
    return flops / per_device_batch


@dataclasses.dataclass(frozen=True)
class FlopsPerSample:
    forward_analytic: float
    forward_xla: float
    train_analytic: float  # 3 x forward: the model FLOPs MFU is quoted in
    train_xla: float  # the step without remat: also norms, softmax, GELU, the loss and the AdamW update
    remat_extra_analytic: float  # upper bound: every block's forward again
    remat_extra_xla: float  # what the remat policy really recomputes (XLA drops recomputation nothing needs)


def flops_per_sample(setup: StepSpec, mesh, per_device_batch: int, *,
                     compile_step: Callable[[StepSpec], Any] | None = None) -> FlopsPerSample:
    """Analytic and XLA-counted FLOPs per sample; `compile_step(setup)` may supply (cached) compiled steps."""
    if compile_step is None:
        compile_step = lambda s: compile_train_step(s, mesh, per_device_batch)
    plain = dataclasses.replace(setup, remat_policy="none")
    forward_xla = loop_corrected_flops(build_step(plain, mesh).compile_forward(per_device_batch), plain,
                                       per_device_batch, train=False)
    train_xla = loop_corrected_flops(compile_step(plain), plain, per_device_batch, train=True)
    remat_xla = 0.0
    if setup.remat_policy != "none":
        remat_xla = loop_corrected_flops(compile_step(setup), setup, per_device_batch, train=True) - train_xla
    config = setup.model
    remat_analytic = 0.0
    if setup.remat_policy != "none":
        remat_analytic = float(train_flops(config, remat=True) - train_flops(config))
    return FlopsPerSample(float(forward_flops(config)), forward_xla, float(train_flops(config)), train_xla,
                          remat_analytic, remat_xla)


# -- speed, data loading, time ---------------------------------------------------------------------------------


def default_mfu(gpu: GPU, precision: str) -> tuple[float, str]:
    """(MFU, where it comes from): clip_jax's own measurement when there is one, else the reference run's."""
    if (gpu.name, precision) in MEASURED_MFU:
        return MEASURED_MFU[gpu.name, precision]
    reference_gpu = get_gpu(REFERENCE_GPU)
    flop_rate = REFERENCE_SAMPLES_PER_S * train_flops(get_model_config(REFERENCE_MODEL))
    mfu = flop_rate / (reference_gpu.peak_tflops(precision) * 1e12)
    return mfu, (f"assumed: the reference run's {REFERENCE_SAMPLES_PER_S} samples/s per {REFERENCE_GPU} "
                 f"({flop_rate / 1e12:.1f} TFLOP/s) over that GPU's {precision} peak; no clip_jax GPU "
                 "measurement yet")


def samples_per_s_per_gpu(mfu: float, gpu: GPU, precision: str, model_train_flops: float) -> float:
    return mfu * gpu.peak_tflops(precision) * 1e12 / model_train_flops


def _parameter_counts(setup: StepSpec) -> dict[str, int]:
    shapes = param_shapes(create_model(setup.model))
    count = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
    image = count(shapes["visual"])
    logit_scale = count(shapes["logit_scale"])
    total = count(shapes)
    return {"total": total, "image": image, "text": total - image - logit_scale, "logit_scale": logit_scale}


def _affine_fit(probes: dict[int, int]) -> tuple[float, float] | None:
    """(bytes at batch 0, bytes per sample) through the compiled points, None with fewer than two."""
    if len(probes) < 2:
        return None
    b, m = np.array(list(probes), float), np.array(list(probes.values()), float)
    slope, intercept = np.polyfit(b, m, 1)
    return float(intercept), float(slope)


def _memory_savers(config) -> str:
    """What the config could change to need less memory per device, as a sentence end."""
    savers = []
    if not config.grad_checkpointing:
        savers.append("grad_checkpointing=True")
    if not config.fsdp:
        savers.append("fsdp=True")
    if config.precision != "pure_bf16":
        savers.append("precision='pure_bf16'")
    return ", ".join(savers + ["a GPU with more memory"])


def _smallest_accum(batch_size: int, start: int, fits_with: Callable[[int], bool]) -> int | None:
    """The smallest divisor k >= start of the per-device batch whose accumulated step fits."""
    for k in range(max(start, 1), batch_size + 1):
        if batch_size % k == 0 and fits_with(k):
            return k
    return None


def _check_arguments(num_gpus: int, price: float | None, mfu: float | None, memory_fraction: float,
                     pipeline_rate: float) -> None:
    problems = []
    if not 1 <= num_gpus <= MAX_SIMULATED_DEVICES:
        problems.append(f"--gpus={num_gpus}: give 1 to {MAX_SIMULATED_DEVICES} GPUs (one simulated device each)")
    if price is not None and price < 0:
        problems.append(f"--price={price}: a price per GPU-hour cannot be negative")
    if mfu is not None and not 0 < mfu <= 1:
        problems.append(f"--mfu={mfu}: give a fraction in (0, 1], e.g. 0.4")
    if not 0 < memory_fraction <= 1:
        problems.append(f"--memory_fraction={memory_fraction}: give a fraction in (0, 1]")
    if pipeline_rate <= 0:
        problems.append(f"--pipeline_rate={pipeline_rate}: samples per CPU-second must be positive")
    if problems:
        raise ValueError("bad planner arguments:\n  " + "\n  ".join(problems))


def _run_length(config, global_batch: int, samples_per_s: float, num_gpus: int, price: float | None) -> dict | None:
    """Steps, time, GPU-hours and cost of `epochs x train_num_samples`, counted in whole steps as the trainer runs."""
    if not config.train_num_samples:
        return None
    from clip_jax import data  # here, so that the rest of the planner runs without the input pipeline's deps

    data_config = data.TrainDataConfig(shards=config.train_data or "unused", workers=config.workers,
                                       train_num_samples=config.train_num_samples, check_shards_exist=False)
    steps = config.epochs * data.steps_per_epoch(data_config, global_batch)
    seconds = steps * global_batch / samples_per_s
    gpu_hours = seconds * num_gpus / 3600
    return {"epochs": config.epochs, "samples_per_epoch": config.train_num_samples,
            "samples": config.epochs * config.train_num_samples, "steps": steps,
            "samples_in_steps": steps * global_batch, "seconds": seconds, "days": seconds / 86400,
            "gpu_hours": gpu_hours, "price_per_gpu_hour": price, "cost": None if price is None else gpu_hours * price}


def _gpu_table(setup: StepSpec, model_train_flops: float, mfu: float | None, memory_fraction: float,
               num_gpus: int, run: dict | None, *, exact: tuple[str, int | None],
               fit: tuple[float, float] | None) -> list[dict]:
    """Every known GPU: peaks, memory, speed at the MFU rule, largest batch (compiled for one, else the fit), days."""
    rows = []
    for gpu in GPUS.values():
        gpu_mfu = mfu if mfu is not None else default_mfu(gpu, setup.precision)[0]
        rate = samples_per_s_per_gpu(gpu_mfu, gpu, setup.precision, model_train_flops)
        budget = int(gpu.memory_bytes * memory_fraction)
        if gpu.name == exact[0] and exact[1] is not None:
            largest, how = exact[1], "compiled"
        elif fit is not None and fit[1] > 0:
            largest, how = max(0, int((budget - fit[0]) // fit[1])), "affine fit"
        else:
            largest, how = None, "unknown"
        rows.append({"gpu": gpu.name, "memory_gib": round(gpu.memory_gib, 1), "bf16_tflops": gpu.bf16_tflops,
                     "tf32_tflops": gpu.tf32_tflops, "mfu": gpu_mfu, "samples_per_s_per_gpu": rate,
                     "largest_batch": largest, "largest_batch_from": how,
                     "days": run["samples_in_steps"] / (rate * num_gpus) / 86400 if run else None})
    return rows


def plan(config, gpu_name: str, num_gpus: int, *, price: float | None = None, mfu: float | None = None,
         memory_fraction: float = DEFAULT_MEMORY_FRACTION, pipeline_rate: float = PIPELINE_SAMPLES_PER_CORE_S,
         compiler: str = "cpu", topology: str | None = None, devices=None, search_batch: bool = True,
         progress: Callable[[str], None] = lambda message: None) -> dict:
    """The plan for training `config` on `num_gpus` GPUs of kind `gpu_name`, as a JSON-ready dict.

    `compiler`: "gpu" compiles the step with XLA:GPU for `topology` ("NODESxGPUS", see `xla_gpu.parse_topology`)
    without a GPU; "cpu" with XLA:CPU over `devices`, one per GPU (default: the first `num_gpus` of
    `jax.devices()`).
    """
    gpu = get_gpu(gpu_name)
    _check_arguments(num_gpus, price, mfu, memory_fraction, pipeline_rate)
    if compiler not in ("cpu", "gpu"):
        raise ValueError(f"compiler={compiler!r}: choose cpu or gpu")
    if compiler == "gpu":
        nodes, per_node = xla_gpu.parse_topology(topology, num_gpus)
        devices = xla_gpu.devices(gpu, nodes, per_node)
        where = f"{num_gpus} x {gpu.name} ({nodes} node{'s' * (nodes > 1)} x {per_node}, deviceless XLA:GPU)"
    else:
        devices = list(jax.devices()[:num_gpus] if devices is None else devices)
        where = f"{num_gpus} simulated device{'s' * (num_gpus > 1)}"
    if len(devices) != num_gpus:
        raise ValueError(f"planning for {num_gpus} GPUs needs {num_gpus} JAX devices, {len(devices)} are there: "
                         "run `python -m clip_jax.plan`, which simulates them, or set jax_num_cpu_devices first")
    setup = planned_spec(config, compiler)
    batch_size, accum_freq = int(config.batch_size), int(config.accum_freq)
    if batch_size < 1 or accum_freq < 1 or batch_size % accum_freq:
        raise ValueError(f"batch_size={batch_size} (per device) must be a positive multiple of "
                         f"accum_freq={accum_freq}")
    mesh = mesh_for(setup, devices)
    budget = int(gpu.memory_bytes * memory_fraction)

    compiled_steps: dict[tuple[StepSpec, int, int], Any] = {}

    def compiled_step(s: StepSpec, b: int, accum: int = 1):
        if (s, b, accum) not in compiled_steps:
            progress(f"compiling the train step ({s.describe()}) for {where}: per-device batch {b}, "
                     f"accum_steps {accum}")
            compiled_steps[s, b, accum] = compile_train_step(dataclasses.replace(s, accum_steps=accum), mesh, b)
        return compiled_steps[s, b, accum]

    memory_probes: dict[int, int] = {}

    def memory_of(b: int) -> int:
        memory_probes[b] = StepMemory.of(compiled_step(setup, b)).total
        return memory_probes[b]

    # Memory of the planned step, the largest batch, accumulation.
    planned = StepMemory.of(compiled_step(setup, batch_size, accum_freq))
    if accum_freq == 1:
        memory_probes[batch_size] = planned.total
    try:
        largest = largest_fitting_batch(memory_of, budget, guess=batch_size) if search_batch else None
    except BatchDoesNotFit:
        raise BatchDoesNotFit(
            f"{setup.model.name} ({setup.describe()}) needs {_size(memory_probes[1])} per device at a per-device "
            f"batch of 1 (compiled for {where}; train state {_size(state_bytes_per_device(setup, mesh))}), more "
            f"than the {_size(budget)} usable on a {gpu.name} ({gpu.memory_gib:.1f} GiB x {memory_fraction}). "
            f"Try {_memory_savers(config)}") from None
    fits = planned.total <= budget
    accum_needed = accum_freq
    if not fits:
        start = max(accum_freq, -(-batch_size // largest)) if largest else accum_freq + 1
        fits_with = lambda k: StepMemory.of(compiled_step(setup, batch_size, k)).total <= budget
        accum_needed = _smallest_accum(batch_size, start, fits_with)
    elif accum_freq > 1 and largest is not None and largest >= batch_size:
        accum_needed = 1  # the whole per-device batch fits without accumulating

    # What XLA:GPU's program does besides: its collectives and whether cuDNN's fused attention runs.
    step_program = None
    if compiler == "gpu":
        hlo = compiled_step(setup, batch_size, accum_needed or accum_freq).as_text()
        collectives = xla_gpu.collectives(hlo)
        step_program = {"collectives": {"count": collectives.count, "bytes": collectives.bytes},
                        "fused_attention_calls": xla_gpu.fused_attention(hlo)}

    # FLOPs, counted on the step without accumulation at the per-device micro-batch (by XLA:CPU, on one device
    # when XLA:GPU compiled the rest: its cost analysis is empty).
    micro_batch = batch_size // (accum_needed or accum_freq)
    if compiler == "gpu":
        progress(f"counting FLOPs: XLA:CPU compiles of the step at per-device batch {micro_batch}")
        cpu_setup = dataclasses.replace(setup, attention_impl="xla")
        flops = flops_per_sample(cpu_setup, create_mesh(jax.devices("cpu")[:1]), micro_batch)
    else:
        flops = flops_per_sample(setup, mesh, micro_batch, compile_step=lambda s: compiled_step(s, micro_batch))

    # Speed, data loading, time and cost.
    mfu_value, mfu_source = (mfu, "given (--mfu)") if mfu is not None else default_mfu(gpu, setup.precision)
    rate = samples_per_s_per_gpu(mfu_value, gpu, setup.precision, flops.train_analytic)
    if (accum_needed or 1) > 1:  # features are computed twice: one more forward per sample
        rate *= flops.train_analytic / (flops.train_analytic + forward_flops(setup.model, train=True))
    global_batch = batch_size * num_gpus
    run = _run_length(config, global_batch, rate * num_gpus, num_gpus, price)
    fit = _affine_fit(memory_probes)
    table = _gpu_table(setup, flops.train_analytic, mfu, memory_fraction, num_gpus, run, exact=(gpu.name, largest),
                       fit=fit)

    return {
        "config": getattr(config, "name", "") or "", "model": setup.model.name, "gpu": gpu.name, "gpus": num_gpus,
        "setup": {"precision": setup.precision, "remat_policy": setup.remat_policy, "fsdp": setup.fsdp,
                  "attention": setup.attention_impl, "batch_size": batch_size, "accum_freq": accum_freq,
                  "global_batch": global_batch},
        "parameters": _parameter_counts(setup),
        "flops_per_sample": dataclasses.asdict(flops) | {"counted_at_batch": micro_batch},
        "memory_per_device": {
            "compiler": compiler,
            "measured_by": f"XLA:{compiler.upper()} memory analysis of the train step compiled for {where}",
            "batch_size": batch_size, "accum_freq": accum_freq, "argument_bytes": planned.argument,
            "output_bytes": planned.output, "alias_bytes": planned.alias, "temp_bytes": planned.temp,
            "total_bytes": planned.total, "state_bytes": state_bytes_per_device(setup, mesh),
            "batch_bytes": batch_bytes_per_device(setup.model, batch_size), "gpu_bytes": gpu.memory_bytes,
            "memory_fraction": memory_fraction, "usable_bytes": budget, "fits": fits,
            "largest_batch": largest, "largest_batch_compiles": len(memory_probes) if search_batch else 0,
            "accum_freq_needed": accum_needed,
            "bytes_per_sample_fit": fit[1] if fit else None,
        },
        "throughput": {"mfu": mfu_value, "mfu_source": mfu_source,
                       "peak_tflops": gpu.peak_tflops(setup.precision), "samples_per_s_per_gpu": rate,
                       "samples_per_s": rate * num_gpus},
        "step_program": step_program,
        "data_loading": {"samples_per_core_s": pipeline_rate, "cores_per_gpu": rate / pipeline_rate,
                         "workers_per_process": config.workers},
        "run": run,
        "gpu_table": table,
    }


# -- output ----------------------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _size(n: float) -> str:
    return _gib(n) if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _gflop(n: float) -> str:
    return f"{n / 1e9:.2f}"


def format_plan(p: dict) -> str:
    """The plan as a human-readable report."""
    s, f, m, t = p["setup"], p["flops_per_sample"], p["memory_per_device"], p["throughput"]
    params = p["parameters"]
    lines = [
        f"plan: {p['model']} on {p['gpus']} x {p['gpu']}",
        (f"  {s['precision']}, remat {s['remat_policy']}, fsdp {'on' if s['fsdp'] else 'off'}, attention "
         f"{s['attention']}; per-device batch {s['batch_size']}, accum_freq {s['accum_freq']}, global batch "
         f"{s['global_batch']:,}"),
        "",
        (f"parameters          {params['total']:,} (image {params['image']:,}, text {params['text']:,}, "
         f"logit_scale {params['logit_scale']})"),
        "",
        f"FLOPs per sample (GFLOP)       analytic     XLA (compiled at per-device batch {f['counted_at_batch']})",
        f"  forward                     {_gflop(f['forward_analytic']):>9}  {_gflop(f['forward_xla']):>11}",
        (f"  train step (3x forward)     {_gflop(f['train_analytic']):>9}  {_gflop(f['train_xla']):>11}"
         "   XLA also counts norms, softmax, GELU, loss, AdamW"),
    ]
    if s["remat_policy"] != "none":
        lines.append(f"  + remat ({s['remat_policy']})"[:30].ljust(30)
                     + f"{'+' + _gflop(f['remat_extra_analytic']):>9}  {'+' + _gflop(f['remat_extra_xla']):>11}"
                     "   analytic: every block again (upper bound)")
    lines += [
        "",
        f"memory per device ({m['measured_by']})",
        f"  train state       {_size(m['state_bytes']):>11}   params + AdamW moments (from the tree and its sharding)",
        f"  batch             {_size(m['batch_bytes']):>11}   float32 images + int32 tokens",
        f"  temporaries       {_size(m['temp_bytes']):>11}   activations, gradients, loss",
        (f"  total             {_size(m['total_bytes']):>11}   of {_size(m['usable_bytes'])} usable "
         f"({_size(m['gpu_bytes'])} x {m['memory_fraction']:g}): {'fits' if m['fits'] else 'DOES NOT FIT'}"),
    ]
    if m["largest_batch"] is not None:
        lines.append(f"  largest per-device batch that fits: {m['largest_batch']} "
                     f"(bisection, {m['largest_batch_compiles']} compiles)")
    if m["accum_freq_needed"] is None:
        lines.append("  no gradient accumulation makes this per-device batch fit")
    elif m["accum_freq_needed"] > 1 and not m["fits"]:
        lines.append(f"  gradient accumulation needed: accum_freq={m['accum_freq_needed']} "
                     f"(micro-batches of {s['batch_size'] // m['accum_freq_needed']})")
    elif m["accum_freq_needed"] != s["accum_freq"]:
        lines.append("  gradient accumulation not needed: the whole per-device batch fits (accum_freq=1)")
    else:
        lines.append(f"  gradient accumulation {'not needed' if s['accum_freq'] == 1 else 'as configured'}")
    program = p.get("step_program")
    if program:
        c = program["collectives"]
        moved = [f"{kind} {c['count'][kind]} ({_size(c['bytes'][kind])})" for kind in c["count"] if c["count"][kind]]
        attention = program["fused_attention_calls"]
        lines += ["", "the compiled step (XLA:GPU), per device and step",
                  f"  collectives: {', '.join(moved) or 'none'}",
                  (f"  cuDNN fused attention: {attention['forward']} forward and {attention['backward']} backward "
                   "call sites" if attention["forward"] else "  cuDNN fused attention: not used")]
    lines += [
        "",
        "throughput (modelled: MFU x peak / model FLOPs)",
        f"  MFU {t['mfu']:.1%} of the {s['precision']} peak {t['peak_tflops']:g} TFLOP/s ({t['mfu_source']})",
        f"  {t['samples_per_s_per_gpu']:.1f} samples/s per GPU, {t['samples_per_s']:,.0f} samples/s on {p['gpus']}",
    ]
    d = p["data_loading"]
    lines += [
        "",
        (f"data loading: {d['cores_per_gpu']:.2f} CPU cores per GPU at the measured {d['samples_per_core_s']:g} "
         f"samples per core-second; config: {d['workers_per_process']} workers per process"),
        "",
    ]
    r = p["run"]
    if r:
        cost = f", ${r['cost']:,.0f} at ${r['price_per_gpu_hour']:.2f} per GPU-hour" if r["cost"] is not None else ""
        lines.append(f"run: {r['epochs']} epochs x {r['samples_per_epoch']:,} = {r['samples'] / 1e9:.2f}B samples, "
                     f"{r['steps']:,} steps: {r['days']:.1f} days, {r['gpu_hours']:,.0f} GPU-hours{cost}")
    else:
        lines.append("run: length unknown (set train_num_samples in the config)")
    lines += ["", (f"GPUs (same MFU rule; largest batch of {p['gpu']} compiled, others from an affine fit of the "
                   "compiled memory)"),
              (f"  {'gpu':<11}{'GiB':>7}{'bf16 TF':>9}{'tf32 TF':>9}{'MFU':>7}{'samples/s':>11}{'max batch':>11}"
               f"{'days':>8}")]
    for row in p["gpu_table"]:
        days = f"{row['days']:.1f}" if row["days"] is not None else "-"
        largest = "-" if row["largest_batch"] is None else str(row["largest_batch"])
        lines.append(f"  {row['gpu']:<11}{row['memory_gib']:>7.1f}{row['bf16_tflops']:>9g}{row['tf32_tflops']:>9g}"
                     f"{row['mfu']:>7.1%}{row['samples_per_s_per_gpu']:>11.1f}{largest:>11}{days:>8}")
    if m["compiler"] == "gpu":
        lines += ["", ("measured here: parameters and FLOPs (XLA:CPU), memory and collectives (XLA:GPU, compiled for "
                       "the GPU without one);")]
    else:
        lines += ["", ("measured here: parameters, FLOPs and memory, by compiling the step with XLA:CPU (XLA:GPU fuses "
                       "and schedules differently, and cuDNN attention keeps no score matrix: install '.[gpu]' for "
                       "its figures);")]
    lines.append("modelled: speed, time and cost, from the MFU above")
    return "\n".join(lines)


def usage_error(message: str) -> None:
    """One line on stderr and exit status 2: the planner's answer to bad input."""
    print(f"clip_jax.plan: {message}", file=sys.stderr)
    raise SystemExit(2)


def choose_compiler(asked: str) -> str:
    """"gpu" or "cpu" for --compiler=auto|gpu|cpu: auto takes XLA:GPU when jaxlib's CUDA plugin is installed."""
    if asked == "auto":
        return "gpu" if xla_gpu.cuda_plugin_installed() else "cpu"
    if asked == "gpu" and not xla_gpu.cuda_plugin_installed():
        raise xla_gpu.CudaPluginMissing(
            f"--compiler=gpu needs jaxlib's CUDA plugin, which is not installed: {xla_gpu.INSTALL_HINT}")
    if asked not in ("gpu", "cpu"):
        raise ValueError(f"--compiler={asked}: choose auto, gpu or cpu")
    return asked


def main(argv) -> None:
    from absl import flags

    FLAGS = flags.FLAGS
    if len(argv) > 1:
        usage_error(f"unexpected arguments {argv[1:]}")
    if FLAGS.gpu not in GPUS:
        usage_error(f"unknown GPU {FLAGS.gpu!r}; known: {', '.join(GPUS)}")
    if not 1 <= FLAGS.gpus <= MAX_SIMULATED_DEVICES:
        usage_error(f"--gpus={FLAGS.gpus}: give 1 to {MAX_SIMULATED_DEVICES}")
    try:
        compiler = choose_compiler(FLAGS.compiler)
        if compiler == "gpu":
            xla_gpu.parse_topology(FLAGS.topology, FLAGS.gpus)  # before anything compiles
        elif FLAGS.topology is not None:
            usage_error("--topology needs the XLA:GPU compiler (--compiler=gpu, with '.[gpu]' installed)")
    except (ValueError, xla_gpu.CudaPluginMissing) as e:
        usage_error(str(e))
    jax.config.update("jax_platforms", "cpu")  # XLA:GPU's compile-only devices need no CUDA backend
    jax.config.update("jax_num_cpu_devices", FLAGS.gpus if compiler == "cpu" else 1)
    say = lambda message: print(message, file=sys.stderr, flush=True)
    say(f"memory from XLA:{compiler.upper()}" + (" (jaxlib's CUDA plugin is not installed)"
                                                   if compiler == "cpu" and FLAGS.compiler == "auto" else ""))
    try:
        result = plan(FLAGS.config, FLAGS.gpu, FLAGS.gpus, price=FLAGS.price, mfu=FLAGS.mfu,
                      memory_fraction=FLAGS.memory_fraction, pipeline_rate=FLAGS.pipeline_rate, compiler=compiler,
                      topology=FLAGS.topology, search_batch=FLAGS.search_batch, progress=say)
    except (ValueError, xla_gpu.CudaPluginMissing) as e:
        usage_error(str(e))
    print(json.dumps(result, indent=2) if FLAGS.json else format_plan(result))


def _define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "training config file (configs/*.py)", lock_config=True)
    flags.DEFINE_string("gpu", "a100-40gb", f"GPU kind: {', '.join(GPUS)}")
    flags.DEFINE_integer("gpus", 1, "number of GPUs (one training process each)")
    flags.DEFINE_enum("compiler", "auto", ["auto", "gpu", "cpu"],
                      "who compiles the step: XLA:GPU without a GPU (needs '.[gpu]'), XLA:CPU, or auto (XLA:GPU "
                      "when installed)")
    flags.DEFINE_string("topology", None, "NODESxGPUS_PER_NODE for XLA:GPU, e.g. 96x4 (default: nodes of 8 GPUs)")
    flags.DEFINE_float("price", None, "price per GPU-hour, for the cost")
    flags.DEFINE_float("mfu", None, "model FLOPs utilisation to assume (default: measured, else the reference run's)")
    flags.DEFINE_float("memory_fraction", DEFAULT_MEMORY_FRACTION,
                       "fraction of GPU memory JAX may use (XLA_PYTHON_CLIENT_MEM_FRACTION, as launch/env.sh sets it)")
    flags.DEFINE_float("pipeline_rate", PIPELINE_SAMPLES_PER_CORE_S, "input pipeline samples per CPU core-second")
    flags.DEFINE_bool("search_batch", True, "find the largest per-device batch that fits (a few compiles)")
    flags.DEFINE_bool("json", False, "print the plan as JSON")
    flags.mark_flags_as_required(["config"])


if __name__ == "__main__":
    from absl import app

    xla_gpu.prepare()  # before JAX loads its plugins
    _define_flags()
    app.run(main)
