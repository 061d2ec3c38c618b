"""The resource planner: what fits on a GPU, how fast it runs, how long the run takes and what it costs.

    python -m clip_jax.plan --config configs/l14_laion2b.py --gpu a100-40gb --gpus 384 [--price 2.0] [--json]
    python -m clip_jax.plan --config configs/l14_laion2b.py --gpu h100 --gpus 64 --config.precision=fp32

Measured and modelled, as the output labels them:

- parameters: counted from the parameter tree;
- memory per device: XLA's memory analysis of the train step `clip_jax.train` runs, compiled for the planned number
  of devices with abstract inputs, so nothing is allocated. With jaxlib's CUDA plugin installed (`.[gpu]`) XLA:GPU
  compiles it for the planned GPU and topology without a GPU (`clip_jax.runtime.xla_gpu`; how close it came to the
  allocator's peak on an H200: benchmarks/RESULTS.md section 8); otherwise XLA:CPU does, over one simulated device
  per GPU, whose fusions and attention (no cuDNN) differ: an estimate that runs far higher (RESULTS section 7);
- the largest per-device batch: bisection on that compiled memory;
- with XLA:GPU, the collectives of the step (count and bytes per device, loop trips counted) and cuDNN's fused
  attention;
- FLOPs per sample: analytic (`clip_jax.models.flops`) and XLA:CPU's cost analysis of the compiled programs (XLA:GPU
  gives none);
- speed: with XLA:GPU, predicted from the compiled program (`step_time`: each kernel's FLOPs or bytes at rates
  fitted on H200 measurements, a launch cost, collectives at the links' datasheet speed), with the step split by
  part and the kernels that take longest; otherwise (or with `--mfu`) samples/s = MFU x peak FLOP/s / model FLOPs
  per sample, at a stated MFU;
- data loading: the input pipeline's measured rate per CPU core;
- time, GPU-hours and cost: arithmetic on the above.

The modules, in the order a plan is made: `steps` (the trainer's step, compiled through
`clip_jax.training.step_factory`), `memory` (XLA's memory analysis and the searches over it), `flops` (XLA's FLOPs with
every scanned block counted), `step_time` (the step's time from its kernels), `cost` (the MFU rule, the run's length,
other GPUs), `planner` (`plan`, which returns a `Plan` of `result`'s frozen values), `report` (the text and the
JSON), and `__main__` (the command line).
"""

from clip_jax.plan.flops import FlopsPerSample, flops_per_sample
from clip_jax.plan.memory import (BatchDoesNotFit, StepMemory, batch_bytes_per_device, largest_fitting_batch,
                                  state_bytes_per_device)
from clip_jax.plan.planner import DEFAULT_MEMORY_FRACTION, plan
from clip_jax.plan.report import format_plan, plan_json
from clip_jax.plan.result import Plan
from clip_jax.plan.steps import compile_train_step

__all__ = [
    "BatchDoesNotFit", "DEFAULT_MEMORY_FRACTION", "FlopsPerSample", "Plan", "StepMemory", "batch_bytes_per_device",
    "compile_train_step", "flops_per_sample", "format_plan", "largest_fitting_batch", "plan", "plan_json",
    "state_bytes_per_device",
]
