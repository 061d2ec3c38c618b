"""What a run tells the world, from process 0: the console, metrics.jsonl, TensorBoard, W&B and device telemetry.

A record (`record`) is one line of metrics.jsonl (`{"step": ..., NAME: value, ...}`) and the same scalars in each
of the run's targets; an event (`event`, e.g. a rollback) is a record of its own, `{"event": KIND, "step": ...}`,
and `events/KIND` = 1 in TensorBoard and W&B. On a bucket the files are staged locally and uploaded at every `sync`
(each checkpoint save) and at `close` (`storage.StagedOutputs`). On every other process each method does nothing,
so the trainer calls them unconditionally. Records of replayed steps (after a resume or a rollback) follow the rule
of `ops.replay`. A write that fails for want of space stops the run with one line (`StorageFull`).
"""

import json
import logging

from clip_jax.errors import RunFailed
from clip_jax.ops.device_telemetry import Telemetry, progress_parts
from clip_jax.ops.replay import Replays, read_records
from clip_jax.ops.writers import TensorBoardWriter, progress_line
from clip_jax.runtime import run_layout, storage, storage_faults
from clip_jax.runtime.checkpoints import latest_complete_step

log = logging.getLogger(__name__)


class RunOutputs:
    """`targets`: the metrics targets ("tensorboard", "wandb"); `device_telemetry`: sample NVML, the allocator and
    the host at each log line (of `devices`); `resumed_at`: the step a resumed run continues from (None for a fresh
    start). Closes what it opened in `close()`, also when it fails part way."""

    def __init__(self, run_dir: str, *, is_main: bool, targets=(), wandb_project: str = "", config: dict | None = None,
                 device_telemetry: bool = False, devices=(), resumed_at: int | None = None):
        self.run_dir, self.is_main = run_dir, is_main
        self.staged = self.tensorboard = self.wandb = self.device_telemetry = None
        if not is_main:
            return
        try:
            self.staged = storage.StagedOutputs(run_dir, run_layout.CARRIED)
            self.replays = Replays(read_records(self.staged.path(run_layout.METRICS)), resumed_at)
            if "tensorboard" in targets:
                self.tensorboard = TensorBoardWriter(self.staged.path(run_layout.TENSORBOARD))
            if "wandb" in targets:
                from clip_jax.ops.wandb_writer import WandbWriter

                self.wandb = WandbWriter(self.staged.local_dir, project=wandb_project, name=storage.basename(run_dir),
                                         config=config or {}, replay_from=self.replays.replay_from)
            if self.tensorboard is not None and self.replays.replay_from is not None:
                self.tensorboard.restart(self.replays.replay_from)
            if device_telemetry:
                self.device_telemetry = Telemetry(devices=devices)
                for note in self.device_telemetry.notes:
                    self.say(note)
        except BaseException:
            self.close()
            raise

    def say(self, message: str) -> None:
        if self.is_main:
            print(message, flush=True)

    def recorded(self, step: int) -> dict:
        """What metrics.jsonl held for `step` (at or after the step a run resumed at) when the run started, its
        records merged; {} on every process but 0."""
        return self.replays.held(step) if self.is_main else {}

    def record(self, step: int, scalars: dict) -> None:
        self._write(step, scalars, {"step": step, **scalars})

    def event(self, kind: str, step: int, **fields) -> None:
        self._write(step, {f"events/{kind}": 1.0}, {"event": kind, "step": step, **fields})
        if kind == "rollback" and self.is_main and self.replays.rolled_back(fields["to_step"]):
            for writer in (self.tensorboard, self.wandb):  # what they hold after that step is replayed
                if writer is not None:
                    writer.restart(fields["to_step"] + 1)

    def log(self, step: int, total_steps: int, epoch: float, scalars: dict, extra: dict | None = None) -> None:
        """A log line: the progress line on the console (with the device telemetry, sampled now, and its warnings),
        and `scalars` (the `None` ones left out), the telemetry and `extra` as the step's record."""
        if not self.is_main:
            return
        line = progress_line(step, total_steps, epoch, scalars)
        if self.device_telemetry is not None:  # read on logging steps only: a few microseconds each
            device = self.device_telemetry.sample()
            scalars = {**scalars, **device}
            line = " | ".join([line, *progress_parts(device)])
            for warning in self.device_telemetry.warnings(device):
                self.say(warning)
        self.say(line)
        self.record(step, {k: v for k, v in scalars.items() if v is not None} | (extra or {}))

    def sync(self, step: int) -> None:
        """Sends the staged files to a bucket run directory; a failure is a warning (the next sync sends them)."""
        if self.staged is None:
            return
        try:
            self.staged.sync()
        except Exception as e:  # noqa: BLE001  a storage hiccup: the next save (or the exit) sends them again
            log.warning("could not upload the run's metrics to %s at step %d (%s); retrying at the next save",
                        self.run_dir, step, e)

    def close(self, failed: bool = False) -> None:
        """Closes the writers, then uploads the staged files a last time (their last events included). In a run
        that `failed` (its error told already: often the same bucket, which then fails this upload too) a failed
        upload is a note naming where the metrics are kept, not a second error."""
        staged, self.staged = self.staged, None
        for opened in (self.tensorboard, self.wandb, self.device_telemetry):
            if opened is not None:
                opened.close()
        self.tensorboard = self.wandb = self.device_telemetry = None
        try:
            if staged is not None:
                staged.close()
        except RunFailed as e:
            if not failed:
                raise
            self.say(str(e))

    def _write(self, step: int, scalars: dict, line: dict) -> None:
        if not self.is_main:
            return
        if self.replays.is_replay(step):
            if self.replays.already_written(line):
                return
            scalars, line = {**scalars, "replay": 1.0}, {**line, "replay": True}
        self.replays.wrote(step)
        numbers = {k: v for k, v in scalars.items() if not isinstance(v, str)}  # a digest is for metrics.jsonl
        for writer in (self.tensorboard, self.wandb):
            if writer is not None:
                writer.write_scalars(step, numbers)
        try:
            with open(self.staged.path(run_layout.METRICS), "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:
            if not storage_faults.is_out_of_space(e):
                raise
            raise storage_faults.storage_full(
                self.staged.path(run_layout.METRICS), f"writing the record of step {step}", e,
                latest_complete_step(storage.join(self.run_dir, run_layout.CHECKPOINTS))) from None
