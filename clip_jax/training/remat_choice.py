"""`remat_policy="auto"` (with `grad_checkpointing`): the first policy of `AUTO_ORDER` whose train step fits the
memory a GPU can use at the run's per-device batch, decided by compiling the step for that GPU (XLA:GPU, or
deviceless for the planner's compile-only GPUs). On any other platform it means `nothing_saveable`, the policy
that keeps least.
"""

import dataclasses
import logging

import jax

from clip_jax.errors import InvalidInput
from clip_jax.runtime.hardware import MEMORY_FRACTION, device_compute_capability, gpu_for_device_kind
from clip_jax.training.step_factory import StepMemory, StepSpec, build_step

# Fastest first, as measured with ViT-L/14 on an H200 (benchmarks/RESULTS.md section 8).
AUTO_ORDER = ("dots_saveable", "nothing_saveable")
AUTO = "auto"

log = logging.getLogger("clip_jax.train")


@dataclasses.dataclass(frozen=True)
class RematChoice:
    policy: str
    tried: tuple[tuple[str, int], ...]  # (policy, bytes per device of its step) for each policy compiled
    usable_bytes: int | None

    def describe(self) -> str:
        if not self.tried:
            return f"remat_policy auto: {self.policy} (not a GPU)"
        sizes = ", ".join(f"{policy} {size / 2**30:.1f} GiB" for policy, size in self.tried)
        return f"remat_policy auto: {self.policy} ({sizes}; {self.usable_bytes / 2**30:.1f} GiB usable per device)"


def usable_bytes(device, memory_fraction: float) -> int:
    """What the step may hold on `device`: the allocator's limit where the device reports one, else the GPU's
    memory (by its kind) times `memory_fraction`."""
    try:
        stats = device.memory_stats()
    except jax.errors.JaxRuntimeError:  # a compile-only device has none
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    gpu = gpu_for_device_kind(device.device_kind)
    if gpu is None:
        raise InvalidInput(f"remat_policy='auto' cannot tell how much memory a {device.device_kind!r} has: give "
                           f"--config.remat_policy one of {AUTO_ORDER}")
    return int(gpu.memory_bytes * memory_fraction)


def choose_remat(spec: StepSpec, mesh, per_device_batch: int, usable: int | None = None,
                 memory_fraction: float = MEMORY_FRACTION, compile_step=None) -> RematChoice:
    """The policy `auto` stands for in `spec` on `mesh`: on GPUs the first of `AUTO_ORDER` whose step at
    `per_device_batch` holds at most `usable` bytes (default: `usable_bytes` of the mesh's first device), the last
    when none does (XLA's own rematerialisation then tries to make it fit); elsewhere `nothing_saveable`.
    `compile_step(spec, per_device_batch)` compiles (default: the step factory's)."""
    if mesh.devices.flat[0].platform != "gpu":
        return RematChoice(AUTO_ORDER[-1], (), None)
    if usable is None:
        usable = usable_bytes(mesh.devices.flat[0], memory_fraction)
    compile_step = compile_step or (lambda s, b: build_step(s, mesh).compile(b))
    tried = []
    for policy in AUTO_ORDER:
        compiled = compile_step(dataclasses.replace(spec, remat_policy=policy), per_device_batch)
        tried.append((policy, StepMemory.of(compiled).total))
        if tried[-1][1] <= usable:
            break
    return RematChoice(tried[-1][0], tuple(tried), usable)


def resolve_auto_remat(spec: StepSpec, mesh, per_device_batch: int, **kwargs) -> tuple[StepSpec, RematChoice | None]:
    """`spec` with `remat_policy="auto"` replaced by `choose_remat`'s policy (and the choice); other specs as
    they are (and None)."""
    if spec.remat_policy != AUTO:
        return spec, None
    choice = choose_remat(spec, mesh, per_device_batch, **kwargs)
    return dataclasses.replace(spec, remat_policy=choice.policy), choice


def step_spec(config, schedule, mesh, precision: str | None = None) -> StepSpec:
    """The step `config` trains with on `mesh` for `schedule` ("auto" remat chosen for it, and logged);
    `precision` replaces the config's."""
    device = mesh.devices.flat[0]
    spec = StepSpec.from_config(config, platform=device.platform, total_steps=schedule.planned_steps,
                                precision=precision, compute_capability=device_compute_capability(device),
                                lr_segments=schedule.lr_segments())
    spec, choice = resolve_auto_remat(spec, mesh, int(config.batch_size))
    if choice is not None and jax.process_index() == 0:
        log.info(choice.describe())
    return spec
