"""What the planner compiles: the trainer's own step, from the step factory, for the planned devices.

Every figure the planner measures comes from these compiles, so they go through `clip_jax.training.step_factory` and
nothing else: the step planned is the step trained.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

from clip_jax.models.naflex import patch_budget
from clip_jax.training.step_factory import StepSpec, build_step


def planned_spec(config, compiler: str = "cpu", gpu=None, max_num_patches: int | None = None) -> StepSpec:
    """The step the trainer would build from `config` on the planned GPUs (`runtime.hardware.GPU`, None: recent
    ones), a NaFlex image tower's at the patch budget `max_num_patches` (which it needs, and any other refuses);
    where XLA:CPU compiles it, as `for_xla_cpu` makes it."""
    target = gpu.target if gpu is not None else None
    spec = StepSpec.from_config(config, platform="gpu",
                                compute_capability=target.compute_capability if target else None)
    patch_budget(spec.model.vision, max_num_patches, spec.model.name)  # before anything compiles
    spec = dataclasses.replace(spec, max_num_patches=max_num_patches)
    return spec if compiler == "gpu" else for_xla_cpu(spec)


def for_xla_cpu(spec: StepSpec) -> StepSpec:
    """The step with XLA's attention and XLA's LayerNorms, which XLA:CPU compiles (it has no cuDNN and no Triton)."""
    return dataclasses.replace(spec, attention_impl="xla", fused_kernels="off")


def compile_train_step(spec: StepSpec, mesh, per_device_batch: int):
    """The train step of `spec`, compiled for `mesh` from abstract inputs."""
    return build_step(spec, mesh).compile(per_device_batch)


class CompiledSteps:
    """Train steps compiled for one mesh, each (spec, per-device batch, accumulation steps) once: the memory
    search, the accumulation search and the FLOP count ask for the same steps again."""

    def __init__(self, mesh, where: str, progress: Callable[[str], None]):
        self.mesh, self.where, self.progress = mesh, where, progress
        self._compiled: dict[tuple[StepSpec, int, int], Any] = {}

    def __call__(self, spec: StepSpec, per_device_batch: int, accum: int = 1):
        key = spec, per_device_batch, accum
        if key not in self._compiled:
            self.progress(f"compiling the train step ({spec.describe()}) for {self.where}: per-device batch "
                          f"{per_device_batch}, accum_steps {accum}")
            self._compiled[key] = compile_train_step(dataclasses.replace(spec, accum_steps=accum), self.mesh,
                                                     per_device_batch)
        return self._compiled[key]
