"""Accelerators we plan for: memory, dense peak matmul throughput, and the device properties XLA:GPU compiles for.

Peaks are the vendors' datasheet figures for dense tensor-core math (without sparsity). Memory is the total that
`nvidia-smi` reports for the card (in MiB), which is what an allocator can ever see.

`GpuTarget` holds what XLA:GPU's target config is made of (what `cudaGetDeviceProperties` reports, plus the
memory bandwidth), so that `clip_jax.runtime.xla_gpu` can compile the train step for a GPU on a machine without
one. Each target names its source: the CUDA programming guide's table of limits per compute capability (shared memory,
threads, registers), the product's datasheet (multiprocessors, clock, L2, bandwidth), and for the H200 what was
read off one (benchmarks/gpu_device_info.py, nvidia-smi).
"""

import dataclasses

from clip_jax.errors import InvalidInput


@dataclasses.dataclass(frozen=True)
class ComputeCapabilityLimits:
    """Per-multiprocessor and per-block limits that depend only on the compute capability."""

    shared_memory_per_core: int  # bytes per multiprocessor
    shared_memory_per_block_optin: int  # the most one block may opt in to
    threads_per_core_limit: int
    fpus_per_core: int  # FP32 lanes per multiprocessor


LIMITS = {  # CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"
    (7, 5): ComputeCapabilityLimits(65536, 65536, 1024, 64),
    (8, 0): ComputeCapabilityLimits(167936, 166912, 2048, 64),
    (8, 9): ComputeCapabilityLimits(102400, 101376, 1536, 128),
    (9, 0): ComputeCapabilityLimits(233472, 232448, 2048, 128),
    (10, 0): ComputeCapabilityLimits(233472, 232448, 2048, 128),
}


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """The device properties of an XLA:GPU target config (`GpuTargetConfig` text proto)."""

    compute_capability: tuple[int, int]
    multiprocessors: int
    clock_ghz: float  # boost clock of the multiprocessors
    l2_cache_bytes: int
    memory_bandwidth: float  # bytes/s
    source: str
    dnn_version: tuple[int, int] = (9, 10)  # cuDNN the plugin compiles against (its fused attention needs >= 8.9)
    runtime_version: tuple[int, int] = (13, 0)

    def config_proto(self, memory_bytes: int, name: str) -> str:
        limits = LIMITS[self.compute_capability]
        major, minor = self.compute_capability
        fields = {
            "threads_per_block_limit": 1024, "threads_per_warp": 32, "shared_memory_per_block": 49152,
            "shared_memory_per_core": limits.shared_memory_per_core,
            "threads_per_core_limit": limits.threads_per_core_limit, "core_count": self.multiprocessors,
            "fpus_per_core": limits.fpus_per_core, "block_dim_limit_x": 2**31 - 1, "block_dim_limit_y": 65535,
            "block_dim_limit_z": 65535, "memory_bandwidth": int(self.memory_bandwidth),
            "l2_cache_size": self.l2_cache_bytes, "clock_rate_ghz": self.clock_ghz,
            "device_memory_size": memory_bytes,
            "shared_memory_per_block_optin": limits.shared_memory_per_block_optin,
            "registers_per_core_limit": 65536, "registers_per_block_limit": 65536,
        }
        info = " ".join(f"{key}: {value}" for key, value in fields.items())
        return (f"gpu_device_info {{ {info} cuda_compute_capability {{ major: {major} minor: {minor} }} }}\n"
                f'platform_name: "CUDA"\n'
                f"dnn_version_info {{ major: {self.dnn_version[0]} minor: {self.dnn_version[1]} }}\n"
                f"runtime_version {{ major: {self.runtime_version[0]} minor: {self.runtime_version[1]} }}\n"
                f'device_description_str: "{name}"\n')


_DATASHEET = ("CUDA limits for compute capability {}; multiprocessors, boost clock, L2 and bandwidth: NVIDIA's {} "
              "datasheet")


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_mib: int  # total memory as nvidia-smi reports it
    bf16_tflops: float  # dense BF16 tensor-core peak (0: no bfloat16 tensor cores, before Ampere)
    tf32_tflops: float  # dense TF32 tensor-core peak (what fp32 matmuls run at by default; before Ampere, FP32's)
    kind_patterns: tuple[str, ...]  # substrings of jax's device_kind that identify it
    target: GpuTarget | None = None  # for deviceless XLA:GPU compiles
    link_bytes_per_s: float = 32e9  # to another GPU of its node, one direction: NVLink, else PCIe 4.0 x16 (datasheets)
    fp16_tflops: float | None = None  # dense FP16 tensor-core peak, where it is not the BF16 one

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * 2**20

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024

    @property
    def has_fp8(self) -> bool:
        """FP8 tensor-core matmuls: compute capability 8.9 (Ada) and later."""
        return self.target is not None and self.target.compute_capability >= (8, 9)

    @property
    def has_bf16(self) -> bool:
        """bfloat16 tensor-core matmuls: compute capability 8.0 (Ampere) and later."""
        return self.bf16_tflops > 0

    def peak_tflops(self, precision: str) -> float:
        # fp8's MFU counts against the bf16 peak, so that it compares with bf16's
        if precision == "fp32":
            return self.tf32_tflops
        if precision == "fp16":
            return self.fp16_tflops or self.bf16_tflops
        return self.bf16_tflops

    def target_config(self) -> str:
        """The `GpuTargetConfig` text proto XLA:GPU compiles for."""
        if self.target is None:
            raise InvalidInput(f"no XLA:GPU target config for {self.name}; known: "
                             f"{', '.join(name for name, gpu in GPUS.items() if gpu.target)}")
        return self.target.config_proto(self.memory_bytes, f"NVIDIA {self.kind_patterns[0]}")


# The share of a GPU's memory a training process lets JAX take (launch/env.sh sets XLA_PYTHON_CLIENT_MEM_FRACTION to it)
# and the planner plans with.
MEMORY_FRACTION = 0.92

A100_TARGET = dict(compute_capability=(8, 0), multiprocessors=108, clock_ghz=1.41, l2_cache_bytes=40 * 2**20)
GPUS = {
    "a100-40gb": GPU("a100-40gb", 40960, 312, 156, ("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB"),
                     GpuTarget(**A100_TARGET, memory_bandwidth=1.555e12, source=_DATASHEET.format("8.0", "A100")),
                     link_bytes_per_s=300e9),
    "a100-80gb": GPU("a100-80gb", 81920, 312, 156, ("A100-SXM4-80GB", "A100 80GB", "A100-PCIE-80GB"),
                     GpuTarget(**A100_TARGET, memory_bandwidth=2.039e12, source=_DATASHEET.format("8.0", "A100")),
                     link_bytes_per_s=300e9),
    "h100": GPU("h100", 81559, 989, 494.5, ("H100",),
                GpuTarget((9, 0), 132, 1.98, 50 * 2**20, 3.35e12, _DATASHEET.format("9.0", "H100 SXM")),
                link_bytes_per_s=450e9),
    "h200": GPU("h200", 143771, 989, 494.5, ("H200",),
                GpuTarget((9, 0), 132, 1.98, 60 * 2**20, 4.8e12,
                          "read off an H200 (2026-11-30): 132 multiprocessors, 60 MiB L2, 143,771 MiB, 1,980 MHz "
                          "SM clock, compute capability 9.0; CUDA limits for 9.0; bandwidth: NVIDIA's datasheet"),
                link_bytes_per_s=450e9),
    "b200": GPU("b200", 183359, 2250, 1100, ("B200",),
                GpuTarget((10, 0), 148, 1.965, 126 * 2**20, 8.0e12, _DATASHEET.format("10.0", "B200")),
                link_bytes_per_s=900e9),
    "l40s": GPU("l40s", 46068, 362, 183, ("L40S",),
                GpuTarget((8, 9), 142, 2.52, 96 * 2**20, 0.864e12, _DATASHEET.format("8.9", "L40S"))),
    "rtx4090": GPU("rtx4090", 24564, 165, 82.6, ("RTX 4090",),
                   GpuTarget((8, 9), 128, 2.52, 72 * 2**20, 1.008e12, _DATASHEET.format("8.9", "GeForce RTX 4090"))),
    # Before Ampere: no bfloat16 (`fp16` is their mixed precision) and no TF32 (fp32 at the FP32 peak)
    "t4": GPU("t4", 15360, 0, 8.1, ("T4",),
              GpuTarget((7, 5), 40, 1.59, 4 * 2**20, 320e9, _DATASHEET.format("7.5", "T4")),
              link_bytes_per_s=16e9, fp16_tflops=65),  # PCIe 3.0 x16
    # no target: CUDA 13, which the planner's jaxlib is built with, has no Volta (a V100 run takes CUDA 12's jaxlib)
    "v100": GPU("v100", 32510, 0, 15.7, ("V100",), link_bytes_per_s=150e9, fp16_tflops=125),
}


def device_compute_capability(device) -> tuple[int, int] | None:
    """A jax GPU device's compute capability (its `compute_capability`, "9.0"); None for other devices."""
    text = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    return tuple(int(part) for part in str(text).split(".")[:2]) if text else None


def get_gpu(name: str) -> GPU:
    if name not in GPUS:
        raise InvalidInput(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[name]


def gpu_for_device_kind(device_kind: str) -> GPU | None:
    """The GPU whose pattern appears in jax's `device.device_kind` (e.g. "NVIDIA H100 80GB HBM3"); None if unknown."""
    for gpu in GPUS.values():
        if any(pattern in device_kind for pattern in gpu.kind_patterns):
            return gpu
    return None


def peak_flops(device_kind: str, precision: str, given_tflops: float = 0.0) -> float | None:
    """The FLOP/s a run's MFU is quoted against: `given_tflops` when set (a config's `peak_tflops_per_device`), else
    the datasheet peak of the GPU `device_kind` names for `precision`; None for a device no table knows."""
    if given_tflops:
        return given_tflops * 1e12
    gpu = gpu_for_device_kind(device_kind)
    return gpu.peak_tflops(precision) * 1e12 if gpu else None
