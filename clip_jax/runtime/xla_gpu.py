"""XLA:GPU without a GPU: compile for a cluster of GPUs on any machine, and read the compiled step.

jaxlib's CUDA plugin (`pip install -e '.[gpu]'`) compiles for GPUs it is only told about: a target config (the
device properties of `clip_jax.runtime.hardware.GpuTarget`) and a topology (nodes x GPUs per node) give compile-only
devices to build a mesh over; `jit(...).lower(abstract inputs)` then compiles as on the cluster. What such a
compile says is XLA:GPU's own: memory per device (its memory analysis; cuDNN's attention keeps no score matrix),
the collectives it emits, the kernels it calls. It cannot time anything, and its cost analysis is empty.

Two settings make it work on a machine without a driver: the plugin's start-up check of the CUDA installation must
be skipped (`JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`, read once when JAX loads its plugins: `prepare` sets it), and
the compiler must not autotune or pick Triton GEMMs, which need a device (`DEVICELESS_OPTIONS`; with the flags the
project adopts, `ADOPTED_FLAGS`, they are the `COMPILER_OPTIONS` `compile_lowered` gives every compile).

The same plugin, installed on a machine without a GPU, makes JAX print its start-up check's failure (`cuInit(0)
failed`) as an error-level traceback before it goes on with the CPU: `quiet_cuda_plugin` (`clip_jax.cuda_plugin`,
which `import clip_jax` installs; the commands call it here too) drops it there.
"""

import dataclasses
import importlib.util
import os
import re

from clip_jax.cuda_plugin import PLUGINS, nvidia_gpu_present, quiet_cuda_plugin  # noqa: F401 (the commands' names)
from clip_jax.errors import InvalidInput, RunFailed
from clip_jax.runtime import hlo_kernels
from clip_jax.runtime.hlo_text import parse as parse_hlo
from clip_jax.runtime.hardware import GPU

SKIP_CHECK_ENV = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
# The XLA:GPU flags the project adopts, the one list of them: the compiles here take them as compiler options, a
# GPU run as XLA_FLAGS (launch/env.sh reads `python -m clip_jax.runtime.xla_gpu`; the GPU suite's runs take them,
# each flag with a spec of its numerics, benchmarks/gpu_suite.py).
# - Triton's multi-output fusions: the LayerNorm backward's row sums in one kernel with its input gradient
#   (benchmarks/RESULTS.md section 34: 32 GB a step less for ViT-L/14 with dots_saveable at 256 on an H200).
ADOPTED_FLAGS = {"xla_gpu_unsupported_enable_triton_multi_output_fusion": True}
# What a compile without a GPU needs besides: no autotuning and no Triton GEMMs (both time kernels on the device).
DEVICELESS_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}
COMPILER_OPTIONS = {**ADOPTED_FLAGS, **DEVICELESS_OPTIONS}
INSTALL_HINT = "pip install -e '.[gpu]' (jaxlib's CUDA plugin and NVIDIA's libraries, about 4.4 GB of wheels)"
GPUS_PER_NODE = 8  # the default topology's node size, when it divides the GPU count


class CudaPluginMissing(RunFailed):
    """XLA:GPU was asked for and jaxlib's CUDA plugin is not installed or not loaded."""


def cuda_plugin_installed() -> bool:
    return any(_module_exists(name) for name in PLUGINS)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def prepare() -> None:
    """Let the CUDA plugin load without a GPU. Call before JAX first initialises its backends."""
    os.environ.setdefault(SKIP_CHECK_ENV, "1")


def parse_topology(text: str | None, num_gpus: int) -> tuple[int, int]:
    """(nodes, GPUs per node) from "NODESxGPUS" (e.g. "96x4"); by default nodes of 8 GPUs, or one node when 8 does
    not divide the count. Raises ValueError when the topology is malformed or does not hold `num_gpus` GPUs."""
    if text is None:
        per_node = GPUS_PER_NODE if num_gpus % GPUS_PER_NODE == 0 else num_gpus
        return num_gpus // per_node, per_node
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", text)
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise InvalidInput(f"topology {text!r}: write it as NODESxGPUS_PER_NODE, e.g. 96x4")
    nodes, per_node = int(match[1]), int(match[2])
    if nodes * per_node != num_gpus:
        raise InvalidInput(f"topology {text} holds {nodes * per_node} GPUs, not the {num_gpus} of --gpus: "
                         f"give --gpus {nodes * per_node}, or a topology whose nodes x GPUs per node is {num_gpus}")
    return nodes, per_node


def devices(gpu: GPU, nodes: int, gpus_per_node: int) -> list:
    """Compile-only devices for `nodes` x `gpus_per_node` GPUs of kind `gpu`, one per process's GPU."""
    target_config = gpu.target_config()  # a clear error for a GPU without one
    if not cuda_plugin_installed():
        raise CudaPluginMissing(f"XLA:GPU needs jaxlib's CUDA plugin, which is not installed: {INSTALL_HINT}")
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                                topology=f"1x{nodes}x{gpus_per_node}")
    except NotImplementedError:
        raise CudaPluginMissing(
            f"jaxlib's CUDA plugin is installed but did not load (no GPU here?): set {SKIP_CHECK_ENV}=1 before "
            "JAX starts (python -m clip_jax.plan does)") from None
    return list(topology.devices)


def compile_lowered(lowered):
    """`lowered.compile()` with the adopted flags and the options a deviceless compile needs."""
    return lowered.compile(compiler_options=COMPILER_OPTIONS)


def xla_flags_text(flags: dict = ADOPTED_FLAGS) -> str:
    """Flags as XLA_FLAGS writes them: "--name=true --other=0"."""
    return " ".join(f"--{name}={str(value).lower() if isinstance(value, bool) else value}"
                    for name, value in flags.items())


def parse_xla_flags(text: str) -> dict:
    """XLA_FLAGS' text as {flag: value} (true/false as booleans, integers as ints; a later repeat wins, as in XLA)."""
    flags = {}
    for token in text.split():
        name, _, value = token.removeprefix("--").partition("=")
        if value.lower() in ("true", "false", ""):
            flags[name] = value.lower() != "false"
        else:
            flags[name] = int(value) if re.fullmatch(r"-?\d+", value) else value
    return flags


# -- reading the compiled step ---------------------------------------------------------------------------------

COLLECTIVES = hlo_kernels.COLLECTIVE_OPS


@dataclasses.dataclass(frozen=True)
class Collectives:
    """Per device and per step: how many of each collective run, and the bytes each moves (summed), counting
    every trip of the loops they are in. Bytes are those of the whole buffer taking part: an all-gather's output,
    a reduce-scatter's input, an all-reduce's operand."""

    count: dict[str, int]
    bytes: dict[str, int]
    # the same bytes split by element type, {kind: {"f32": n, "bf16": n, ...}}
    bytes_by_dtype: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        parts = [f"{kind} {self.count[kind]} ({self.bytes[kind] / 2**30:.2f} GiB)" for kind in COLLECTIVES
                 if self.count.get(kind)]
        return ", ".join(parts) or "none"


def collectives(hlo_text: str) -> Collectives:
    """The collectives of a compiled program (its `as_text()`), loop trips counted."""
    count = dict.fromkeys(COLLECTIVES, 0)
    by_dtype: dict[str, dict[str, int]] = {kind: {} for kind in COLLECTIVES}
    for instruction, _, runs in hlo_kernels.launched(parse_hlo(hlo_text)):
        kind = instruction.opcode.removesuffix("-start")
        if kind not in COLLECTIVES:
            continue
        count[kind] += runs
        for dtype, size in hlo_kernels.collective_bytes(instruction).items():
            by_dtype[kind][dtype] = by_dtype[kind].get(dtype, 0) + runs * size
    return Collectives(count, {kind: sum(by_dtype[kind].values()) for kind in COLLECTIVES}, by_dtype)


def fused_attention(hlo_text: str) -> dict[str, int]:
    """Call sites of cuDNN's fused attention in a compiled program: {"forward": n, "backward": n}."""
    targets = re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', hlo_text)
    return {"forward": sum("Backward" not in t for t in targets), "backward": sum("Backward" in t for t in targets)}


if __name__ == "__main__":  # the adopted flags for a GPU run's XLA_FLAGS (launch/env.sh)
    print(xla_flags_text())
