"""Where a run starts, decided before anything is built: its directory, the checkpoint it continues (if any), that
checkpoint's record, and how the data iterators begin (`RunStart`, from `plan_run_start`), for the run's task
(`clip_jax.training.task`): a checkpoint another task saved is refused in one line.

Everything here reads files and the config only (no devices, no Orbax manager; the one collective, the clock that
names an unnamed run, is handed in), so a refused resume costs nothing and writes nothing. On another topology the
data streams go on from their saved positions where the processes can own them whole; where they cannot, or for a
checkpoint of the per-process layout on another layout, `--config.resume_data=allow_reseed` restores the train
state only and reads on with new data iterators (`training.data_resume`). A task whose data position is a function
of the step (`Task.data_by_step`) saves none and reads on from the step it resumes at, whatever the layout. The run's global batch is the checkpoint's, whatever the
device count (`global_batch.batch_plan`): the per-device batch is derived from it here.
"""

import dataclasses
import json
import os
import time
from collections.abc import Callable

import jax
import numpy as np

from clip_jax import cli
from clip_jax.errors import InvalidInput, RunFailed, UserError
from clip_jax.runtime import storage
from clip_jax.runtime.checkpoints import (CheckpointMeta, data_iter_files, latest_complete_step, read_meta,
                                          saved_process_count)
from clip_jax.runtime.run_directory import RunDirectory, resolve_resume
from clip_jax.runtime.run_layout import CHECKPOINTS, CONFIG, METRICS, reported_entries
from clip_jax.training.config_checks import report_targets
from clip_jax.training.data_resume import DataResume, data_resume_plan, fresh_data, reseeded_data_seed  # noqa: F401
from clip_jax.training.global_batch import BatchPlan, batch_plan
from clip_jax.training.policy_state import resume_note
from clip_jax.training.task import COMMANDS


@dataclasses.dataclass(frozen=True)
class RunStart:
    """A run's starting point. `resume_from` is (checkpoints directory, step), None for a fresh start."""

    directory: RunDirectory  # made before anything is written (it notes the folders it makes)
    resume_from: tuple[str, int] | None
    meta: CheckpointMeta | None  # the record saved with that checkpoint
    data: DataResume
    batch: BatchPlan  # the per-device and global batch the run trains at, and its schedule's segments
    notes: tuple[str, ...] = ()  # what the user is told before training

    @property
    def run_dir(self) -> str:
        return self.directory.path

    @property
    def step(self) -> int:
        """The step the run starts at (before its state is restored)."""
        return 0 if self.resume_from is None else self.resume_from[1]


def plan_run_start(config, task, *, process_count: int, now: Callable[[], int],
                   device_count: int | None = None) -> RunStart:
    """The run directory, the checkpoint `config.resume` names, the batch on `device_count` devices (default:
    all) and the data-resume plan of a run of `task`; a ValueError (or `CheckpointNotFoundError`), both
    `UserError`s, naming the way out when the run cannot start as configured. A run directory holding files of the
    names a run writes that clip_jax did not write is refused (`ownership.ForeignFiles`). `now()`: the time that
    names a run without a name (see `run_name`)."""
    devices = jax.device_count() if device_count is None else device_count
    directory = RunDirectory(storage.absolute(storage.join(config.logs, run_name(config, now))), task.entries)
    directory.refuse_foreign(writing=f"the {task.noun} {directory.name!r}")
    fresh = batch_plan(config, None, devices=devices, processes=process_count, step=0, where="")
    unused = ((f"resume_global_batch {config.resume_global_batch} is read when a run resumes: this run starts at "
               f"step 0 with global batch {fresh.global_batch} (batch_size {fresh.per_device} x {devices} devices)",)
              if config.get("resume_global_batch", 0) else ())
    if not config.resume:
        if latest_complete_step(directory.checkpoints) is not None:
            raise InvalidInput(f"run directory {directory.path} already has checkpoints: continue it with "
                               "--config.resume=latest, or start another run with --config.name=...")
        return RunStart(directory, None, None, fresh_data(config), fresh, unused)
    checkpoints, step = resolve_resume(config.resume, directory.path)
    if step is None:  # resume=latest with no checkpoint yet
        return RunStart(directory, None, None, fresh_data(config), fresh,
                        (f"no checkpoint in {directory.path} yet: starting fresh", *unused))
    meta, where = read_meta(checkpoints, step), f"{checkpoints}/{step}"
    check_saved_task(task, meta, where)
    batch = batch_plan(config, meta, devices=devices, processes=process_count, step=step, where=f"checkpoint {where}")
    if task.data_by_step:
        return RunStart(directory, (checkpoints, step), meta, DataResume(False, config.seed), batch,
                        tuple(note for note in (batch.note,) if note))
    data = data_resume_plan(config, meta, saved_process_count(meta, data_iter_files(checkpoints, step)),
                            where=where, step=step, process_count=process_count, device_count=devices,
                            global_batch=batch.global_batch, checkpoints=checkpoints)
    notes = (batch.note, data.note, filter_change_note(config, meta, where),
             resume_note(meta and meta.precision, config))
    return RunStart(directory, (checkpoints, step), meta, data, batch, tuple(note for note in notes if note))


def check_saved_task(task, meta: CheckpointMeta | None, where: str) -> None:
    """An InvalidInput naming the command to use when checkpoint `where` was saved by a run of another task (a
    checkpoint that predates the record is not checked: its state's shapes are)."""
    saved = meta.task if meta is not None else None
    if saved is not None and saved != task.name:
        command = COMMANDS.get(saved, "the command that saved it")
        raise InvalidInput(f"checkpoint {where} was saved by a {saved} run, this is a {task.name} run: continue it "
                           f"with {command}, or give this run another --config.name")


DATA_FILTER_FIELDS = ("train_data_filter", "train_data_min_image_size", "train_data_min_caption_chars",
                      "max_image_pixels", "train_data_image_key", "train_data_caption_key")


def data_filter_settings(config) -> dict:
    """The settings that decide which samples a run trains on (saved with each checkpoint)."""
    return {name: config[name] for name in DATA_FILTER_FIELDS if name in config}


def filter_change_note(config, meta: CheckpointMeta | None, where: str) -> str:
    """One line naming the sample-filter settings that differ from those checkpoint `where` was saved under ("" when
    none does, or the checkpoint predates the record)."""
    saved = meta.data_filter if meta is not None else None
    if not saved:
        return ""
    now = data_filter_settings(config)
    changed = [f"{name} {saved[name]!r} -> {now[name]!r}" for name in now if name in saved and saved[name] != now[name]]
    if not changed:
        return ""
    return (f"the data filter changed since checkpoint {where} was saved: {'; '.join(changed)}; the samples read from "
            "here on are filtered by the new settings, those counted before by the old")


def run_name(config, now: Callable[[], int]) -> str:
    """`config.name`, else the model's name and the time `now()` gives (the same on every process: process 0's
    clock, `processes.time_of_process_0`, a collective asked for only here)."""
    if config.name:
        return config.name
    if config.resume == "latest":
        raise InvalidInput("resume='latest' needs a run name: set --config.name=... (the same on every launch)")
    stamp = now()
    model = os.path.basename(config.model).removesuffix(".json")
    return f"{model}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(stamp))}"


def run_entries(config) -> list[str]:
    """What a run writes into its directory (`run_layout.RUN_ENTRIES` are all a pretraining run may hold)."""
    return [CONFIG, CHECKPOINTS, METRICS] + reported_entries(report_targets(config.report_to))


def check_run_locations(config) -> None:
    """Where the run writes (`logs`) and a remote `resume` (read), checked by every process (each writes its own
    shards and data-iterator files there) before anything is built: on disk, that the run directory can be written
    (or made); on a bucket, credentials, bucket, endpoint and the s3fs/gcsfs package. Each failure is one line naming
    the place. The processes agree on the outcome, so that none goes on to wait for the others."""
    remote = [(url, write) for url, write in ((config.logs, True), (config.resume, False))
              if url and url != "latest" and storage.is_remote(url)]
    probe = f".clip_jax_write_probe-{jax.process_index()}"
    problem = None
    try:
        if not storage.is_remote(config.logs):
            check_local_logs(config, probe)
        for url, write in remote:
            storage.check_location(url, write=write, probe=probe)
    except UserError as e:
        problem = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = np.flatnonzero(multihost_utils.process_allgather(np.int32(problem is not None)))
        if problem is None and failed.size:
            raise RunFailed(f"process(es) {failed.tolist()} cannot use the run's bucket ({remote[0][0]}): every "
                            "host needs the credentials, the network route and clipjax-train[remote]; see their "
                            "error" if remote else
                            f"process(es) {failed.tolist()} cannot write the run directory under {config.logs}: "
                            "see their error")
    if problem is not None:
        raise problem


def check_local_logs(config, probe: str) -> None:
    """An InvalidInput naming the folder when the run directory (`logs`/`name`) on disk can be neither written nor
    made."""
    target = os.path.join(config.logs, config.name) if config.name else config.logs
    reason = storage.unwritable(target, probe=probe)
    if reason:
        raise InvalidInput(f"cannot write the run directory {storage.absolute(target)}: {reason}; give "
                           "--config.logs a folder you can write to")


def unread_saved_fields(run_dir: str, config) -> str | None:
    """A line naming the fields the run's earlier `config.json` set that no config of its kind has (`config`: the
    resumed run's; a misspelling nobody read), said on resume before the file is written anew from the resumed run's
    config; None when there are none."""
    path = storage.join(run_dir, CONFIG)
    try:
        saved = json.loads(storage.read_text(path)) if storage.exists(path) else None
    except ValueError:
        return None
    unknown = cli.unknown_fields(saved, config) if isinstance(saved, dict) else []
    return f"{path} set " + "; ".join(unknown) + ": it was never read, and this run's config replaces it" if unknown \
        else None
