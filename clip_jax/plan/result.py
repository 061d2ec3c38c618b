"""What a plan is: frozen values, one per part of the report.

`dataclasses.asdict(plan)` is the planner's JSON (`--json`): field names and order here are its keys, so a change
here changes what machines read. `Plan.from_dict` reads such JSON back (a saved plan can be reported again).
"""

import dataclasses

from clip_jax.plan.flops import FlopsPerSample
from clip_jax.runtime.xla_gpu import Collectives


@dataclasses.dataclass(frozen=True)
class Setup:
    """The planned step as the trainer would run it."""

    precision: str
    remat_policy: str
    fsdp: bool
    attention: str
    batch_size: int  # per device
    accum_freq: int
    global_batch: int
    max_num_patches: int | None = None  # a NaFlex image tower's patch budget per image


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
    total: int
    image: int
    text: int
    logit_scale: int


@dataclasses.dataclass(frozen=True)
class MemoryPerDevice:
    """XLA's memory analysis of the planned step, the budget it has to fit, and what the search found."""

    compiler: str  # "gpu" or "cpu": who compiled the step
    measured_by: str
    batch_size: int
    accum_freq: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    total_bytes: int
    state_bytes: int
    batch_bytes: int
    gpu_bytes: int
    memory_fraction: float
    usable_bytes: int
    fits: bool
    largest_batch: int | None  # None: not searched
    largest_batch_compiles: int
    accum_freq_needed: int | None  # None: no accumulation makes the batch fit
    bytes_per_sample_fit: float | None  # the affine fit's slope, None with fewer than two compiles


@dataclasses.dataclass(frozen=True)
class Throughput:
    """The speed the run's length is computed at: predicted from the compiled XLA:GPU program where there is one
    (`predicted_*`), else the MFU rule (MFU x peak / model FLOPs). `mfu` and `mfu_source` are the rule's either way."""

    mfu: float
    mfu_source: str
    peak_tflops: float
    samples_per_s_per_gpu: float  # the speed used: the prediction where there is one, else the MFU rule's
    samples_per_s: float
    mfu_rule_samples_per_s_per_gpu: float | None = None
    predicted_samples_per_s: float | None = None  # per GPU, from the compiled program (clip_jax.plan.step_time)
    predicted_step_split: dict[str, float] | None = None  # seconds per step: step_time.CLASSES


@dataclasses.dataclass(frozen=True)
class KernelRow:
    """One kernel of the predicted step (a line of the deviceless profile)."""

    kernel: str  # the HLO instruction
    part: str  # one of clip_jax.plan.step_time.CLASSES
    operation: str  # the model operation it comes from (the HLO's op_name, shortened)
    runs: int  # per step
    seconds: float  # per step, every run, launches not counted
    share: float  # of the predicted step
    bound: str  # "compute", "memory" or "link"


@dataclasses.dataclass(frozen=True)
class PredictedStep:
    """The step's time predicted from its compiled XLA:GPU program."""

    seconds: float
    calibration: str  # where the efficiencies come from, and whether this GPU was measured
    slowest: tuple[KernelRow, ...]  # the kernels with the most predicted time
    unknown: tuple[KernelRow, ...]  # kernels without a cost rule, costed as memory-bound elementwise work
    unmeasured: tuple[KernelRow, ...] = ()  # Pallas kernels no lease has timed, at the fitted memory-bound efficiency


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """What XLA:GPU's compiled step does besides computing: its collectives and cuDNN's fused attention."""

    collectives: Collectives  # per device and step
    fused_attention_calls: dict[str, int]  # "forward", "backward": call sites


@dataclasses.dataclass(frozen=True)
class DataLoading:
    samples_per_core_s: float
    cores_per_gpu: float
    workers_per_process: int


@dataclasses.dataclass(frozen=True)
class RunLength:
    """`epochs x train_num_samples` in whole steps, as the trainer counts them, and what they take."""

    epochs: int
    samples_per_epoch: int
    samples: int
    steps: int
    samples_in_steps: int
    seconds: float
    days: float
    gpu_hours: float
    price_per_gpu_hour: float | None
    cost: float | None


@dataclasses.dataclass(frozen=True)
class GpuRow:
    """One known GPU under the same MFU rule: speed, the largest batch and the run's days."""

    gpu: str
    memory_gib: float
    bf16_tflops: float
    tf32_tflops: float
    mfu: float
    samples_per_s_per_gpu: float
    largest_batch: int | None
    largest_batch_from: str  # "compiled", "affine fit" or "unknown"
    days: float | None


@dataclasses.dataclass(frozen=True)
class Plan:
    config: str
    model: str
    gpu: str
    gpus: int
    setup: Setup
    parameters: ParameterCounts
    flops_per_sample: FlopsPerSample
    memory_per_device: MemoryPerDevice
    throughput: Throughput
    step_program: StepProgram | None  # XLA:GPU only
    data_loading: DataLoading
    run: RunLength | None  # None without train_num_samples
    gpu_table: tuple[GpuRow, ...]
    predicted_step: PredictedStep | None = None  # XLA:GPU only
    notes: tuple[str, ...] = ()  # what the planner changed to make a plan, in words

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """The plan of `dataclasses.asdict(plan)` (or of its JSON)."""
        program = d["step_program"]
        if program is not None:
            program = StepProgram(Collectives(**program["collectives"]), program["fused_attention_calls"])
        predicted = d.get("predicted_step")
        if predicted is not None:
            rows = lambda key: tuple(KernelRow(**row) for row in predicted[key])
            predicted = PredictedStep(predicted["seconds"], predicted["calibration"], rows("slowest"), rows("unknown"),
                                      rows("unmeasured") if "unmeasured" in predicted else ())
        return cls(d["config"], d["model"], d["gpu"], d["gpus"], Setup(**d["setup"]),
                   ParameterCounts(**d["parameters"]), FlopsPerSample(**d["flops_per_sample"]),
                   MemoryPerDevice(**d["memory_per_device"]), Throughput(**d["throughput"]), program,
                   DataLoading(**d["data_loading"]), None if d["run"] is None else RunLength(**d["run"]),
                   tuple(GpuRow(**row) for row in d["gpu_table"]), predicted, tuple(d.get("notes", ())))
