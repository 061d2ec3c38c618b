"""Accelerators we plan for: memory and dense peak matmul throughput.

Peaks are the vendors' datasheet figures for dense tensor-core math (without sparsity). Memory is the total that
`nvidia-smi` reports for the card (in MiB), which is what an allocator can ever see.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_mib: int  # total memory as nvidia-smi reports it
    bf16_tflops: float  # dense BF16 tensor-core peak
    tf32_tflops: float  # dense TF32 tensor-core peak (what fp32 matmuls run at by default)
    kind_patterns: tuple[str, ...]  # substrings of jax's device_kind that identify it

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * 2**20

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024

    def peak_tflops(self, precision: str) -> float:
        return self.tf32_tflops if precision == "fp32" else self.bf16_tflops


GPUS = {
    "a100-40gb": GPU("a100-40gb", 40960, 312, 156, ("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB")),
    "a100-80gb": GPU("a100-80gb", 81920, 312, 156, ("A100-SXM4-80GB", "A100 80GB", "A100-PCIE-80GB")),
    "h100": GPU("h100", 81559, 989, 494.5, ("H100",)),
    "h200": GPU("h200", 143771, 989, 494.5, ("H200",)),
    "b200": GPU("b200", 183359, 2250, 1100, ("B200",)),
    "l40s": GPU("l40s", 46068, 362, 183, ("L40S",)),
    "rtx4090": GPU("rtx4090", 24564, 165, 82.6, ("RTX 4090",)),
}


def get_gpu(name: str) -> GPU:
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[name]


def gpu_for_device_kind(device_kind: str) -> GPU | None:
    """The GPU whose pattern appears in jax's `device.device_kind` (e.g. "NVIDIA H100 80GB HBM3"); None if unknown."""
    for gpu in GPUS.values():
        if any(pattern in device_kind for pattern in gpu.kind_patterns):
            return gpu
    return None
