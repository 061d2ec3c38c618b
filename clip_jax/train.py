"""Train CLIP: `python -m clip_jax.train --config configs/demo.py [--config.lr=5e-4 ...]`.

Data flows one way: config -> mesh -> model + optimizer -> data iterator -> step loop -> checkpoints, zero-shot
eval and metrics. The run lives in `LOGS/NAME/`: `config.json`, `checkpoints/STEP/`, TensorBoard events and
`metrics.jsonl`. SIGTERM or SIGINT (SLURM preemption, time limit, Ctrl-C) finishes the step, saves and exits 0;
`--config.resume=latest` continues exactly where the last checkpoint left off. On another data layout (process
count, data workers per process) the data position cannot be restored: `--config.resume_data=allow_reseed` then
restores the train state only and reads on with new data iterators (see `data_resume_plan`).
"""

import dataclasses
import json
import logging
import os
import signal
import sys
import time

import jax
import ml_collections
import numpy as np
from absl import app
from absl import logging as absl_logging
from ml_collections import config_flags

from clip_jax import data
from clip_jax.checkpoint import (RunCheckpoints, data_iter_files, latest_complete_step, read_meta, resolve_resume,
                                 saved_process_count)
from clip_jax.config import check_config
from clip_jax.distributed import DistributedInitError, initialize_from_environment
from clip_jax.hardware import gpu_for_device_kind
from clip_jax.metrics import TensorBoardWriter, TrainMetrics, progress_line, window_scalars
from clip_jax.models import create_model, init_params, param_shapes
from clip_jax.models.flops import train_flops
from clip_jax.models.layers import choose_attention_impl
from clip_jax.optim import create_optimizer, warmup_cosine_schedule
from clip_jax.parallel import create_mesh, make_global_batch
from clip_jax.precision import get_policy
from clip_jax.stability import InstabilityMonitor
from clip_jax.train_step import abstract_train_state, init_train_state, make_train_step

log = logging.getLogger("clip_jax.train")

_CONFIG = config_flags.DEFINE_config_file("config", None, "training config file (configs/*.py)", lock_config=True)


MAX_ROLLBACKS_TO_ONE_CHECKPOINT = 3
# Across processes a stop signal is agreed on every this many steps (a collective): at most a few step times of
# SLURM's warning (launch/: --signal=TERM@300).
STOP_CHECK_EVERY_STEPS = 5


class TrainingUnstable(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Numbers the config implies on this mesh."""

    global_batch: int
    steps_per_epoch: int
    total_steps: int

    def epoch(self, step: int) -> float:
        return step / self.steps_per_epoch


def reseeded_data_seed(seed: int, step: int) -> int:
    """The data seed of a run resumed at `step` without its data position: a pure function of (seed, step), so all
    processes agree and resuming the same step twice reads the same data; unlike `seed` itself it does not replay
    the samples the run started with."""
    return int(np.random.SeedSequence([seed, 0xDA7A, step]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class DataResume:
    """How a resumed run gets its data: the saved iterator position (`restore`) and the seed to build with."""

    restore: bool
    seed: int
    note: str = ""  # what the user gets, when the position is not restored


def data_resume_plan(config, meta: dict, saved_processes: int | None, *, where: str, step: int,
                     process_count: int) -> DataResume:
    """Restore the data position when the checkpoint's data layout (processes x data workers) is this run's.

    Otherwise the position cannot be carried (each process and worker saved its own place in its own shard order):
    with `resume_data="exact"` that is a ValueError naming the way out; with `"allow_reseed"` the train state alone
    is restored and new iterators are seeded with `reseeded_data_seed(seed, step)`. In resampled mode they draw
    fresh shards, statistically the same as continuing; in epoch mode they start a new pass over all shards, in a
    new order, at this step (the trainer's epoch count goes on by steps, so samples already read in the interrupted
    epoch may come again before it ends, and some others not at all in it).
    """
    saved_workers = meta.get("data_workers")  # None in checkpoints that predate the field: not checked
    if (saved_processes in (None, process_count)
            and (saved_workers is None or int(saved_workers) == config.workers)):
        return DataResume(True, int(meta.get("data_seed", config.seed)))

    def layout(processes, workers):
        text = f"{processes} process" + ("" if processes == 1 else "es")
        return text + (f" x {workers} data workers" if saved_workers is not None else "")

    saved, here = layout(saved_processes, saved_workers), layout(process_count, config.workers)
    if config.resume_data != "allow_reseed":
        raise ValueError(
            f"checkpoint {where} was saved by {saved}, this run has {here}: the data-iterator position is saved "
            "per process and worker and cannot be carried to another layout. Resume with the layout that saved "
            "it, or set --config.resume_data=allow_reseed to restore the train state only and read on with new "
            "data iterators (no replay of the run's first samples)")
    seed = reseeded_data_seed(config.seed, step)
    what = ("fresh shard draws" if config.dataset_resampled else
            "a new pass over all shards in a new order starts at this step")
    note = (f"data position not restored: checkpoint {where} was saved by {saved}, this run has {here}; "
            f"new data iterators with seed {seed} (from seed {config.seed} and step {step}): {what}")
    return DataResume(False, seed, note)


def make_schedule(config, num_devices: int, shards: data.ShardList | None = None) -> Schedule:
    """`shards`: the run's resolved shards (`data.resolve_train_shards`), counted when the config gives no
    train_num_samples (resolved here when not given)."""
    global_batch = config.batch_size * num_devices
    steps_per_epoch = data.steps_per_epoch(data.TrainDataConfig.from_run_config(config), global_batch, shards)
    return Schedule(global_batch, steps_per_epoch, steps_per_epoch * config.epochs)


@dataclasses.dataclass
class Engine:
    """What one precision policy compiles: the model, the optimizer and the jitted step, with the state's
    layout."""

    precision: str
    model: object
    optimizer: object
    abstract_state: object  # ShapeDtypeStructs with shardings
    shardings: object
    step_fn: object


def build_engine(config, precision: str, mesh, schedule: Schedule) -> Engine:
    policy = get_policy(precision)
    model = create_model(config.model, dtype=policy.compute_dtype, param_dtype=policy.param_dtype,
                         remat_policy=config.remat_policy if config.grad_checkpointing else "none",
                         attention_impl=choose_attention_impl(config.attention_impl, mesh.devices.flat[0].platform,
                                                              policy.compute_dtype))
    lr_fn = warmup_cosine_schedule(config.lr, config.warmup, schedule.total_steps)
    optimizer = create_optimizer(lr_fn, weight_decay=config.wd, b1=config.beta1, b2=config.beta2, eps=config.eps,
                                 grad_clip_norm=config.grad_clip_norm or None)
    abstract_state = abstract_train_state(model, optimizer, mesh, fsdp=config.fsdp)
    shardings = jax.tree.map(lambda s: s.sharding, abstract_state)
    step_fn = make_train_step(model, optimizer, lr_fn, mesh, shardings, accum_steps=config.accum_freq)
    return Engine(precision, model, optimizer, abstract_state, shardings, step_fn)


def fresh_state(engine: Engine, seed: int):
    init = lambda rng: init_train_state(init_params(engine.model, rng), engine.optimizer)  # noqa: E731
    return jax.jit(init, out_shardings=engine.shardings)(jax.random.key(seed))


def run_name(config) -> str:
    if config.name:
        return config.name
    if config.resume == "latest":
        raise ValueError("resume='latest' needs a run name: set --config.name=... (the same on every launch)")
    # One timestamp for all processes: process 0's.
    stamp = int(time.time()) if jax.process_count() == 1 else int(
        jax.experimental.multihost_utils.broadcast_one_to_all(np.int64(time.time())))
    model = os.path.basename(config.model).removesuffix(".json")
    return f"{model}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(stamp))}"


class StopSignal:
    """Remembers SIGTERM/SIGINT instead of dying mid-step; a second SIGINT interrupts at once."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def agreed(self) -> bool:
        """True on every process once any process got a signal (they then save the same step)."""
        flag = self.received is not None
        if jax.process_count() > 1:
            flag = bool(np.any(jax.experimental.multihost_utils.process_allgather(np.int32(flag))))
        return flag

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class Trainer:
    """Holds the run's moving parts and drives the step loop."""

    def __init__(self, config: ml_collections.ConfigDict):
        self.config = config
        self.is_main = jax.process_index() == 0
        check_config(config, num_devices=jax.device_count(), process_count=jax.process_count())
        # An FSDP run whose weights the device count does not divide gets a (replica, data) grid (parallel.py).
        self.mesh = create_mesh(fsdp_params=param_shapes(create_model(config.model)) if config.fsdp else None)
        # Resolved once (written first, for the demo): the epoch length and the pipeline read the same shards.
        self.shards = data.resolve_train_shards(data.TrainDataConfig.from_run_config(config))
        self.schedule = make_schedule(config, jax.device_count(), self.shards)
        self.run_dir = os.path.abspath(os.path.join(config.logs, run_name(config)))
        resume_dir, resume_step = (None, None)
        if config.resume:
            resume_dir, resume_step = resolve_resume(config.resume, self.run_dir)
        elif latest_complete_step(os.path.join(self.run_dir, "checkpoints")) is not None:
            raise ValueError(f"run directory {self.run_dir} already has checkpoints: continue it with "
                             "--config.resume=latest, or start another run with --config.name=...")
        data_resume = DataResume(False, config.seed)
        if resume_step is not None:
            saved_meta = read_meta(resume_dir, resume_step)
            data_resume = data_resume_plan(
                config, saved_meta, saved_process_count(saved_meta, data_iter_files(resume_dir, resume_step)),
                where=f"{resume_dir}/{resume_step}", step=resume_step, process_count=jax.process_count())
        self.data_seed = data_resume.seed
        self.engine = build_engine(config, config.precision, self.mesh, self.schedule)
        self.data_iter = data.build_train_iterator(
            data.TrainDataConfig.from_run_config(config, seed=self.data_seed), shard_list=self.shards,
            global_batch_size=self.schedule.global_batch,
            image_size=self.engine.model.config.vision.image_size, mean=tuple(config.image_mean),
            std=tuple(config.image_std), process_index=jax.process_index(), process_count=jax.process_count(),
            context_length=self.engine.model.config.text.context_length)
        self.checkpoints = RunCheckpoints(os.path.join(self.run_dir, "checkpoints"), keep=config.keep)
        self.skipped_updates = 0
        self.rollbacks = 0
        self.rollbacks_to: dict[int, int] = {}  # checkpoint step -> rollbacks to it in this process
        self.fault_nan_steps = {int(s) for s in config.fault_nan_steps.split(",") if s.strip()}
        if resume_step is not None:
            self.state, meta = self._restore(resume_dir, resume_step, with_data=data_resume.restore)
            self.skipped_updates = int(meta.get("skipped_updates", 0))
            self.rollbacks = int(meta.get("rollbacks", 0))
            self._say(f"resumed {resume_dir}/{resume_step} (saved under {meta.get('precision')}, "
                      f"continuing under {self.engine.precision})")
            if data_resume.note:
                self._say(data_resume.note)
        else:
            if config.resume == "latest":
                self._say(f"no checkpoint in {self.run_dir} yet: starting fresh")
            self.state = fresh_state(self.engine, config.seed)
        self.step = int(jax.device_get(self.state.step))
        self.writer = None
        if self.is_main:
            os.makedirs(self.run_dir, exist_ok=True)
            with open(os.path.join(self.run_dir, "config.json"), "w") as f:
                f.write(config.to_json(indent=2))
            if config.report_to == "tensorboard":
                self.writer = TensorBoardWriter(os.path.join(self.run_dir, "tensorboard"))
        # MFU counts model FLOPs (3x forward); recomputation under remat is overhead, not useful work.
        self.flops_per_sample = train_flops(self.engine.model.config)

    # -- output ---------------------------------------------------------------------------------------------

    def _say(self, message: str) -> None:
        if self.is_main:
            print(message, flush=True)

    def _record(self, step: int, scalars: dict) -> None:
        if not self.is_main:
            return
        if self.writer is not None:
            self.writer.write_scalars(step, scalars)
        with open(os.path.join(self.run_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **scalars}) + "\n")

    # -- checkpoints ----------------------------------------------------------------------------------------

    def _meta(self) -> dict:
        return {"step": self.step, "samples_seen": self.step * self.schedule.global_batch,
                "epoch": self.schedule.epoch(self.step), "precision": self.engine.precision,
                "model": self.engine.model.config.name, "global_batch": self.schedule.global_batch,
                "skipped_updates": self.skipped_updates, "rollbacks": self.rollbacks,
                # the data layout and seed the saved iterator positions belong to
                "process_count": jax.process_count(), "data_workers": self.config.workers,
                "data_seed": self.data_seed}

    def save(self, force: bool = False) -> None:
        if self.checkpoints.save(self.step, self.state, self.data_iter, self._meta(), force=force):
            log.info("saving checkpoint %d", self.step)

    def _restore(self, directory: str, step: int, *, with_data: bool):
        checkpoints = self.checkpoints if directory == self.checkpoints.directory else RunCheckpoints(directory)
        return checkpoints.restore(step, self.engine.abstract_state, self.data_iter if with_data else None)

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
        if action == "rollback_fp32" and self.engine.precision != "fp32":
            self.engine = build_engine(self.config, "fp32", self.mesh, self.schedule)
        self.state, _ = self._restore(self.checkpoints.directory, step, with_data=False)
        self.rollbacks += 1
        self._say(f"{reason} at step {at_step}: rolled back to checkpoint {step}, continuing under "
                  f"{self.engine.precision} (rollback #{self.rollbacks})")
        self.step = step

    # -- the loop -------------------------------------------------------------------------------------------

    def _next_batch(self) -> dict:
        batch = next(self.data_iter)
        if self.step in self.fault_nan_steps:  # once: a rollback replays the step number with new data
            self.fault_nan_steps.discard(self.step)
            batch = {**batch, "images": np.full_like(batch["images"], np.nan)}
        return make_global_batch(batch, self.mesh)

    def _peak_flops(self) -> float | None:
        if self.config.peak_tflops_per_device:
            return self.config.peak_tflops_per_device * 1e12
        gpu = gpu_for_device_kind(jax.devices()[0].device_kind)
        return gpu.peak_tflops(self.engine.precision) * 1e12 if gpu else None

    def train(self) -> dict:
        c, schedule = self.config, self.schedule
        self._say(f"run {self.run_dir}: {self.engine.model.config.name}, {jax.device_count()} devices, global "
                  f"batch {schedule.global_batch}, {schedule.steps_per_epoch} steps/epoch x {c.epochs} epochs = "
                  f"{schedule.total_steps} steps, precision {self.engine.precision}")
        stop = StopSignal()
        monitor = InstabilityMonitor(c.nan_patience, c.loss_spike_factor)
        window = None
        window_start, window_steps, data_wait, first_step = time.perf_counter(), 0, 0.0, True
        # The host reads a step's loss only after dispatching the next one, so the devices never wait for the
        # host between steps; at a log, save or eval step the reads catch up first.
        pending = None  # (step, metrics) dispatched but not yet read
        try:
            while self.step < schedule.total_steps:
                if self._stop_check_due() and stop.agreed():
                    read, pending = pending, None
                    if read is not None and self._observe(*read, monitor):
                        window = None
                        continue  # rolled back: go on from the checkpoint, and stop at the next check
                    self.save(force=True)
                    self.checkpoints.wait()
                    self._say(f"{stop.received or 'stop signal'}: saved checkpoint {self.step} in {self.run_dir}; "
                              "exiting. Continue with --config.resume=latest")
                    return {"stopped_at": self.step}
                t0 = time.perf_counter()
                batch = self._next_batch()
                data_wait += time.perf_counter() - t0
                self.state, metrics = self.engine.step_fn(self.state, batch)
                self.step += 1
                window_steps += 1
                if first_step:  # compilation is not training speed: time the window from here
                    jax.block_until_ready(metrics)
                    first_step, window_start, window_steps, data_wait = False, time.perf_counter(), 0, 0.0
                if pending is not None:
                    read, pending = pending, None
                    if self._observe(*read, monitor):
                        window = None
                        continue  # the step just dispatched belongs to the abandoned trajectory
                    window = self._merge(window, read[1])
                pending = (self.step, metrics)
                log_due = self.step % c.log_every_n_steps == 0 or self.step == schedule.total_steps
                save_due, zeroshot_due = self._save_due(), self._zeroshot_due()
                if not (log_due or save_due or zeroshot_due):
                    continue
                read, pending = pending, None  # catch up: what is logged or saved has been checked
                if self._observe(*read, monitor):
                    window = None
                    continue
                window = self._merge(window, read[1])
                if log_due:
                    elapsed = time.perf_counter() - window_start
                    self._log_window(window, window_steps, elapsed, data_wait)
                    window, window_start, window_steps, data_wait = None, time.perf_counter(), 0, 0.0
                if save_due:
                    self.save()
                if zeroshot_due:
                    self._record(self.step, self.zeroshot())
            self.save(force=True)
            self.checkpoints.wait()
            results = {"step": self.step}
            if c.zeroshot_data:
                results.update(self.zeroshot())
                self._record(self.step, results)
            self._say(f"done: {self.step} steps in {self.run_dir}" + "".join(
                f", {k} {v:.4f}" for k, v in results.items() if k.startswith("zeroshot")))
            return results
        finally:
            stop.restore()
            self.checkpoints.wait()

    def _stop_check_due(self) -> bool:
        """Every step in one process; every STOP_CHECK_EVERY_STEPS steps across processes, where agreeing on a
        signal is a collective that makes the host wait for the devices."""
        return jax.process_count() == 1 or self.step % STOP_CHECK_EVERY_STEPS == 0

    def _observe(self, step: int, metrics: dict, monitor: InstabilityMonitor) -> bool:
        """Reads step `step`'s loss; counts a skipped update; rolls back (returning True) when the monitor sees a
        problem."""
        loss, finite = (float(x) for x in jax.device_get((metrics["loss"], metrics["finite"])))
        if not finite:
            self.skipped_updates += 1
            log.warning("step %d: non-finite loss or gradients, update skipped", step)
        problem = monitor.observe(loss, bool(finite))
        if problem:
            self._roll_back(problem, at_step=step)
            monitor.reset()
            return True
        return False

    @staticmethod
    def _merge(window, metrics: dict):
        if not bool(metrics["finite"]):  # a skipped step's loss would only turn the window's averages into NaN
            return window
        update = TrainMetrics.single_from_model_output(**metrics)
        return update if window is None else window.merge(update)

    def _log_window(self, window, steps: int, elapsed: float, data_wait: float) -> None:
        scalars = window_scalars(window) if window is not None else {}
        if not scalars:
            return
        samples_per_sec = steps * self.schedule.global_batch / max(elapsed, 1e-9)
        peak = self._peak_flops()
        remaining = self.schedule.total_steps - self.step
        scalars.update(
            samples_per_sec=samples_per_sec,
            samples_per_sec_per_device=samples_per_sec / jax.device_count(),
            mfu=(samples_per_sec * self.flops_per_sample / (peak * jax.device_count())) if peak else None,
            data_wait_fraction=data_wait / max(elapsed, 1e-9),
            skipped_samples=sum(self.data_iter.skipped_samples().values()),
            skipped_updates=self.skipped_updates,
            eta_seconds=remaining * elapsed / max(steps, 1),
            epoch=self.schedule.epoch(self.step),
            samples_seen=self.step * self.schedule.global_batch,
        )
        self._say(progress_line(self.step, self.schedule.total_steps, self.schedule.epoch(self.step), scalars))
        self._record(self.step, {k: v for k, v in scalars.items() if v is not None})

    # -- zero-shot ------------------------------------------------------------------------------------------

    def _zeroshot_due(self) -> bool:
        c = self.config
        if not c.zeroshot_data or not c.zeroshot_frequency or self.step == self.schedule.total_steps:
            return False  # the final eval runs after the loop
        per_epoch = self.step % self.schedule.steps_per_epoch == 0
        return per_epoch and (self.step // self.schedule.steps_per_epoch) % c.zeroshot_frequency == 0

    def zeroshot(self) -> dict:
        from clip_jax.evaluation.classification import evaluate_zeroshot
        from clip_jax.evaluation.datasets import open_classification_set

        c = self.config
        kind, location = ("demo", None) if c.zeroshot_data == "demo" else ("imagenet-val", c.zeroshot_data)
        dataset = open_classification_set(kind, location)
        if c.zeroshot_samples:
            dataset = dataset.head(c.zeroshot_samples)
        # Evaluate in fp32 compute on the same parameters (any policy's params load into it).
        model = create_model(c.model)
        batch = max(self.mesh.size, (256 // self.mesh.size) * self.mesh.size)
        metrics = evaluate_zeroshot(model, self.state.params, dataset, self.mesh, batch_size=batch,
                                    mean=tuple(c.image_mean), std=tuple(c.image_std))
        result = {f"zeroshot_{k}": float(v) for k, v in metrics.items() if k.startswith("top")}
        self._say(f"zero-shot on {dataset.name} at step {self.step}: " +
                  ", ".join(f"{k} {v:.4f}" for k, v in result.items()))
        return result


def train(config: ml_collections.ConfigDict) -> dict:
    trainer = Trainer(config)
    try:
        return trainer.train()
    finally:
        trainer.checkpoints.close()
        trainer.data_iter.close()  # stops the worker processes and frees their shared memory
        if trainer.writer is not None:
            trainer.writer.close()


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
    except (ValueError, FileNotFoundError, TrainingUnstable, DistributedInitError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    app.run(main)
