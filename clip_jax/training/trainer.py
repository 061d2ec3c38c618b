"""Train CLIP: `python -m clip_jax.train --config configs/demo.py [--config.lr=5e-4 ...]`.

Data flows one way: config -> mesh -> model + optimizer -> data iterator -> step loop -> checkpoints, zero-shot
eval and metrics. The run lives in `LOGS/NAME/`: `config.json`, `checkpoints/STEP/`, TensorBoard events and
`metrics.jsonl`. SIGTERM or SIGINT (SLURM preemption, time limit, Ctrl-C) finishes the step, saves and exits 0;
`--config.resume=latest` continues exactly where the last checkpoint left off (where a run starts and how its data
resumes is decided before anything is built: `clip_jax.training.run_setup`). `logs` may be `s3://bucket/prefix` or
`gs://bucket/prefix`: checkpoints go to the bucket directly, the appended files are staged locally and uploaded at
each save and at exit (`clip_jax.runtime.storage`).
"""

import dataclasses
import functools
import json
import logging
import sys
import time

import jax
import ml_collections
import numpy as np
from absl import app
from absl import logging as absl_logging
from ml_collections import config_flags

from clip_jax import cli, data
from clip_jax.errors import RunFailed, UserError
from clip_jax.interop.pretrained import model_at_image_size
from clip_jax.models import create_model
from clip_jax.models.flops import train_flops
from clip_jax.ops.device_telemetry import Telemetry, progress_parts
from clip_jax.ops.writers import MetricsWindow, TensorBoardWriter, progress_line
from clip_jax.runtime import ownership, storage
from clip_jax.runtime.checkpoints import CheckpointMeta, RunCheckpoints
from clip_jax.runtime.hardware import gpu_for_device_kind
from clip_jax.runtime.mesh import make_global_batch
from clip_jax.runtime.processes import initialize_from_environment
from clip_jax.training import spike_telemetry as telemetry_lib
from clip_jax.training.config import check_config, report_targets
from clip_jax.training.preemption import StopSignal
from clip_jax.training.run_setup import plan_run_start
from clip_jax.training.stability import InstabilityMonitor
from clip_jax.training.step_factory import StepSpec, build_step, mesh_for
from clip_jax.training.step_reads import StepReads, local_values

log = logging.getLogger("clip_jax.train")

_CONFIG = config_flags.DEFINE_config_file("config", None, "training config file (configs/*.py)", lock_config=True)


MAX_ROLLBACKS_TO_ONE_CHECKPOINT = 3
# Across processes a stop signal is agreed on every this many steps (a collective): at most a few step times of
# SLURM's warning (launch/: --signal=TERM@300).
STOP_CHECK_EVERY_STEPS = 5


class TrainingUnstable(RunFailed):
    """The loss keeps diverging although the run rolled back to its last checkpoint."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Numbers the config implies on this mesh."""

    global_batch: int
    steps_per_epoch: int
    total_steps: int

    def epoch(self, step: int) -> float:
        return step / self.steps_per_epoch


def make_schedule(config, num_devices: int, shards: data.ShardList | None = None) -> Schedule:
    """`shards`: the run's resolved shards (`data.resolve_train_shards`), counted when the config gives no
    train_num_samples (resolved here when not given)."""
    global_batch = config.batch_size * num_devices
    steps_per_epoch = data.steps_per_epoch(data.TrainDataConfig.from_run_config(config), global_batch, shards)
    return Schedule(global_batch, steps_per_epoch, steps_per_epoch * config.epochs)


def step_spec(config, schedule: Schedule, mesh_platform: str, precision: str | None = None) -> StepSpec:
    """The step `config` trains with on devices of `mesh_platform`; `precision` replaces the config's."""
    return StepSpec.from_config(config, platform=mesh_platform, total_steps=schedule.total_steps,
                                precision=precision)


def eval_batch_size(mesh) -> int:
    """The global batch of zero-shot evaluation and validation: about 256 images, a multiple of the devices."""
    return max(mesh.size, (256 // mesh.size) * mesh.size)


class Trainer:
    """Holds the run's moving parts and drives the step loop. It owns what it opens (the data iterator with its
    worker processes, the checkpoint manager, the TensorBoard writer) and closes them in `close()`, also when its
    set-up fails part way; use it as a context manager."""

    def __init__(self, config: ml_collections.ConfigDict):
        self.config = config
        self.is_main = jax.process_index() == 0
        check_config(config, num_devices=jax.device_count(), process_count=jax.process_count())
        check_run_locations(config)  # a bucket that cannot be used stops the run before anything is built
        self.start = plan_run_start(config, process_count=jax.process_count())  # reads files, builds nothing
        self.run_dir = self.start.run_dir
        # Resolved once (written first, for the demo): the epoch length and the pipeline read the same shards.
        self.shards = data.resolve_train_shards(data.TrainDataConfig.from_run_config(config))
        self.schedule = make_schedule(config, jax.device_count(), self.shards)
        spec = step_spec(config, self.schedule, jax.devices()[0].platform)
        # An FSDP run whose weights the device count does not divide gets a (replica, data) grid (parallel.py).
        self.mesh = mesh_for(spec)
        self.engine = build_step(spec, self.mesh)
        self.data_seed = self.start.data.seed
        self.skipped_updates = 0
        self.rollbacks = 0
        self.rollbacks_to: dict[int, int] = {}  # checkpoint step -> rollbacks to it in this process
        # MFU counts model FLOPs (3x forward); recomputation under remat is overhead, not useful work.
        self.flops_per_sample = train_flops(spec.model)
        self.data_iter = self.checkpoints = self.writer = self.wandb = self.device_telemetry = self.val_set = None
        self.outputs = None  # metrics.jsonl, TensorBoard and W&B files: process 0's, staged locally for a bucket
        try:
            self._open()
        except BaseException:
            self.close()
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
        elif config.get("pretrained"):
            self.state = self._pretrained_state(config.pretrained)
        else:
            self.state = self.engine.init(config.seed)
        for note in self.start.notes:
            self._say(note)
        self.step = int(jax.device_get(self.state.step))
        if self.is_main:
            storage.write_text(storage.join(self.run_dir, "config.json"), config.to_json(indent=2))
            self.outputs = storage.StagedOutputs(self.run_dir)
        self._open_operations()

    def _open_operations(self) -> None:
        """Metrics targets and device telemetry (process 0), and the validation set (every process: validation is a
        collective; read now, so a bad set stops the run before training)."""
        config = self.config
        if self.is_main:
            targets = report_targets(config.report_to)
            if "tensorboard" in targets:
                self.writer = TensorBoardWriter(self.outputs.path("tensorboard"))
            if "wandb" in targets:
                from clip_jax.ops.wandb_writer import WandbWriter

                self.wandb = WandbWriter(self.outputs.local_dir, project=config.wandb_project,
                                         name=storage.basename(self.run_dir), config=config.to_dict())
            if config.device_telemetry:
                self.device_telemetry = Telemetry(devices=jax.local_devices())
                for note in self.device_telemetry.notes:
                    self._say(note)
        if config.val_data:
            from clip_jax.evaluation.validation import open_validation_set

            self.val_set = open_validation_set(config.val_data, config.val_num_samples)

    def _pretrained_state(self, path: str):
        """A new run's state from pretrained weights: their params (fitted to this model, in its param dtypes) and,
        for a ResNet image tower, their BatchNorm statistics; a fresh optimizer state, step 0."""
        from clip_jax.interop.pretrained import load_pretrained_variables

        variables = load_pretrained_variables(path, self.engine.spec.model)
        abstract = self.engine.abstract_state
        in_dtypes = lambda tree, like: jax.tree.map(lambda p, a: np.asarray(p, a.dtype), tree, like)  # noqa: E731
        params = in_dtypes(variables["params"], abstract.params)
        batch_stats = None if abstract.batch_stats is None else in_dtypes(variables["batch_stats"],
                                                                           abstract.batch_stats)
        self._say(f"params{' and BatchNorm statistics' if batch_stats is not None else ''} from pretrained {path}")
        return self.engine.state_from_params(params, batch_stats)

    def close(self) -> None:
        """Waits for pending saves and closes what the trainer opened (each once; what was never opened is None).
        The staged metrics are uploaded last, also when a save failed: they are not lost with it."""
        outputs = self.outputs
        try:
            if self.checkpoints is not None:
                self.checkpoints.wait()
                self.checkpoints.close()
        finally:
            if self.data_iter is not None:
                self.data_iter.close()  # stops the worker processes and frees their shared memory
            for opened in (self.writer, self.wandb, self.device_telemetry):
                if opened is not None:
                    opened.close()
            self.checkpoints = self.data_iter = self.writer = self.wandb = self.device_telemetry = None
            self.outputs = None
            if outputs is not None:
                outputs.close()  # after the writers: their last events are uploaded too

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- output ---------------------------------------------------------------------------------------------

    def _say(self, message: str) -> None:
        if self.is_main:
            print(message, flush=True)

    def _record(self, step: int, scalars: dict) -> None:
        if not self.is_main:
            return
        for writer in (self.writer, self.wandb):
            if writer is not None:
                writer.write_scalars(step, scalars)
        with open(self.outputs.path("metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **scalars}) + "\n")

    def _event(self, kind: str, step: int, **fields) -> None:
        """An instability event as its own record: a `{"event": KIND, "step": ...}` line in metrics.jsonl, and
        `events/KIND` (1 at that step) in TensorBoard and W&B."""
        if not self.is_main:
            return
        for writer in (self.writer, self.wandb):
            if writer is not None:
                writer.write_scalars(step, {f"events/{kind}": 1.0})
        with open(self.outputs.path("metrics.jsonl"), "a") as f:
            f.write(json.dumps({"event": kind, "step": step, **fields}) + "\n")

    # -- checkpoints ----------------------------------------------------------------------------------------

    def _meta(self) -> CheckpointMeta:
        return CheckpointMeta(
            step=self.step, model=self.engine.spec.model.name, precision=self.engine.spec.precision,
            global_batch=self.schedule.global_batch, samples_seen=self.step * self.schedule.global_batch,
            epoch=self.schedule.epoch(self.step), skipped_updates=self.skipped_updates, rollbacks=self.rollbacks,
            process_count=jax.process_count(), data_workers=self.config.workers, data_seed=self.data_seed)

    def save(self, force: bool = False) -> None:
        if self.checkpoints.save(self.step, self.state, self.data_iter, self._meta(), force=force):
            log.info("saving checkpoint %d", self.step)
        if self.outputs is not None:  # a bucket gets the metrics so far with each checkpoint
            try:
                self.outputs.sync()
            except Exception as e:  # noqa: BLE001  a storage hiccup: the next save (or the exit) sends them again
                log.warning("could not upload the run's metrics to %s at step %d (%s); retrying at the next save",
                            self.run_dir, self.step, e)

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

    def _roll_back(self, reason: str, at_step: int) -> None:
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
            spec = step_spec(self.config, self.schedule, self.mesh.devices.flat[0].platform, precision="fp32")
            self.engine = build_step(spec, self.mesh)
        self.state, _ = self._restore(self.checkpoints.directory, step, with_data=False)
        self.rollbacks += 1
        self._event("rollback", at_step, reason=reason, to_step=step, precision=self.engine.spec.precision,
                    rollbacks=self.rollbacks)
        self._say(f"{reason} at step {at_step}: rolled back to checkpoint {step}, continuing under "
                  f"{self.engine.spec.precision} (rollback #{self.rollbacks})")
        self.step = step

    # -- the loop -------------------------------------------------------------------------------------------

    def _host_batch(self) -> dict:
        """This process's rows of the next batch."""
        return next(self.data_iter)

    def _peak_flops(self) -> float | None:
        if self.config.peak_tflops_per_device:
            return self.config.peak_tflops_per_device * 1e12
        gpu = gpu_for_device_kind(jax.devices()[0].device_kind)
        return gpu.peak_tflops(self.engine.spec.precision) * 1e12 if gpu else None

    def train(self) -> dict:
        c, schedule = self.config, self.schedule
        self._say(f"run {self.run_dir}: {self.engine.spec.model.name}, {jax.device_count()} devices, global "
                  f"batch {schedule.global_batch}, {schedule.steps_per_epoch} steps/epoch x {c.epochs} epochs = "
                  f"{schedule.total_steps} steps, precision {self.engine.spec.precision}")
        stop = StopSignal()
        monitor = InstabilityMonitor(c.nan_patience, c.loss_spike_factor)
        reads = StepReads(lambda step, scalars: self._observe(step, scalars, monitor))
        first_step = True
        try:
            while self.step < schedule.total_steps:
                if self._stop_check_due() and stop.agreed():
                    if reads.catch_up():
                        continue  # rolled back: go on from the checkpoint, and stop at the next check
                    self.save(force=True)
                    self.checkpoints.wait()
                    self._say(f"{stop.received or 'stop signal'}: saved checkpoint {self.step} in {self.run_dir}; "
                              "exiting. Continue with --config.resume=latest")
                    return {"stopped_at": self.step}
                t0 = time.perf_counter()
                batch = make_global_batch(self._host_batch(), self.mesh)
                reads.count_step(data_wait=time.perf_counter() - t0)
                self.state, metrics = self.engine(self.state, batch)
                self.step += 1
                if first_step:  # compilation is not training speed: time the window from here
                    jax.block_until_ready(metrics)
                    first_step = False
                    reads.restart_clock()
                if reads.dispatched(self.step, metrics):
                    continue  # rolled back
                log_due = self.step % c.log_every_n_steps == 0 or self.step == schedule.total_steps
                save_due, zeroshot_due, val_due = self._save_due(), self._zeroshot_due(), self._val_due()
                if not (log_due or save_due or zeroshot_due or val_due):
                    continue
                if reads.catch_up():  # what is logged or saved has been checked
                    continue
                if log_due:
                    self._log_window(*reads.take_window(), telemetry=self._telemetry(reads.last_read))
                if save_due:
                    self.save()
                if zeroshot_due:
                    self._record(self.step, self.zeroshot())
                if val_due:
                    self._record(self.step, self.validate())
            self.save(force=True)
            self.checkpoints.wait()
            results = {"step": self.step}
            if c.zeroshot_data:
                results.update(self.zeroshot())
            if self.val_set is not None:
                results.update(self.validate())
            if len(results) > 1:
                self._record(self.step, {k: v for k, v in results.items() if k != "step"})
            self._say(f"done: {self.step} steps in {self.run_dir}" + "".join(
                f", {k} {v:.4f}" for k, v in results.items() if k.startswith(("zeroshot", "val_"))))
            return results
        finally:
            stop.restore()
            self.checkpoints.wait()

    def _stop_check_due(self) -> bool:
        """Every step in one process; every STOP_CHECK_EVERY_STEPS steps across processes, where agreeing on a
        signal is a collective that makes the host wait for the devices."""
        return jax.process_count() == 1 or self.step % STOP_CHECK_EVERY_STEPS == 0

    def _observe(self, step: int, scalars: dict, monitor: InstabilityMonitor) -> bool:
        """Checks step `step`'s loss (`scalars`: its metrics, on the host); counts a skipped update; rolls back
        (returning True) when the monitor sees a problem."""
        loss, finite = float(scalars["loss"]), bool(scalars["finite"])
        if not finite:
            self.skipped_updates += 1
            log.warning("step %d: non-finite loss or gradients, update skipped", step)
            self._event("non_finite_step", step, skipped_updates=self.skipped_updates)
        problem = monitor.observe(loss, bool(finite))
        if problem and monitor.last_problem == "loss_spike":
            self._event("loss_spike", step, loss_value=loss, reason=problem)
        if problem:
            self._roll_back(problem, at_step=step)
            monitor.reset()
            return True
        return False

    def _telemetry(self, last_read: tuple[int, dict] | None) -> dict[str, float]:
        """The spike telemetry of the step just read, when it is this step and computed it; copied from a local
        device (a logging step's only read of it)."""
        if last_read is None or last_read[0] != self.step or "telemetry" not in last_read[1]:
            return {}
        step = self.engine.spec.telemetry_every
        if not step or self.step % step:  # the final step of a run may fall between telemetry steps
            return {}
        return telemetry_lib.flatten(local_values(last_read[1]["telemetry"]))

    def _log_window(self, window: MetricsWindow, steps: int, elapsed: float, data_wait: float,
                    telemetry: dict | None = None) -> None:
        scalars = window.scalars()
        if not scalars:
            return
        samples_per_sec = steps * self.schedule.global_batch / max(elapsed, 1e-9)
        peak = self._peak_flops()
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
        line = progress_line(self.step, self.schedule.total_steps, self.schedule.epoch(self.step), scalars)
        if self.device_telemetry is not None:  # read on logging steps only: a few microseconds each
            device = self.device_telemetry.sample()
            scalars.update(device)
            line = " | ".join([line, *progress_parts(device)])
            for warning in self.device_telemetry.warnings(device):
                self._say(warning)
        self._say(line)
        self._record(self.step, {k: v for k, v in scalars.items() if v is not None} | (telemetry or {}))

    # -- zero-shot ------------------------------------------------------------------------------------------

    def _zeroshot_due(self) -> bool:
        c = self.config
        if not c.zeroshot_data or not c.zeroshot_frequency or self.step == self.schedule.total_steps:
            return False  # the final eval runs after the loop
        per_epoch = self.step % self.schedule.steps_per_epoch == 0
        return per_epoch and (self.step // self.schedule.steps_per_epoch) % c.zeroshot_frequency == 0

    @functools.cached_property
    def zeroshot_evaluator(self):
        """Built at the first evaluation and kept: the set, its prompt tokens and the compiled towers are reused."""
        from clip_jax.evaluation import ZeroShotEvaluator, clip_benchmark, open_classification_set

        c = self.config
        if c.zeroshot_data != "demo" and clip_benchmark.is_dataset_folder(c.zeroshot_data):
            dataset = clip_benchmark.open_training_set(c.zeroshot_data)
        else:
            kind, location = ("demo", None) if c.zeroshot_data == "demo" else ("imagenet-val", c.zeroshot_data)
            dataset = open_classification_set(kind, location)
        if c.zeroshot_samples:
            dataset = dataset.head(c.zeroshot_samples)
        # Evaluate in fp32 compute on the same parameters (any policy's params load into it).
        return ZeroShotEvaluator(create_model(model_at_image_size(c)), dataset, self.mesh,
                                 batch_size=eval_batch_size(self.mesh),
                                 mean=tuple(c.image_mean), std=tuple(c.image_std))

    def _val_due(self) -> bool:
        c = self.config
        if self.val_set is None or not c.val_frequency or self.step == self.schedule.total_steps:
            return False  # the final validation runs after the loop
        per_epoch = self.step % self.schedule.steps_per_epoch == 0
        return per_epoch and (self.step // self.schedule.steps_per_epoch) % c.val_frequency == 0

    @functools.cached_property
    def val_model(self):
        return create_model(model_at_image_size(self.config))  # fp32 compute on the run's params, as zero-shot

    def validate(self) -> dict:
        """Contrastive loss and retrieval recall@1/5/10 on `val_data`, as `val_*` metrics."""
        from clip_jax.evaluation.validation import validate

        c = self.config
        metrics = validate(self.val_model, self._eval_weights(), self.val_set, self.mesh,
                           batch_size=eval_batch_size(self.mesh),
                           loss_batch_size=self.schedule.global_batch, mean=tuple(c.image_mean),
                           std=tuple(c.image_std), loss=c.loss)
        result = {f"val_{k}": float(v) for k, v in metrics.items() if k != "num_images"}
        self._say(f"validation on {metrics['num_images']} images at step {self.step}: " +
                  ", ".join(f"{k} {v:.4f}" for k, v in result.items()))
        return result

    def _eval_weights(self):
        """The current state's params, with its BatchNorm running statistics for a ResNet image tower (evaluation
        runs in eval mode)."""
        from clip_jax.models.variables import eval_variables

        return eval_variables(self.state.params, self.state.batch_stats)

    def zeroshot(self) -> dict:
        evaluator = self.zeroshot_evaluator
        metrics = evaluator(self._eval_weights())
        result = {f"zeroshot_{k}": float(v) for k, v in metrics.items() if k.startswith("top")}
        self._say(f"zero-shot on {evaluator.dataset.name} at step {self.step}: " +
                  ", ".join(f"{k} {v:.4f}" for k, v in result.items()))
        return result


def run_entries(config) -> list[str]:
    """What a run writes into its directory (`ownership.RUN_ENTRIES` are all a run may hold)."""
    targets = report_targets(config.report_to)
    return (["config.json", "checkpoints", "metrics.jsonl"] + (["tensorboard"] if "tensorboard" in targets else [])
            + (["wandb", "wandb_run_id"] if "wandb" in targets else []))


def check_run_locations(config) -> None:
    """The bucket of a remote `logs` (written) or `resume` (read), checked by every process (each writes its own
    shards and data-iterator files there): credentials, bucket, endpoint and the s3fs/gcsfs package, each failure
    one line naming the URL. The processes agree on the outcome, so that none goes on to wait for the others."""
    remote = [(url, write) for url, write in ((config.logs, True), (config.resume, False))
              if url and url != "latest" and storage.is_remote(url)]
    if not remote:
        return
    problem = None
    try:
        for url, write in remote:
            storage.check_location(url, write=write, probe=f".clip_jax_write_probe-{jax.process_index()}")
    except UserError as e:
        problem = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = np.flatnonzero(multihost_utils.process_allgather(np.int32(problem is not None)))
        if problem is None and failed.size:
            raise RunFailed(f"process(es) {failed.tolist()} cannot use the run's bucket ({remote[0][0]}): every "
                            "host needs the credentials, the network route and clipjax-train[remote]; see their "
                            "error")
    if problem is not None:
        raise problem


def train(config: ml_collections.ConfigDict) -> dict:
    with Trainer(config) as trainer:
        return trainer.train()


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; settings go in --config.FIELD=VALUE")
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("give a config: --config configs/demo.py")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout)
    absl_logging.set_verbosity(absl_logging.WARNING)  # jax's backend probing is not news
    try:
        initialize_from_environment()  # a multi-process run joins before anything touches the devices
        train(config)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    cli.run(main)
