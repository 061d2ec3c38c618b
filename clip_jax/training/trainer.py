"""Train CLIP: `python -m clip_jax.train --config configs/demo.py [--config.lr=5e-4 ...]`.

Data flows one way: config -> mesh -> model + optimizer -> data iterator -> step loop -> checkpoints, zero-shot
eval and metrics. The run lives in `LOGS/NAME/`: `config.json`, `checkpoints/STEP/`, TensorBoard events and
`metrics.jsonl`. SIGTERM or SIGINT (SLURM preemption, time limit, Ctrl-C) finishes the step, saves and exits 0;
before the first step it stops the set-up, saves nothing and exits 130 (`clip_jax.runtime.stop_signals`);
`--config.resume=latest` continues exactly where the last checkpoint left off (where a run starts and how its data
resumes is decided before anything is built: `clip_jax.training.run_setup`). `logs` may be `s3://bucket/prefix` or
`gs://bucket/prefix`: checkpoints go to the bucket directly, the appended files are staged locally and uploaded at
each save and at exit (`clip_jax.runtime.storage`).
"""

import logging
import time
from collections.abc import Callable, Sequence

import jax
import ml_collections
import numpy as np

from clip_jax import data
from clip_jax.errors import RunFailed
from clip_jax.models.flops import train_flops
from clip_jax.models.precision import check_fp8
from clip_jax.ops.run_outputs import RunOutputs
from clip_jax.ops.writers import MetricsWindow
from clip_jax.runtime import ownership, processes, storage
from clip_jax.runtime.checkpoints import CheckpointMeta, RunCheckpoints
from clip_jax.runtime.hardware import gpu_for_device_kind, peak_flops
from clip_jax.runtime.mesh import make_global_batch
from clip_jax.runtime.stop_signals import CutShort, Stopped, StopSignal
from clip_jax.training.config_checks import check_config, report_targets
from clip_jax.training.evaluations import Evaluations, Scheduled
from clip_jax.training.run_setup import (NewRunDirectory, check_run_locations, data_filter_settings, plan_run_start,
                                         run_entries, unread_saved_fields)
from clip_jax.training.schedule import make_schedule
from clip_jax.training.stability import InstabilityMonitor
from clip_jax.training.remat_choice import step_spec
from clip_jax.training.step_factory import StepSpec, build_step, mesh_for
from clip_jax.training.step_reads import StepReads

log = logging.getLogger("clip_jax.train")

MAX_ROLLBACKS_TO_ONE_CHECKPOINT = 3
# Across processes a stop signal is agreed on every this many steps (a collective): at most a few step times of
# SLURM's warning (launch/: --signal=TERM@300).
STOP_CHECK_EVERY_STEPS = 5


class TrainingUnstable(RunFailed):
    """The loss keeps diverging although the run rolled back to its last checkpoint."""


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
        self.config, self.edit_batch, self.stop, self.extra_evaluators = config, edit_batch, stop, tuple(evaluators)
        self.is_main = jax.process_index() == 0
        self._stop_check("while the run was checked")
        check_config(config, num_devices=jax.device_count(), process_count=jax.process_count())
        check_run_locations(config)  # a bucket that cannot be used stops the run before anything is built
        # so does a model file that cannot be read, before the demo's shards are written
        platform_spec = StepSpec.from_config(config, platform=jax.devices()[0].platform)
        check_fp8(config.precision, gpu_for_device_kind(jax.devices()[0].device_kind))  # None on a CPU: emulated
        self.start = plan_run_start(config, process_count=jax.process_count(), now=processes.time_of_process_0)
        self.run_dir, self.new_dir = self.start.run_dir, NewRunDirectory(self.start.run_dir)  # before any write
        # Resolved once (written first, for the demo): the epoch length and the pipeline read the same shards.
        self.shards = self._train_shards()
        self._stop_check("while the data shards were found or written")
        self.schedule = make_schedule(config, jax.device_count(), self.shards)
        # An FSDP run whose weights the device count does not divide gets a (replica, data) grid (parallel.py).
        self.mesh = mesh_for(platform_spec)
        self.engine = build_step(step_spec(config, self.schedule, self.mesh), self.mesh)
        self.data_seed = self.start.data.seed
        self.skipped_updates = self.rollbacks = 0
        self.rollbacks_to: dict[int, int] = {}  # checkpoint step -> rollbacks to it in this process
        # MFU counts model FLOPs (3x forward); recomputation under remat is overhead, not useful work.
        self.flops_per_sample = train_flops(self.engine.spec.model)
        self.monitor = InstabilityMonitor(config.nan_patience, config.loss_spike_factor)
        self.data_iter = self.checkpoints = self.outputs = self.evaluations = None
        try:
            self._stop_check("while the train step was built")
            self._open()
        except BaseException:
            self.close(failed=True)
            raise

    def _open(self) -> None:
        config, model = self.config, self.engine.spec.model
        if self.is_main:  # recorded before they exist: what a crash leaves is known as the run's
            ownership.record(self.run_dir, run_entries(config))
        self.data_iter = data.build_train_iterator(
            data.TrainDataConfig.from_run_config(config, seed=self.data_seed), shard_list=self.shards,
            global_batch_size=self.schedule.global_batch,
            image_size=model.vision.image_size, mean=tuple(config.image_mean), std=tuple(config.image_std),
            process_index=jax.process_index(), process_count=jax.process_count(),
            context_length=model.text.context_length)
        self.checkpoints = RunCheckpoints(self.start.checkpoints_dir, keep=config.keep)
        if self.start.resume_from is not None:
            directory, step = self.start.resume_from
            self.state, meta = self._restore(directory, step, with_data=self.start.data.restore)
            self.skipped_updates, self.rollbacks = meta.skipped_updates, meta.rollbacks
            self._say(f"resumed {directory}/{step} (saved under {meta.precision}, continuing under "
                      f"{self.engine.spec.precision})")
        elif config.pretrained:
            self.state = self._pretrained_state(config.pretrained)
        else:
            self.state = self.engine.init(config.seed)
        self._stop_check("while the state was initialised or restored")
        for note in self.start.notes:
            self._say(note)
        self.step = int(jax.device_get(self.state.step))
        if self.is_main:
            if self.start.resume_from is not None and (note := unread_saved_fields(self.run_dir)):
                self._say(note)
            storage.write_text(storage.join(self.run_dir, "config.json"), config.to_json(indent=2))
        self.outputs = RunOutputs(self.run_dir, is_main=self.is_main, targets=report_targets(config.report_to),
                                  wandb_project=config.wandb_project, config=config.to_dict(),
                                  device_telemetry=config.device_telemetry, devices=jax.local_devices(),
                                  resumed_at=self.step if self.start.resume_from is not None else None)
        # every process: validation is a collective, and a bad validation set stops the run before it trains
        self.evaluations = Evaluations(config, self.mesh, steps_per_epoch=self.schedule.steps_per_epoch,
                                       total_steps=self.schedule.total_steps,
                                       loss_batch_size=self.schedule.global_batch, say=self._say,
                                       extra=self.extra_evaluators)
        self._stop_check("while the evaluations were set up")

    def _train_shards(self) -> list[str]:
        """The run's shards (the demo's written first; a stop signal in one process ends that between shards,
        the unfinished set removed by `data.write_once`; several processes finish it and stop together)."""
        try:  # this process's signal only (no collective): one process writes while the others wait
            return data.resolve_train_shards(data.TrainDataConfig.from_run_config(self.config), should_stop=lambda: (
                jax.process_count() == 1 and bool(self.stop and self.stop.received)))
        except CutShort:
            self._stop_check("while the data shards were written (the unfinished set was removed)")
            raise

    def _stop_check(self, moment: str) -> None:
        if self.stop is not None:
            self.stop.raise_if_received(moment)

    def _pretrained_state(self, path: str):
        """A new run's state from pretrained weights: their params (fitted to this model, in its param dtypes) and,
        for a ResNet image tower, their BatchNorm statistics; a fresh optimizer state, step 0."""
        from clip_jax.interop.opener import open_model

        variables = open_model(path, self.engine.spec.model, what="pretrained").variables()
        abstract = self.engine.abstract_state
        in_dtypes = lambda tree, like: jax.tree.map(lambda p, a: np.asarray(p, a.dtype), tree, like)  # noqa: E731
        params = in_dtypes(variables["params"], abstract.params)
        batch_stats = None if abstract.batch_stats is None else in_dtypes(variables["batch_stats"],
                                                                           abstract.batch_stats)
        self._say(f"params{' and BatchNorm statistics' if batch_stats is not None else ''} from pretrained {path}")
        return self.engine.state_from_params(params, batch_stats)

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
                self.new_dir.remove_if_unused()

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
            global_batch=self.schedule.global_batch, samples_seen=self.step * self.schedule.global_batch,
            epoch=self.schedule.epoch(self.step), skipped_updates=self.skipped_updates, rollbacks=self.rollbacks,
            process_count=jax.process_count(), data_workers=self.config.workers, data_seed=self.data_seed,
            log_window=self.reads.window.state(), data_filter=data_filter_settings(self.config))

    def save(self, force: bool = False) -> None:
        if self.checkpoints.save(self.step, self.state, self.data_iter, self._meta(), force=force):
            log.info("saving checkpoint %d", self.step)
        self.outputs.sync(self.step)  # a bucket gets the metrics so far with each checkpoint

    def _restore(self, directory: str, step: int, *, with_data: bool):
        checkpoints = (self.checkpoints if directory == self.checkpoints.directory
                       else RunCheckpoints(directory, read_only=True))  # another run's: left as it is
        try:
            return checkpoints.restore(step, self.engine.abstract_state, self.data_iter if with_data else None)
        finally:
            if checkpoints is not self.checkpoints:
                checkpoints.close()

    def _save_due(self) -> bool:
        c, s = self.config, self.step
        at_epoch_end = s % self.schedule.steps_per_epoch == 0
        return (s == self.schedule.total_steps
                or (at_epoch_end and (s // self.schedule.steps_per_epoch) % c.save_frequency == 0)
                or (c.save_every_steps > 0 and s % c.save_every_steps == 0))

    # -- instability ----------------------------------------------------------------------------------------

    def _roll_back(self, at_step: int, reason: str) -> None:
        """Back to the last checkpoint (the data iterator keeps going: the batches that led here are not
        replayed), under fp32 if so configured. `at_step`: the step whose loss showed the problem."""
        action = self.config.on_instability
        self.checkpoints.wait()
        step = self.checkpoints.latest_step()
        if action == "stop" or step is None:
            raise TrainingUnstable(f"{reason} at step {at_step}; "
                                   + ("stopping (on_instability='stop')" if step is not None
                                      else "no checkpoint to roll back to yet"))
        if self.rollbacks_to.get(step, 0) >= MAX_ROLLBACKS_TO_ONE_CHECKPOINT:
            raise TrainingUnstable(f"{reason} at step {at_step}, after {MAX_ROLLBACKS_TO_ONE_CHECKPOINT} "
                                   f"rollbacks to checkpoint {step}: stopping. Lower the learning rate, or resume "
                                   "under --config.precision=fp32")
        self.rollbacks_to[step] = self.rollbacks_to.get(step, 0) + 1
        if action == "rollback_fp32" and self.engine.spec.precision != "fp32":
            self.engine = build_step(step_spec(self.config, self.schedule, self.mesh, precision="fp32"), self.mesh)
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

    def train(self) -> dict:
        c, schedule = self.config, self.schedule
        self._say(f"run {self.run_dir}: {self.engine.spec.model.name}, {jax.device_count()} devices, global "
                  f"batch {schedule.global_batch}, {schedule.steps_per_epoch} steps/epoch x {c.epochs} epochs = "
                  f"{schedule.total_steps} steps, precision {self.engine.spec.precision}")
        stop = self.stop or StopSignal()
        reads = self.reads = StepReads(self.observe, self.start.meta.log_window if self.start.meta else None)
        first_step, first = True, self.step
        try:
            own = self.start.resume_from is not None and self.start.resume_from[0] == self.checkpoints.directory
            owed = self.evaluations.owed(self.step, own, self.outputs.recorded(self.step))
            if owed and self._evaluate(owed, stop) is None:
                return self._stopped_in_evaluation(stop)
            while self.step < schedule.total_steps:
                if self._stop_check_due() and stop.agreed():
                    problem = reads.catch_up()
                    if problem:
                        self._roll_back(*problem)
                        continue  # go on from the checkpoint, and stop at the next check
                    if self.step == first and self.checkpoints.latest_step() != first:  # a fresh run's step 0
                        raise Stopped(f"{stop.received or 'stop signal'} before the first step: nothing saved")
                    self.save(force=True)
                    self.checkpoints.wait()
                    self._say(f"{stop.received or 'stop signal'}: saved checkpoint {self.step} in {self.run_dir}; "
                              "exiting. Continue with --config.resume=latest")
                    return {"stopped_at": self.step}
                t0 = time.perf_counter()
                batch = self._next_batch()
                reads.count_step(data_wait=time.perf_counter() - t0)
                if first_step:  # the ranks of a CPU run meet once compiled, not in gloo's 30 s
                    processes.meet_once_compiled(lambda: self.engine.update.lower(self.state, batch).compile(), "step")
                self.state, metrics = self.engine(self.state, batch)
                self.step += 1
                if first_step:  # compilation is not training speed: time the window from here
                    jax.block_until_ready(metrics)
                    first_step = False
                    reads.restart_clock()
                problem = reads.dispatched(self.step, metrics)
                if problem:
                    self._roll_back(*problem)
                    continue
                log_due = self.step % c.log_every_n_steps == 0 or self.step == schedule.total_steps
                save_due, evaluations_due = self._save_due(), self.evaluations.due(self.step)
                if not (log_due or save_due or evaluations_due):
                    continue
                problem = reads.catch_up()  # what is logged, saved or evaluated has been checked
                if problem:
                    self._roll_back(*problem)
                    continue
                if log_due:
                    telemetry = reads.telemetry(self.step, self.engine.spec.telemetry_every)
                    self._log_window(*reads.take_window(), telemetry=telemetry)
                if save_due:
                    self.save()
                if evaluations_due and self._evaluate(evaluations_due, stop) is None:
                    return self._stopped_in_evaluation(stop)
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
            return results
        finally:
            if stop is not self.stop:
                stop.restore()
            self.checkpoints.wait()

    def _evaluate(self, names, stop: StopSignal) -> dict[str, float] | None:
        """The results of the evaluations `names`, recorded; None when a stop signal cut them short."""
        if not names:
            return {}
        return self.evaluations.run_and_record(names, self._eval_weights(), self.step, should_stop=stop.agreed,
                                               record=self.outputs.record)

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

    def observe(self, step: int, scalars: dict) -> str | None:
        """Checks step `step`'s loss (`scalars`: its metrics, on the host) and counts a skipped update: the problem
        the instability monitor sees (a reason to roll back), or None."""
        loss, finite = float(scalars["loss"]), bool(scalars["finite"])
        if not finite:
            self.skipped_updates += 1
            log.warning("step %d: non-finite loss or gradients, update skipped", step)
            self.outputs.event("non_finite_step", step, skipped_updates=self.skipped_updates)
        problem = self.monitor.observe(loss, finite)
        if problem and self.monitor.last_problem == "loss_spike":
            self.outputs.event("loss_spike", step, loss_value=loss, reason=problem)
        return problem

    def _log_window(self, window: MetricsWindow, steps: int, elapsed: float, data_wait: float,
                    telemetry: dict | None = None) -> None:
        scalars = window.scalars()
        if not scalars:
            return
        samples_per_sec = steps * self.schedule.global_batch / max(elapsed, 1e-9)
        peak = peak_flops(jax.devices()[0].device_kind, self.engine.spec.precision,
                          self.config.peak_tflops_per_device)
        remaining = self.schedule.total_steps - self.step
        scalars.update(
            samples_per_sec=samples_per_sec,
            samples_per_sec_per_device=samples_per_sec / jax.device_count(),
            mfu=(samples_per_sec * self.flops_per_sample / (peak * jax.device_count()))
            if peak and self.flops_per_sample else None,
            data_wait_fraction=data_wait / max(elapsed, 1e-9),
            **data.skip_scalars(self.data_iter.skipped_samples()),
            skipped_updates=self.skipped_updates,
            data_wait_per_step=data_wait / max(steps, 1),
            eta_seconds=remaining * elapsed / max(steps, 1),
            epoch=self.schedule.epoch(self.step),
            samples_seen=self.step * self.schedule.global_batch,
        )
        self.outputs.log(self.step, self.schedule.total_steps, self.schedule.epoch(self.step), scalars, telemetry)

    def _eval_weights(self):
        """The current state's params, with its BatchNorm running statistics for a ResNet image tower (evaluation
        runs in eval mode)."""
        from clip_jax.models.variables import eval_variables

        return eval_variables(self.state.params, self.state.batch_stats)


def train(config: ml_collections.ConfigDict, stop: StopSignal | None = None) -> dict:
    with Trainer(config, stop=stop) as trainer:
        return trainer.train()
