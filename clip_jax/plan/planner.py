"""`plan`: compile the planned step, search its memory, count its FLOPs, model its speed, and return a `Plan`."""

import dataclasses
import math
from collections.abc import Callable

import jax

from clip_jax.errors import InvalidInput, UserError
from clip_jax.models import create_model, param_shapes
from clip_jax.models.flops import forward_flops
from clip_jax.models.precision import check_gpu_precision
from clip_jax.plan.cost import PIPELINE_SAMPLES_PER_CORE_S, default_mfu, gpu_table, run_length, samples_per_s_per_gpu
from clip_jax.plan.flops import analytic_only, flops_per_sample
from clip_jax.plan.memory import (BatchDoesNotFit, StepMemory, affine_fit, batch_bytes_per_device,
                                  largest_fitting_batch, memory_savers, smallest_accum, state_bytes_per_device)
from clip_jax.plan.report import size
from clip_jax.plan.result import (DataLoading, KernelRow, MemoryPerDevice, ParameterCounts, Plan, PredictedStep, Setup,
                                  StepProgram, Throughput)
from clip_jax.plan import step_time
from clip_jax.plan.steps import CompiledSteps, for_xla_cpu, planned_spec
from clip_jax.runtime import hlo_kernels, xla_gpu
from clip_jax.runtime.hardware import MEMORY_FRACTION, get_gpu
from clip_jax.runtime.mesh import create_mesh
from clip_jax.training.remat_choice import resolve_auto_remat
from clip_jax.training.step_factory import StepSpec, mesh_for

# The fraction of GPU memory JAX may take: launch/env.sh sets XLA_PYTHON_CLIENT_MEM_FRACTION to the same (JAX's own
# default is 0.75); plan with the fraction the run will have.
DEFAULT_MEMORY_FRACTION = MEMORY_FRACTION
MAX_SIMULATED_DEVICES = 4096


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
        raise InvalidInput("bad planner arguments:\n  " + "\n  ".join(problems))


def _parameter_counts(setup: StepSpec) -> ParameterCounts:
    shapes = param_shapes(create_model(setup.model))
    count = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
    image = count(shapes["visual"])
    logit_scale = count(shapes["logit_scale"])
    total = count(shapes)
    return ParameterCounts(total=total, image=image, text=total - image - logit_scale, logit_scale=logit_scale)


def plan(config, gpu_name: str, num_gpus: int, *, price: float | None = None, mfu: float | None = None,
         memory_fraction: float = DEFAULT_MEMORY_FRACTION, pipeline_rate: float = PIPELINE_SAMPLES_PER_CORE_S,
         compiler: str = "cpu", topology: str | None = None, devices=None, search_batch: bool = True,
         xla_flops: bool = True, max_num_patches: int | None = None,
         progress: Callable[[str], None] = lambda message: None) -> Plan:
    """The plan for training `config` on `num_gpus` GPUs of kind `gpu_name`.

    `compiler`: "gpu" compiles the step with XLA:GPU for `topology` ("NODESxGPUS", see `xla_gpu.parse_topology`)
    without a GPU; "cpu" with XLA:CPU over `devices`, one per GPU (default: the first `num_gpus` of
    `jax.devices()`). `xla_flops`: also count the FLOPs of XLA:CPU compiles of the step beside the analytic count
    (a check of it; the speed and cost use the analytic count either way). `max_num_patches`: a NaFlex image tower's
    patch budget per image, which it needs (any other tower refuses one).
    """
    gpu = get_gpu(gpu_name)
    if gpu.target is None:
        raise InvalidInput(f"planning for a {gpu.name} is not possible: the planner compiles with CUDA 13's jaxlib, "
                           "which has no Volta GPU (a V100 run needs CUDA 12's: pip install 'jax[cuda12]')")
    check_gpu_precision(config.precision, gpu)
    _check_arguments(num_gpus, price, mfu, memory_fraction, pipeline_rate)
    if compiler not in ("cpu", "gpu"):
        raise InvalidInput(f"compiler={compiler!r}: choose cpu or gpu")
    setup = planned_spec(config, compiler, gpu, max_num_patches)
    nodes = 1
    if compiler == "gpu":
        nodes, per_node = xla_gpu.parse_topology(topology, num_gpus)
        devices = xla_gpu.devices(gpu, nodes, per_node)
        where = f"{num_gpus} x {gpu.name} ({nodes} node{'s' * (nodes > 1)} x {per_node}, deviceless XLA:GPU)"
    else:
        devices = list(jax.devices()[:num_gpus] if devices is None else devices)
        where = f"{num_gpus} simulated device{'s' * (num_gpus > 1)}"
    if len(devices) != num_gpus:
        raise InvalidInput(f"planning for {num_gpus} GPUs needs {num_gpus} JAX devices, {len(devices)} are there: "
                           "run `python -m clip_jax.plan`, which simulates them, or set jax_num_cpu_devices first")
    batch_size, accum_freq = int(config.batch_size), int(config.accum_freq)
    if batch_size < 1 or accum_freq < 1 or batch_size % accum_freq:
        raise InvalidInput(f"batch_size={batch_size} (per device) must be a positive multiple of "
                           f"accum_freq={accum_freq}")
    mesh = mesh_for(setup, devices)
    budget = int(gpu.memory_bytes * memory_fraction)
    compiled_step = CompiledSteps(mesh, where, progress)

    def first_compiles(setup: StepSpec):
        setup, remat_choice = resolve_auto_remat(setup, mesh, batch_size, usable=budget,
                                                 compile_step=lambda s, b: compiled_step(s, b, accum_freq))
        return setup, remat_choice, StepMemory.of(compiled_step(setup, batch_size, accum_freq))

    notes = []
    try:
        setup, remat_choice, planned = first_compiles(setup)
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 -- XLA's and JAX's refusals of a step for this target
        if compiler != "gpu":
            raise
        setup, remat_choice, planned, note = _plan_without_cudnn(setup, error, gpu, first_compiles)
        notes.append(note)
        progress(note)
    if remat_choice is not None:
        progress(remat_choice.describe())
    memory_probes: dict[int, int] = {}

    def memory_of(b: int) -> int:
        memory_probes[b] = StepMemory.of(compiled_step(setup, b)).total
        return memory_probes[b]

    # Memory of the planned step, the largest batch, accumulation.
    if accum_freq == 1:
        memory_probes[batch_size] = planned.total
    try:
        largest = largest_fitting_batch(memory_of, budget, guess=batch_size) if search_batch else None
    except BatchDoesNotFit:
        raise BatchDoesNotFit(
            f"{setup.model.name} ({setup.describe()}) needs {size(memory_probes[1])} per device at a per-device "
            f"batch of 1 (compiled for {where}; train state {size(state_bytes_per_device(setup, mesh))}), more "
            f"than the {size(budget)} usable on a {gpu.name} ({gpu.memory_gib:.1f} GiB x {memory_fraction}). "
            f"Try {memory_savers(config)}") from None
    fits = planned.total <= budget
    accum_needed = accum_freq
    if not fits:
        start = max(accum_freq, -(-batch_size // largest)) if largest else accum_freq + 1
        fits_with = lambda k: StepMemory.of(compiled_step(setup, batch_size, k)).total <= budget
        accum_needed = smallest_accum(batch_size, start, fits_with)
    elif accum_freq > 1 and largest is not None and largest >= batch_size:
        accum_needed = 1  # the whole per-device batch fits without accumulating

    # What XLA:GPU's program does besides: its collectives and whether cuDNN's fused attention runs.
    step_program = predicted = None
    if compiler == "gpu":
        hlo = compiled_step(setup, batch_size, accum_needed or accum_freq).as_text()
        step_program = StepProgram(xla_gpu.collectives(hlo), xla_gpu.fused_attention(hlo))
        predicted = step_time.predict(hlo_kernels.kernels(hlo), step_time.KernelRates.of(gpu), nodes)

    # FLOPs, counted on the step without accumulation at the per-device micro-batch (by XLA:CPU, on one device
    # when XLA:GPU compiled the rest: its cost analysis is empty).
    micro_batch = batch_size // (accum_needed or accum_freq)
    if not xla_flops:
        flops = analytic_only(setup)
    elif compiler == "gpu":
        progress(f"counting FLOPs: XLA:CPU compiles of the step at per-device batch {micro_batch}")
        cpu_setup = for_xla_cpu(setup)
        flops = flops_per_sample(cpu_setup, create_mesh(jax.devices("cpu")[:1]), micro_batch)
    else:
        flops = flops_per_sample(setup, mesh, micro_batch, compile_step=lambda s: compiled_step(s, micro_batch))

    # Speed: predicted from XLA:GPU's program where there is one (a given --mfu wins), else the MFU rule. Then data
    # loading, time and cost.
    mfu_value, mfu_source = (mfu, "given (--mfu)") if mfu is not None else default_mfu(gpu, setup.precision)
    rule_rate = samples_per_s_per_gpu(mfu_value, gpu, setup.precision, flops.train_analytic)
    if (accum_needed or 1) > 1:  # features are computed twice: one more forward per sample
        rule_rate *= flops.train_analytic / (flops.train_analytic + forward_flops(setup.model, True, max_num_patches))
    predicted_rate = batch_size / predicted.seconds if predicted is not None else None
    rate = predicted_rate if predicted_rate is not None and mfu is None else rule_rate
    global_batch = batch_size * num_gpus
    run = run_length(config, global_batch, rate * num_gpus, num_gpus, price)
    fit = affine_fit(memory_probes)
    table = gpu_table(setup.precision, flops.train_analytic, mfu, memory_fraction, num_gpus, run,
                      exact=(gpu.name, largest), fit=fit)

    return Plan(
        config=getattr(config, "name", "") or "", model=setup.model.name, gpu=gpu.name, gpus=num_gpus,
        setup=Setup(precision=setup.precision, remat_policy=setup.remat_policy, fsdp=setup.fsdp,
                    attention=setup.attention_impl, batch_size=batch_size, accum_freq=accum_freq,
                    global_batch=global_batch, max_num_patches=max_num_patches),
        parameters=_parameter_counts(setup),
        flops_per_sample=flops,
        memory_per_device=MemoryPerDevice(
            compiler=compiler,
            measured_by=f"XLA:{compiler.upper()} memory analysis of the train step compiled for {where}",
            batch_size=batch_size, accum_freq=accum_freq, argument_bytes=planned.argument,
            output_bytes=planned.output, alias_bytes=planned.alias, temp_bytes=planned.temp,
            total_bytes=planned.total, state_bytes=state_bytes_per_device(setup, mesh),
            batch_bytes=batch_bytes_per_device(setup.model, batch_size, max_num_patches), gpu_bytes=gpu.memory_bytes,
            memory_fraction=memory_fraction, usable_bytes=budget, fits=fits,
            largest_batch=largest, largest_batch_compiles=len(memory_probes) if search_batch else 0,
            accum_freq_needed=accum_needed, bytes_per_sample_fit=fit[1] if fit else None),
        throughput=Throughput(mfu=mfu_value, mfu_source=mfu_source, peak_tflops=gpu.peak_tflops(setup.precision),
                              samples_per_s_per_gpu=rate, samples_per_s=rate * num_gpus,
                              mfu_rule_samples_per_s_per_gpu=rule_rate, predicted_samples_per_s=predicted_rate,
                              predicted_step_split=dict(predicted.split) if predicted is not None else None),
        step_program=step_program,
        data_loading=DataLoading(samples_per_core_s=pipeline_rate, cores_per_gpu=rate / pipeline_rate,
                                 workers_per_process=config.workers),
        run=run,
        gpu_table=table,
        predicted_step=predicted_step(predicted, gpu) if predicted is not None else None,
        notes=tuple(notes),
    )


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _plan_without_cudnn(setup: StepSpec, error: Exception, gpu, first_compiles):
    """XLA:GPU refused the step for this GPU. Where cuDNN's attention is what it refused, plan the step with XLA's
    attention and say so; otherwise one line naming what the compiler said."""
    reason = _first_line(error)
    if setup.attention_impl != "cudnn":
        raise InvalidInput(f"XLA:GPU cannot compile this step for the {gpu.name}: {reason}") from None
    try:
        compiled = first_compiles(dataclasses.replace(setup, attention_impl="xla"))
    except UserError:
        raise
    except Exception as second:  # noqa: BLE001
        raise InvalidInput(f"XLA:GPU cannot compile this step for the {gpu.name}: {reason} (nor with XLA's "
                           f"attention: {_first_line(second)})") from None
    note = (f"XLA:GPU cannot compile this step with cuDNN's fused attention for the {gpu.name} ({reason}): planned "
            "with XLA's attention, which the run needs too: set attention_impl='xla'")
    return (*compiled, note)


PROFILE_LENGTH = 15  # kernels in the deviceless profile


def predicted_step(predicted: step_time.StepTime, gpu) -> PredictedStep:
    """The plan's record of a predicted step: its slowest kernels, those without a cost rule, the untimed ones."""
    def row(timed: step_time.KernelTime) -> KernelRow:
        k = timed.kernel
        operation = step_time.model_operation(k.op_name) or k.opcode
        if k.callee:
            operation = f"{k.callee} ({operation})"
        return KernelRow(kernel=k.name, part=timed.part, operation=operation,
                         runs=k.runs, seconds=timed.seconds, share=timed.seconds / predicted.seconds,
                         bound=timed.bound)

    fit = step_time.H200_FIT
    calibration = f"efficiencies fitted on {fit.fitted_on}"
    if gpu.name != "h200":
        calibration += f", applied to the {gpu.name}'s datasheet peaks and memory bandwidth: not measured on one"
    return PredictedStep(seconds=predicted.seconds, calibration=calibration,
                         slowest=tuple(row(k) for k in predicted.slowest(PROFILE_LENGTH)),
                         unknown=tuple(row(k) for k in predicted.unknown),
                         unmeasured=tuple(row(k) for k in predicted.unmeasured))
