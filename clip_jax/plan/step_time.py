"""How long the compiled step takes on a GPU, predicted from its kernels without one.

Each kernel of the XLA:GPU program (`clip_jax.runtime.hlo_kernels`) is a roofline: the larger of its FLOPs over the
rate of its kind (matrix products by operand type, cuDNN's fused attention) and its bytes over the memory
bandwidth; every kernel run adds a launch cost, and a collective its bytes over the link it crosses. A kernel of the
program's own (a Pallas custom call) moves its operand and result bytes at the rate a lease measured for it or, until
one has, at the fitted memory-bound efficiency: then it is reported as unmeasured. The rates are a GPU's datasheet
figures times efficiencies fitted on measured steps (`H200_FIT`: one H200, the fit and its rows in
benchmarks/step_time_model.py and benchmarks/RESULTS.md section 29). For another GPU the same efficiencies scale its
own datasheet: a prediction, not a measurement of that GPU.

The step's time is the sum over kernels: XLA:GPU runs one stream of kernels for a step on one GPU. Collectives are
added, not overlapped with compute (an upper bound for a step whose collectives XLA schedules asynchronously).
"""

import dataclasses
import re

from clip_jax.runtime.hardware import GPU
from clip_jax.runtime.hlo_kernels import Kernel

# The parts of the step, as the planner reports them.
CLASSES = ("gemm", "attention", "elementwise", "optimizer", "custom_calls", "collectives", "launch")
FP8_OVER_BF16 = 2.0  # the dense FP8 tensor-core peak over the BF16 one (Hopper's and Ada's datasheets)
# Between nodes: one InfiniBand HDR port (200 Gb/s) per GPU, the reference run's cluster (JUWELS Booster). Assumed:
# nothing here measured a link.
INTER_NODE_BYTES_PER_S = 25e9
# Bytes on the wire per byte of the collective's buffer, for large groups: a ring all-reduce sends its buffer twice
# (reduce-scatter, then all-gather); the others once.
WIRE_FACTOR = {"all-reduce": 2.0}


@dataclasses.dataclass(frozen=True)
class Efficiencies:
    """Achieved rates as fractions of a GPU's datasheet figures, fitted on one GPU's measured steps."""

    gemm_16bit: float  # bf16/fp16 (and FP8, at FP8_OVER_BF16 x) products, of the dense BF16 peak
    gemm_tf32: float  # float32 products (TF32 tensor cores), of the dense TF32 peak
    attention: float  # cuDNN's fused attention, of the dense BF16 peak
    memory: float  # memory-bound kernels, of the memory bandwidth
    launch_us: float  # per kernel run
    fitted_on: str
    # Pallas kernels a lease timed: {kernel name: its bytes per second, of the memory bandwidth}. Those not here are
    # priced at `memory` and reported as unmeasured.
    custom_calls: dict[str, float] = dataclasses.field(default_factory=dict)


# benchmarks/step_time_model.py on the ViT-L/14 steps measured on one H200 (2026-11-30 and 2026-12-04).
H200_FIT = Efficiencies(gemm_16bit=0.731, gemm_tf32=0.674, attention=0.129, memory=0.640, launch_us=4.11,
                        fitted_on="ViT-L/14 train steps on one H200 (14 settings, 2 kernel profiles; "
                                  "benchmarks/RESULTS.md section 29)")


@dataclasses.dataclass(frozen=True)
class KernelRates:
    """What one GPU does per second: FLOPs by product type, attention FLOPs, bytes to and from memory, bytes over
    its links; and the cost of one kernel launch."""

    gemm_flops: dict[str, float]  # by operand element type: "bf16", "f16", "f32", "f8"
    attention_flops: float
    memory_bytes: float
    launch_s: float
    link_bytes: float  # within a node
    inter_node_bytes: float
    custom_call_bytes: dict[str, float] = dataclasses.field(default_factory=dict)  # measured, by kernel name

    @classmethod
    def of(cls, gpu: GPU, efficiencies: Efficiencies = H200_FIT) -> "KernelRates":
        if gpu.target is None:
            raise ValueError(f"no memory bandwidth is known for {gpu.name}: it has no XLA:GPU target")
        bf16, f16 = (tflops * 1e12 * efficiencies.gemm_16bit for tflops in (gpu.bf16_tflops, gpu.peak_tflops("fp16")))
        return cls(gemm_flops={"bf16": bf16, "f16": f16, "f8": FP8_OVER_BF16 * bf16,
                               "f32": gpu.tf32_tflops * 1e12 * efficiencies.gemm_tf32},
                   # 16-bit attention: float16's peak where a GPU has no bfloat16 (before Ampere)
                   attention_flops=(gpu.bf16_tflops or gpu.peak_tflops("fp16")) * 1e12 * efficiencies.attention,
                   memory_bytes=gpu.target.memory_bandwidth * efficiencies.memory,
                   launch_s=efficiencies.launch_us * 1e-6, link_bytes=gpu.link_bytes_per_s,
                   inter_node_bytes=INTER_NODE_BYTES_PER_S,
                   custom_call_bytes={name: gpu.target.memory_bandwidth * share
                                      for name, share in efficiencies.custom_calls.items()})


@dataclasses.dataclass(frozen=True)
class KernelTime:
    kernel: Kernel
    part: str  # one of CLASSES (not "launch")
    seconds: float  # per step, every run counted, launches not
    bound: str  # "compute", "memory" or "link"
    measured: bool = True  # False: a custom call no lease has timed, priced at the fitted memory-bound efficiency


@dataclasses.dataclass(frozen=True)
class StepTime:
    """The predicted step: seconds in all, by part, and by kernel."""

    seconds: float
    split: dict[str, float]  # CLASSES -> seconds per step
    kernels: tuple[KernelTime, ...]

    @property
    def unknown(self) -> tuple[KernelTime, ...]:
        """Kernels the reader has no rule for, costed as memory-bound elementwise work."""
        return tuple(k for k in self.kernels if not k.kernel.known)

    @property
    def unmeasured(self) -> tuple[KernelTime, ...]:
        """Custom calls (Pallas kernels) no lease has timed, priced at the fitted memory-bound efficiency."""
        return tuple(k for k in self.kernels if not k.measured)

    def slowest(self, n: int = 15) -> list[KernelTime]:
        return sorted(self.kernels, key=lambda k: -k.seconds)[:n]


def part_of(kernel: Kernel, training: bool = True) -> str:
    """The part of the step a kernel belongs to. In a training step (`training`: the program differentiates), the
    optimizer's are the memory-bound kernels outside the differentiated model and loss (the AdamW update, its
    norms, the non-finite check: no `jvp(` in their names)."""
    if kernel.kind == "collective":
        return "collectives"
    if kernel.kind in ("gemm", "attention"):
        return kernel.kind
    if kernel.kind == "custom_call":
        return "custom_calls"
    return "optimizer" if training and kernel.op_name and "jvp(" not in kernel.op_name else "elementwise"


def kernel_seconds(kernel: Kernel, rates: KernelRates, nodes: int = 1) -> tuple[float, str]:
    """(seconds per run, what bounds it) for one kernel, launch not counted."""
    memory = kernel.bytes / rates.memory_bytes
    if kernel.kind == "collective":
        link = rates.inter_node_bytes if nodes > 1 else rates.link_bytes
        return kernel.bytes * WIRE_FACTOR.get(kernel.opcode, 1.0) / link, "link"
    if kernel.kind == "custom_call":
        return kernel.bytes / rates.custom_call_bytes.get(kernel.callee, rates.memory_bytes), "memory"
    if kernel.kind == "gemm":
        compute = kernel.flops / rates.gemm_flops.get(kernel.dtype, rates.gemm_flops["f32"])
    elif kernel.kind == "attention":
        compute = kernel.flops / rates.attention_flops
    else:
        compute = 0.0
    return (compute, "compute") if compute >= memory else (memory, "memory")


def predict(kernels: list[Kernel], rates: KernelRates, nodes: int = 1) -> StepTime:
    """The step's predicted time on a GPU of `rates`, in a cluster of `nodes` nodes."""
    timed, split = [], dict.fromkeys(CLASSES, 0.0)
    training = any("jvp(" in kernel.op_name for kernel in kernels)
    for kernel in kernels:
        seconds, bound = kernel_seconds(kernel, rates, nodes)
        part = part_of(kernel, training)
        measured = kernel.kind != "custom_call" or kernel.callee in rates.custom_call_bytes
        timed.append(KernelTime(kernel, part, seconds * kernel.runs, bound, measured))
        split[part] += seconds * kernel.runs
        split["launch"] += rates.launch_s * kernel.runs
    return StepTime(sum(split.values()), split, tuple(timed))


# op_name components that are JAX's plumbing, not the model's: transformations, the scan's loop, remat's wrappers
WRAPPERS = re.compile(r"^(?:jit|jvp|transpose|vmap|pjit|checkpoint|remat)\(.*\)$")
PLUMBING = frozenset({"while", "body", "cond", "closed_call", "checkpoint", "rematted_computation", "eval_jaxpr"})
TOWERS = {"CLIP.encode_image": "image", "CLIP.encode_text": "text"}


def model_operation(op_name: str) -> str:
    """The model's part of an HLO op_name: "jit(step)/transpose(jvp(CLIP))/CLIP.encode_image/visual/transformer/
    while/body/closed_call/checkpoint/resblocks/mlp/c_fc/dot_general" -> "image/transformer/resblocks/mlp/c_fc/
    dot_general (backward)"."""
    parts = []
    for part in op_name.split("/"):
        if WRAPPERS.match(part) or part in PLUMBING or (part == "visual" and parts[-1:] == ["image"]):
            continue
        parts.append(TOWERS.get(part, part))
    name = "/".join(parts)
    return f"{name} (backward)" if "transpose(" in op_name else name
