"""What a run trains: a `Task` says what differs between CLIP pretraining (`training.pretraining`) and
classification fine-tuning (`training.finetuning`); the run loop (`training.trainer`) does the rest, the same for
both: the run directory, checkpoints, the step loop, stop signals, non-finite steps and rollbacks, metrics.

A task is made from its config (`training.task_choice.task_for`: the kind of config decides) and answers the loop
in the order the loop's set-up asks: `check` (nothing built or written yet), `prepare_data` (the data found, or
written first), `build` (schedule, mesh, the step from `build_step`), `open_data` (this process's batches from the
step a run starts at), `fresh_state` (a new run's state), `evaluations`; then, as the loop runs, `mfu`,
`data_scalars` and `meta_fields` at each log line and save, `eval_weights` at each evaluation, `step_under` at a
rollback to fp32, and `finish` once the last step is done.
"""

from collections.abc import Callable
from typing import Any, Protocol

# The command that runs each task, named in the line that refuses the other's config or checkpoint.
COMMANDS = {"pretraining": "python -m clip_jax.train", "fine-tuning": "python -m clip_jax.finetune"}


class Task(Protocol):
    name: str  # "pretraining" or "fine-tuning", recorded with every checkpoint (`CheckpointMeta.task`)
    noun: str  # what a run of it is called in a message: "run", "fine-tuning run"
    config: Any
    entries: tuple[str, ...]  # every name a run of this task may write into its directory
    data_by_step: bool  # the data position is a function of the step: no position saved, none restored
    averaged: tuple[str, ...]  # the step's scalars a log line averages over its window (`MetricsWindow`)

    def check(self) -> None:
        """Every problem with the config, the places the run uses and its model, before anything is built."""

    def written_entries(self) -> list[str]:
        """What this run writes into its directory (recorded before it is written)."""

    def check_start(self, start) -> None:
        """What the task checks of where the run starts (`run_setup.RunStart`), before anything is built or
        written (pretraining: a resume reads the tokenizer the run kept, and builds its schedule from the run's
        global batches, `start.batch.segments`)."""

    def keep_files(self, directory) -> None:
        """Writes what the run keeps in its directory besides checkpoints and metrics, on process 0 once its
        `written_entries` are recorded (pretraining: its tokenizer's files, `training.run_tokenizer`)."""

    def prepare_data(self, should_stop: Callable[[], bool]) -> None:
        """The data found, or written first; `should_stop()` true between two shards ends the writing (CutShort)."""

    def build(self, precision: str | None = None):
        """(schedule, mesh, step): the run's length on this mesh and its step (`build_step`). `precision` replaces
        the config's (a rollback to fp32 builds the step again)."""

    def open_data(self, seed: int, start_step: int):
        """This process's batches (an iterator with `close()`), for a run whose data is seeded with `seed` and that
        starts at `start_step`."""

    def fresh_state(self, step, say: Callable[[str], None]):
        """A new run's train state on `step`'s layout (initialised, or from pretrained weights)."""

    def evaluations(self, mesh, schedule, say: Callable[[str], None]):
        """The run's `training.evaluations.Evaluations`: the config's and those the task was given."""

    def eval_weights(self, state):
        """What the run's evaluators are handed of `state`."""

    def mfu(self, samples_per_sec: float, step) -> float | None:
        """The model FLOPs utilisation of `step` at that speed (None: unknown)."""

    def data_scalars(self, data_iter) -> dict:
        """The data's counts a log line records (samples skipped, filtered)."""

    def meta_fields(self) -> dict:
        """The task's fields of a checkpoint's record (`CheckpointMeta`): the data's layout and filter."""

    def details(self) -> str:
        """What the run's first line adds about the task (may be empty)."""

    def finish(self, state, results: dict, say: Callable[[str], None], record: Callable[[dict], None]) -> dict:
        """After the last step (also when a finished run is started again): the run's results, completed;
        `record(scalars)` adds a record of the last step to the run's metrics."""


def is_finetune_config(config) -> bool:
    return "head_init" in config and "train_data" not in config
