"""The run loop: `python -m clip_jax.train --config configs/demo.py` (CLIP pretraining) and `python -m
clip_jax.finetune --config configs/demo_finetune.py` (classification fine-tuning) both run a `Trainer`, which drives
the task its config describes (`clip_jax.training.task`).

Set-up, in the order it runs: the config, the places the run uses and the model are checked; where the run starts
is decided (its directory, the checkpoint it continues, how its data resumes: `run_setup`); the data is found or
written; the schedule, the mesh and the step are built (`build_step`); then the run's parts are opened (its data
iterator, checkpoints, state, outputs, evaluations). The run lives in `LOGS/NAME/` (`runtime.run_directory`).

Each step of the loop: the next batch -> the step -> the previous step read (`StepReads`) -> one decision
(`_decide`): roll back (too many non-finite steps in a row, a loss spike), stop (a signal, agreed across
processes), log, save, evaluate; a non-finite step's update was skipped by the step itself, and is counted here.
SIGTERM or SIGINT (SLURM preemption, time limit, Ctrl-C) finishes the step, saves and exits 0; before the first step
it stops the set-up, saves nothing and exits 130 (`runtime.stop_signals`); `--config.resume=latest` continues
exactly where the last checkpoint left off. `logs` may be `s3://bucket/prefix` or `gs://bucket/prefix`:
checkpoints go to the bucket directly, the appended files are staged locally and uploaded at each save and at exit
(`runtime.storage`).
"""

import logging
import time
from collections.abc import Callable, Sequence

import jax
import ml_collections

from clip_jax.ops.run_outputs import RunOutputs
from clip_jax.runtime import processes
from clip_jax.runtime.checkpoints import CheckpointMeta, RunCheckpoints
from clip_jax.runtime.mesh import make_global_batch
from clip_jax.runtime.stop_signals import CutShort, Stopped, StopSignal
from clip_jax.training.config_checks import report_targets
from clip_jax.training.evaluations import Scheduled
from clip_jax.training.loop_decision import Decision
from clip_jax.training.run_setup import plan_run_start, unread_saved_fields
from clip_jax.training.policy_state import initial_policy_state
from clip_jax.training.stability import (ROLLBACK_PRECISIONS, InstabilityMonitor, OverflowWatch,  # noqa: F401
                                         TrainingUnstable, rollback_step)
from clip_jax.training.step_reads import Read, StepReads
from clip_jax.training.task_choice import task_for

log = logging.getLogger("clip_jax.train")

# Across processes a stop signal is agreed on every this many steps (a collective): at most a few step times of
# SLURM's warning (launch/: --signal=TERM@300).
STOP_CHECK_EVERY_STEPS = 5


class Trainer:
    """Holds the run's moving parts and drives the step loop. It owns what it opens (the data iterator with its
    worker processes, the checkpoint manager, the run's outputs) and closes them in `close()`, also when its
    set-up fails part way; use it as a context manager.

    `edit_batch(step, batch) -> batch`, when given, sees each host batch before it goes to the devices, `step` the
    number of steps done before it (tests make chosen batches bad with it). `stop`: the command line's StopSignal,
    installed before the set-up, which it stops between phases; else `train()` installs one for the step loop.
    `evaluators`: evaluations to make besides the config's (`training.evaluations.Scheduled`)."""

    def __init__(self, config: ml_collections.ConfigDict, *, edit_batch: Callable[[int, dict], dict] | None = None,
                 stop: StopSignal | None = None, evaluators: Sequence[Scheduled] = ()):
        self.config, self.edit_batch, self.stop = config, edit_batch, stop
        self.task = task_for(config, evaluators)
        self.is_main = jax.process_index() == 0
        # -- the config, the places the run uses, the model: checked before anything is built or written
        self._stop_check("while the run was checked")
        self.task.check()
        # -- where the run starts: its directory, the checkpoint it continues, how its data resumes
        self.start = plan_run_start(config, self.task, process_count=jax.process_count(),
                                    now=processes.time_of_process_0)
        # the per-device batch the run's global batch gives on these devices (training.global_batch)
        config = self.config = self.task.config = self.start.batch.applied(config)
        self.directory = self.start.directory
        self.run_dir = self.directory.path
        self.task.check_start(self.start)
        # -- the data, found or written first (the demo's shards, a fine-tuning set)
        self._prepare_data()
        self._stop_check("while the data shards were found or written")
        # -- the schedule, the mesh and the step
        self.schedule, self.mesh, self.engine = self.task.build()
        self.data_seed = self.start.data.seed
        self.skipped_updates = self.rollbacks = 0
        self.rollbacks_to: dict[int, int] = {}  # checkpoint step -> rollbacks to it in this process
        self.monitor = InstabilityMonitor(config.nan_patience, config.loss_spike_factor)
        self.overflows = OverflowWatch()  # fp16's steps skipped for an overflow
        self.data_iter = self.checkpoints = self.outputs = self.evaluations = None
        try:
            self._stop_check("while the train step was built")
            self._open()
        except BaseException:
            self.close(failed=True)
            raise

    def _open(self) -> None:
        """The run's parts: its data iterator, checkpoints, state, outputs and evaluations."""
        config, start = self.config, self.start
        if self.is_main:  # recorded before they exist: what a crash leaves is known as the run's
            self.directory.record(self.task.written_entries())
            self.task.keep_files(self.directory)
        self.data_iter = self.task.open_data(self.data_seed, start.step)
        self.checkpoints = RunCheckpoints(self.directory.checkpoints, keep=config.keep)
        if start.resume_from is not None:
            directory, step = start.resume_from
            self.state, meta = self._restore(directory, step, with_data=start.data.restore)
            self.skipped_updates, self.rollbacks = meta.skipped_updates, meta.rollbacks
            self.overflows = OverflowWatch(meta.overflow_steps)
            self._say(f"resumed {directory}/{step} (saved under {meta.precision}, continuing under "
                      f"{self.engine.spec.precision})")
        else:
            self.state = self.task.fresh_state(self.engine, self._say)
        self._stop_check("while the state was initialised or restored")
        for note in start.notes:
            self._say(note)
        self.step = int(jax.device_get(self.state.step))
        if self.is_main:
            if start.resume_from is not None and (note := unread_saved_fields(self.run_dir, config)):
                self._say(note)
            self.directory.write_config(config)
        self.outputs = RunOutputs(self.run_dir, is_main=self.is_main, targets=report_targets(config.report_to),
                                  wandb_project=config.get("wandb_project", ""), config=config.to_dict(),
                                  device_telemetry=config.get("device_telemetry", False), devices=jax.local_devices(),
                                  resumed_at=self.step if start.resume_from is not None else None)
        self.evaluations = self.task.evaluations(self.mesh, self.schedule, self._say)
        self._stop_check("while the evaluations were set up")

    def _prepare_data(self) -> None:
        """The task's data (a stop signal in one process ends the demo's shard writing between shards, the
        unfinished set removed by `data.write_once`; several processes finish it and stop together)."""
        try:  # this process's signal only (no collective): one process writes while the others wait
            self.task.prepare_data(should_stop=lambda: jax.process_count() == 1 and bool(
                self.stop and self.stop.received))
        except CutShort:
            self._stop_check("while the data shards were written (the unfinished set was removed)")
            raise

    def _stop_check(self, moment: str) -> None:
        if self.stop is not None:
            self.stop.raise_if_received(moment)

    def close(self, failed: bool = False) -> None:
        """Waits for pending saves and closes what the trainer opened (each once; what was never opened is None).
        The outputs close last, also when a save failed: the metrics are not lost with it. A `failed` run that
        made its directory and left nothing in it to keep takes that directory back."""
        try:
            if self.checkpoints is not None:
                self.checkpoints.close()
        finally:
            if self.data_iter is not None:
                self.data_iter.close()  # stops the worker processes and frees their shared memory
            outputs, self.checkpoints, self.data_iter, self.outputs = self.outputs, None, None, None
            if outputs is not None:
                outputs.close(failed)
            if failed and self.is_main:
                self.directory.remove_if_unused()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close(failed=exc[0] is not None)

    def _say(self, message: str) -> None:
        if self.is_main:
            print(message, flush=True)

    # -- checkpoints ----------------------------------------------------------------------------------------

    def _meta(self) -> CheckpointMeta:
        return CheckpointMeta(
            step=self.step, model=self.engine.spec.model.name, precision=self.engine.spec.precision,
            global_batch=self.schedule.global_batch, samples_seen=self.schedule.samples(self.step),
            epoch=self.schedule.epoch(self.step), per_device_batch=self.config.batch_size,
            batch_size_given=self.start.batch.given, device_count=jax.device_count(),
            batch_segments=[list(segment) for segment in self.schedule.segments],
            skipped_updates=self.skipped_updates, rollbacks=self.rollbacks, process_count=jax.process_count(),
            data_seed=self.data_seed, log_window=self.reads.window.state(), overflow_steps=self.overflows.skipped,
            task=self.task.name, **self.task.meta_fields())

    def _saved_data(self):
        return None if self.task.data_by_step else self.data_iter

    def save(self, force: bool = False) -> None:
        if self.checkpoints.save(self.step, self.state, self._saved_data(), self._meta(), force=force):
            log.info("saving checkpoint %d", self.step)
        self.outputs.sync(self.step)  # a bucket gets the metrics so far with each checkpoint

    def _restore(self, directory: str, step: int, *, with_data: bool):
        checkpoints = (self.checkpoints if directory == self.checkpoints.directory
                       else RunCheckpoints(directory, read_only=True))  # another run's: left as it is
        try:
            return checkpoints.restore(step, self.engine.abstract_state, self.data_iter if with_data else None,
                                       fresh_policy_state=initial_policy_state(self.engine.spec))
        finally:
            if checkpoints is not self.checkpoints:
                checkpoints.close()

    def _save_due(self) -> bool:
        c, s, ended = self.config, self.step, self.schedule.epochs_ended(self.step)
        every_epochs = c.get("save_frequency", 0)  # 0: not at epoch ends
        return (s == self.schedule.total_steps or (every_epochs > 0 and ended > 0 and ended % every_epochs == 0)
                or (c.save_every_steps > 0 and s % c.save_every_steps == 0))

    # -- instability ----------------------------------------------------------------------------------------

    def observe(self, step: int, scalars: dict) -> str | None:
        """Acts on step `step`'s metrics, read to the host: counts a skipped update (a non-finite loss or gradient;
        an overflow of fp16's loss scale apart) and feeds the instability monitor; the problem it sees, or None."""
        if self.overflows.observe(scalars):
            return self.overflows.problem
        loss, finite = float(scalars["loss"]), bool(scalars["finite"])
        if not finite:
            self.skipped_updates += 1
            log.warning("step %d: non-finite loss or gradients, update skipped", step)
            self.outputs.event("non_finite_step", step, skipped_updates=self.skipped_updates)
        problem = self.monitor.observe(loss, finite)
        if problem and self.monitor.last_problem == "loss_spike":
            self.outputs.event("loss_spike", step, loss_value=loss, reason=problem)
        return problem

    def _roll_back(self, at_step: int, reason: str) -> None:
        """Back to the last checkpoint (the data iterator keeps going: the batches that led here are not
        replayed), under fp32 or bf16 if so configured. `at_step`: the step whose loss showed the problem."""
        action = self.config.on_instability
        self.checkpoints.wait()
        step = rollback_step(self.checkpoints.latest_step(), action, reason, at_step, self.rollbacks_to)
        if (precision := ROLLBACK_PRECISIONS.get(action)) and self.engine.spec.precision != precision:
            self.engine = self.task.build(precision=precision)[2]
        self.state, _ = self._restore(self.checkpoints.directory, step, with_data=False)
        self.rollbacks += 1
        self.monitor.reset()
        self.outputs.event("rollback", at_step, reason=reason, to_step=step, precision=self.engine.spec.precision,
                           rollbacks=self.rollbacks)
        self._say(f"{reason} at step {at_step}: rolled back to checkpoint {step}, continuing under "
                  f"{self.engine.spec.precision} (rollback #{self.rollbacks})")
        self.step = step

    # -- the loop -------------------------------------------------------------------------------------------

    def _next_batch(self):
        """The next global batch on the mesh, from this process's rows (seen by `edit_batch` when given)."""
        rows = next(self.data_iter)
        if self.edit_batch is not None:
            rows = self.edit_batch(self.step, rows)
        return make_global_batch(rows, self.mesh)

    def _train_step(self, first: bool) -> Read | None:
        """The next batch -> the step; returns the read of the step before it (None when there is none)."""
        t0 = time.perf_counter()
        batch = self._next_batch()
        self.reads.count_step(data_wait=time.perf_counter() - t0)
        if first:  # the ranks of a CPU run meet once compiled, not in gloo's 30 s
            processes.meet_once_compiled(lambda: self.engine.update.lower(self.state, batch).compile(), "step")
        self.state, metrics = self.engine(self.state, batch)
        self.step += 1
        if first:  # compilation is not training speed: time the window from here
            jax.block_until_ready(metrics)
            self.reads.restart_clock()
        return self.reads.dispatched(self.step, metrics)

    def _checked(self, read: Read | None) -> tuple[int, str] | None:
        """A problem `read` shows, as (its step, the reason); else the read joins the window."""
        if read is None:
            return None
        problem = self.observe(read.step, read.scalars)
        if problem:
            self.reads.drop()
            return read.step, problem
        self.reads.keep(read)
        return None

    def _decide(self, previous: Read | None, stopping: bool) -> Decision:
        """The one place that decides what follows a step: the previous step's read first, then, when anything is
        due (a stop, a log line, a save, evaluations), the step just dispatched too, so that nothing is logged or
        saved unchecked."""
        problem = self._checked(previous)
        if problem:
            return Decision(roll_back=problem)
        s, total = self.step, self.schedule.total_steps
        due = Decision(stop=True) if stopping else Decision(
            log=s % self.config.log_every_n_steps == 0 or s == total, save=self._save_due(),
            evaluate=self.evaluations.due(s))
        if not due.due:
            return due
        problem = self._checked(self.reads.catch_up())
        return Decision(roll_back=problem) if problem else due

    def train(self) -> dict:
        c, schedule = self.config, self.schedule
        self._say(f"run {self.run_dir}: {self.engine.spec.model.name}, {jax.device_count()} devices, global "
                  f"batch {schedule.global_batch}, {schedule.steps_per_epoch} steps/epoch x {c.epochs} epochs = "
                  f"{schedule.total_steps} steps{schedule.details()}, precision {self.engine.spec.precision}"
                  + self.task.details())
        stop = self.stop or StopSignal()
        self.reads = StepReads(self.task.averaged, self.start.meta.log_window if self.start.meta else None)
        first_step, first = True, self.step
        try:
            own = self.start.resume_from is not None and self.start.resume_from[0] == self.checkpoints.directory
            owed = self.evaluations.owed(self.step, own, self.outputs.recorded(self.step))
            if owed and self._evaluate(owed, stop) is None:
                return self._stopped_in_evaluation(stop)
            while self.step < schedule.total_steps:
                stopping = self._stop_check_due() and stop.agreed()
                previous = None if stopping else self._train_step(first_step)
                first_step = first_step and stopping
                decision = self._decide(previous, stopping)
                if decision.roll_back:
                    self._roll_back(*decision.roll_back)  # and go on from the checkpoint (a stop: at the next check)
                    continue
                if decision.stop:
                    return self._stopped(stop, first)
                if decision.log:
                    self._log_window(*self.reads.take_window(),
                                     telemetry=self.reads.telemetry(self.step, self.engine.spec.telemetry_every))
                if decision.save:
                    self.save()
                if decision.evaluate and self._evaluate(decision.evaluate, stop) is None:
                    return self._stopped_in_evaluation(stop)
            return self._finished(stop)
        finally:
            if stop is not self.stop:
                stop.restore()
            self.checkpoints.wait()

    def _stopped(self, stop: StopSignal, first: int) -> dict:
        if self.step == first and self.checkpoints.latest_step() != first:  # a fresh run's step 0
            raise Stopped(f"{stop.received or 'stop signal'} before the first step: nothing saved")
        self.save(force=True)
        self.checkpoints.wait()
        self._say(f"{stop.received or 'stop signal'}: saved checkpoint {self.step} in {self.run_dir}; exiting. "
                  "Continue with --config.resume=latest")
        return {"stopped_at": self.step}

    def _finished(self, stop: StopSignal) -> dict:
        """The last step saved, then every evaluation once and what the task does with a finished run."""
        self.save(force=True)
        self.checkpoints.wait()
        names = self.evaluations.names
        final = None if names and stop.agreed() else self._evaluate(names, stop)
        if final is None:
            self._say(f"{stop.received or 'stop signal'}: checkpoint {self.step} in {self.run_dir} holds the "
                      "finished run; final evaluation skipped (the same command runs it)")
            return {"stopped_at": self.step}
        results = {"step": self.step, **final}
        self._say(f"done: {self.step} steps in {self.run_dir}" + "".join(
            f", {k} {v:.4f}" for k, v in results.items() if k.startswith(("zeroshot", "val_", "lp_"))))
        return self.task.finish(self.state, results, self._say, lambda scalars: self.outputs.record(self.step, scalars))

    def _evaluate(self, names, stop: StopSignal) -> dict[str, float] | None:
        """The results of the evaluations `names`, recorded; None when a stop signal cut them short."""
        if not names:
            return {}
        return self.evaluations.run_and_record(names, self.task.eval_weights(self.state), self.step,
                                               should_stop=stop.agreed, record=self.outputs.record)

    def _stopped_in_evaluation(self, stop: StopSignal) -> dict:
        self.save(force=True)  # a no-op when the step was saved before its evaluations
        self.checkpoints.wait()
        self._say(f"{stop.received or 'stop signal'}: saved checkpoint {self.step} in {self.run_dir}; evaluation "
                  "cut short (the resumed run makes it); exiting. Continue with --config.resume=latest")
        return {"stopped_at": self.step}

    def _stop_check_due(self) -> bool:
        """Every step in one process; every STOP_CHECK_EVERY_STEPS steps across processes, where agreeing on a
        signal is a collective that makes the host wait for the devices."""
        return jax.process_count() == 1 or self.step % STOP_CHECK_EVERY_STEPS == 0

    def _log_window(self, window, steps: int, elapsed: float, data_wait: float, telemetry: dict | None = None):
        scalars = window.scalars()
        if not scalars:
            return
        samples_per_sec = steps * self.schedule.global_batch / max(elapsed, 1e-9)
        remaining = self.schedule.total_steps - self.step
        scalars.update(
            samples_per_sec=samples_per_sec,
            samples_per_sec_per_device=samples_per_sec / jax.device_count(),
            mfu=self.task.mfu(samples_per_sec, self.engine),
            data_wait_fraction=data_wait / max(elapsed, 1e-9),
            **self.task.data_scalars(self.data_iter),
            skipped_updates=self.skipped_updates, **self.overflows.scalars(self.reads.last_read),
            data_wait_per_step=data_wait / max(steps, 1),
            eta_seconds=remaining * elapsed / max(steps, 1),
            epoch=self.schedule.epoch(self.step),
            samples_seen=self.schedule.samples(self.step),
        )
        self.outputs.log(self.step, self.schedule.total_steps, self.schedule.epoch(self.step), scalars, telemetry)


def train(config: ml_collections.ConfigDict, stop: StopSignal | None = None) -> dict:
    with Trainer(config, stop=stop) as trainer:
        return trainer.train()
