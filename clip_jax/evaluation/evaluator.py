"""One interface for every evaluation: an `Evaluator` has a `name` and `run(weights, should_stop) -> metrics`.

`weights` are what the model's `apply` takes (params, or a ResNet image tower's variables with its BatchNorm
statistics), placed or on the host. `should_stop` is asked before every batch encoded and cuts the evaluation short
with `stop_signals.CutShort`; a running trainer hands over its stop agreed across processes, a collective, so it is
seen where the trainer passes it. The metrics are floats under the evaluation's own names (`top1`, `val_loss`,
`image_retrieval_recall@5`, `lp_acc1`, ...).

Who runs evaluators: the trainer, at its cadence (`clip_jax.training.evaluations`: zero-shot, validation, the linear
probe, and any the caller adds); `python -m clip_jax.benchmark eval`, which makes each dataset's CLIP_benchmark task
from `TASKS`; and `python -m clip_jax.zeroshot`. A new evaluation is a class with these two members, built from an
`EvalSetting` (the model, the mesh, the images' normalisation, the batch); a new CLIP_benchmark task is also a
`Task` given to `register_task`, and `benchmark eval --task NAME` runs it.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from jax.sharding import Mesh

from clip_jax.errors import InvalidInput
from clip_jax.runtime.stop_signals import never


class Evaluator(Protocol):
    name: str  # what it evaluates on, e.g. a dataset's name

    def run(self, weights, should_stop: Callable[[], bool] = never) -> dict[str, float]:
        """The metrics of `weights`; `should_stop` is asked before each batch (see the module's docstring)."""


@dataclasses.dataclass(frozen=True)
class EvalSetting:
    """What the evaluators of one model share: the model the weights are applied to, the mesh its batches are split
    over, the images' normalisation, the global batch, the decoding threads, whether to show progress bars and the
    eval transform's resize ("shortest" side then a center crop, or a SigLIP folder's "squash")."""

    model: Any  # a CLIP module, created in the compute dtype the evaluation runs in
    mesh: Mesh
    mean: tuple[float, ...]
    std: tuple[float, ...]
    batch_size: int = 256
    num_threads: int | None = None
    progress: bool = False
    resize_mode: str = "shortest"


@dataclasses.dataclass(frozen=True)
class TaskData:
    """The splits of one CLIP_benchmark dataset a task reads: the split evaluated, and for a task that trains (the
    linear probe) its train split and an optional validation split."""

    test: Any  # clip_benchmark.BenchmarkDataset
    train: Any = None
    val: Any = None


@dataclasses.dataclass(frozen=True)
class Task:
    """A CLIP_benchmark task: the dataset types it evaluates (`dataset_type.txt`), whether it reads a train split,
    and how its evaluator is made from the setting, the dataset's splits and the command's options."""

    name: str
    dataset_types: tuple[str, ...]
    make: Callable[[EvalSetting, TaskData, Mapping[str, Any]], Evaluator]
    trains: bool = False


TASKS: dict[str, Task] = {}  # clip_jax.evaluation.benchmark registers CLIP_benchmark's own


def register_task(task: Task) -> None:
    """Adds `task` to `TASKS` (`benchmark eval --task NAME` then runs it); a name taken is refused."""
    if task.name in TASKS and TASKS[task.name] is not task:
        raise InvalidInput(f"a task named {task.name!r} is registered already; give the new one another name")
    TASKS[task.name] = task


def task_named(name: str) -> Task:
    if name not in TASKS:
        raise InvalidInput(f"no evaluation task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name]
