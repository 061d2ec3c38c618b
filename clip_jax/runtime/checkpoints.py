"""A run's checkpoints: the train state, the data iterator's position and run metadata, saved together by Orbax.

Layout: `RUN_DIR/checkpoints/STEP/{state,data_iter,meta}`. Saves are asynchronous; on disk Orbax writes each step to
a temporary folder and renames it only when complete; on a bucket (`s3://`, `gs://`: no atomic rename) it writes the
step in place and marks it complete with `STEP/commit_success.txt` last. Either way a crash or `kill -9` mid-save
leaves the previous checkpoint intact and the half-written one is never listed or resumed from. Every process takes
part: each writes its shards of the state and its own data-iterator position (`data_iter/process_R-of-N.json`),
which only a run with the same data layout (process count and data workers per process) can restore; `meta` records
that layout.
"""

import contextlib
import dataclasses
import json
import re
from typing import Any

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.runtime import storage, storage_faults
from clip_jax.runtime.mesh import POLICY_STATE_KEY as POLICY_STATE

STATE, DATA_ITER, META = "state", "data_iter", "meta"
_DATA_ITER_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


class CheckpointNotFoundError(MissingInput):
    """No checkpoint where the run was told to resume from."""


class CheckpointMismatchError(InvalidInput):
    """The checkpoint holds another model's (or optimizer's) state than the run restoring it."""


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint records about the run that saved it, next to its state. Fields added after the first
    checkpoints were written are None when an older checkpoint lacks them."""

    step: int
    model: str
    precision: str
    global_batch: int
    samples_seen: int
    epoch: float
    skipped_updates: int = 0
    rollbacks: int = 0
    overflow_steps: int = 0  # steps skipped for an overflow of the scaled backward (fp16's loss scale)
    # the data layout and seed the saved iterator positions belong to
    process_count: int | None = None
    data_workers: int | None = None
    data_seed: int | None = None
    # the log window's sums at the save (resumed, the next log line averages the steps it would have without the
    # stop), and the sample filters the saved data position read under
    log_window: dict | None = None
    data_filter: dict | None = None
    task: str | None = None  # what the run trained ("pretraining", "fine-tuning": clip_jax.training.task)
    # the batch the run trains at (training.global_batch): per device, the config's batch_size that gave it, the
    # device count; and the schedule's segments [first step, samples seen before it, global batch] (training.schedule)
    per_device_batch: int | None = None
    batch_size_given: int | None = None
    device_count: int | None = None
    batch_segments: list | None = None
    # the data streams the run reads (data.stream_pipeline; None: one per process x worker, as the first
    # checkpoints), and the steps of an epoch at the run's first global batch (the epoch length stays the run's)
    data_streams: int | None = None
    epoch_steps: int | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, saved: dict) -> "CheckpointMeta":
        """The record of a saved `meta` item; keys this version does not know are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in saved.items() if k in known}
        defaults = {"step": 0, "model": "unknown", "precision": "unknown", "global_batch": 0, "samples_seen": 0,
                    "epoch": 0.0}
        return cls(**(defaults | fields))


class RunCheckpoints:
    """A run's checkpoint manager; close it (or use it in `with`): it holds Orbax's manager and its threads."""

    opened = 0  # managers of this process not closed yet (the test suite checks that none is left open)

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True, read_only: bool = False):
        """`read_only`: another run's checkpoints, restored from: nothing is created, saved, deleted or cleaned up
        there (that run may still be writing to it)."""
        self.directory = storage.absolute(directory)
        storage.prepare_for_orbax(self.directory)
        # On a bucket an interrupted save leaves a step folder without its commit file: Orbax's clean-up removes
        # it, so the step can be saved again.
        remote = self.remote = storage.is_remote(self.directory)
        # On a bucket the step folder is made before save() returns, so that a store that fails is told there: made
        # by a background thread that failed, the save waited minutes for its signal (Orbax's coordination timeout).
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep, enable_async_checkpointing=async_save, create=not read_only,
            cleanup_tmp_directories=remote and not read_only, read_only=read_only,
            temporary_path_class=storage.checkpoint_temporary_path_class(self.directory),
            async_options=ocp.AsyncOptions(create_directories_asynchronously=not remote))
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._saving: int | None = None  # the step of the save in flight, if any
        self._completed = self._manager.latest_step()  # the newest step known complete (a bucket may not answer)
        self._failed = False  # a save failed (full storage, a bucket that failed): told once, in one line
        self._open = True
        RunCheckpoints.opened += 1

    def save(self, step: int, state, data_iterator, meta: CheckpointMeta, *, force: bool = False) -> bool:
        """Starts saving (returns before the write finishes); a step already saved is skipped. `data_iterator`
        None: a run whose data position is a function of the step alone saves none. An empty policy slot is left
        out: a policy that owns no state writes the layout written before the slot existed."""
        if step in self._manager.all_steps():
            return False
        if getattr(state, POLICY_STATE, False) is None:  # saved by name, as restored
            state = {name: value for name, value in state._asdict().items() if name != POLICY_STATE}
        items = {STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta.to_json())}
        if data_iterator is not None:
            items[DATA_ITER] = grain.checkpoint.CheckpointSave(data_iterator)
        args = ocp.args.Composite(**items)
        self.wait()  # the previous save first (Orbax would wait for it too): a failure names the right step
        with self._storage_failure_told(step):
            started = self._manager.save(step, args=args, force=force)
        self._saving = step if started else None
        return started

    @contextlib.contextmanager
    def _storage_failure_told(self, step: int | None = None):
        """A context in which a full storage becomes `StorageFull`, and on a bucket a storage that failed after its
        retries `StorageFailed` (one line, raised once)."""
        try:
            yield
        except Exception as e:
            if self._failed:
                raise
            failed = f"saving checkpoint {step if step is not None else self._saving}"
            if storage_faults.is_out_of_space(e):
                self._failed = True
                raise storage_faults.storage_full(self.directory, failed, e,
                                                  latest_complete_step(self.directory)) from None
            if self.remote and storage_faults.is_storage_error(e):
                self._failed = True  # the bucket may not answer a listing now: the newest save seen to complete
                raise storage_faults.storage_failed(self.directory, failed, e, self._completed,
                                                    storage.retry_attempts()) from None
            raise

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, step: int, abstract_state, data_iterator=None, *,
                fresh_policy_state=None) -> tuple[object, CheckpointMeta]:
        """(state, meta) of `step`; `data_iterator`, if given, is moved to the saved position. `abstract_state` is
        a pytree of `jax.ShapeDtypeStruct` with shardings: leaves are loaded straight into those shardings and cast
        to those dtypes, so a run can resume on another mesh size or under another precision policy.

        A train state's `policy_state` slot (what a precision policy owns: fp16's loss scale) is restored by name
        when the checkpoint holds one of the structure `abstract_state` has; otherwise the saved slot is dropped
        and `fresh_policy_state` (the slot as a new run starts it; None under a policy that owns none), laid out as
        `abstract_state`'s, takes its place. A checkpoint written before the slot existed restores as one without
        it."""
        if step not in self._manager.all_steps():
            raise CheckpointNotFoundError(f"no checkpoint of step {step} in {self.directory}; "
                                          f"saved steps: {self.all_steps() or 'none'}")
        target, keep_slot = abstract_state, True
        if POLICY_STATE in getattr(abstract_state, "_fields", ()):
            target, keep_slot = _slot_fitted_target(_saved_tree(storage.join(self.directory, str(step), STATE)),
                                                    abstract_state)
        check_state_matches(self.directory, step, target)
        items = {STATE: ocp.args.StandardRestore(target), META: ocp.args.JsonRestore()}
        if data_iterator is not None:
            items[DATA_ITER] = grain.checkpoint.CheckpointRestore(data_iterator)
        args = ocp.args.Composite(**items)
        restored = self._manager.restore(step, args=args)
        state = restored[STATE]
        if target is not abstract_state:  # restored by name: back into the run's own state type
            slot = state.get(POLICY_STATE) if keep_slot else jax.device_put(
                fresh_policy_state, jax.tree.map(lambda leaf: leaf.sharding, abstract_state.policy_state))
            state = type(abstract_state)(**{**{name: state.get(name) for name in abstract_state._fields},
                                            POLICY_STATE: slot})
        return state, CheckpointMeta.from_json(dict(restored[META]))

    def wait(self) -> None:
        """Blocks until pending saves are on disk. After a save failed (already told), nothing is pending any
        more."""
        if self._failed:
            return
        with self._storage_failure_told():
            self._manager.wait_until_finished()
        if self._saving is not None:
            self._completed = self._saving
        self._saving = None

    def close(self) -> None:
        """Waits for pending saves (`wait`), then closes the manager, also when the wait fails."""
        try:
            self.wait()
        finally:
            try:
                self._manager.close()
            except Exception:
                if not self._failed:  # a failed save's error again: told already
                    raise
            finally:
                if self._open:
                    self._open = False
                    RunCheckpoints.opened -= 1

    def __enter__(self) -> "RunCheckpoints":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_meta(directory: str, step: int) -> CheckpointMeta | None:
    """The run metadata saved with checkpoint `step` under `directory` (None when it has none), read as a plain
    file: no Orbax manager and no collective, so every process can look before deciding how to restore."""
    path = storage.join(directory, str(step), META, "metadata")
    if not storage.isfile(path):
        return None
    return CheckpointMeta.from_json(json.loads(storage.read_text(path)))


def saved_process_count(meta: CheckpointMeta | None, data_iter_files: list[str]) -> int | None:
    """How many processes saved a checkpoint: `meta.process_count`, or, for checkpoints that predate that field,
    the N of the data-iterator files `process_R-of-N.json`; None when neither tells."""
    if meta is not None and meta.process_count is not None:
        return int(meta.process_count)
    counts = {int(m.group(2)) for m in map(_DATA_ITER_FILE.fullmatch, data_iter_files) if m}
    if len(counts) > 1:
        raise InvalidInput(f"data-iterator files of several process counts {sorted(counts)}: "
                         f"{sorted(data_iter_files)}")
    return counts.pop() if counts else None


def read_stream_positions(directory: str, step: int, streams: range, *, data_streams: int,
                          saved_processes: int) -> dict[int, Any]:
    """The saved states of `streams` (of a run read as `data_streams` streams, `data.stream_pipeline`) from the
    data-iterator files of checkpoint `step`, read as plain files: stream s is in the file of the process that
    owned it, `process_{s // (data_streams / saved_processes)}-of-{saved_processes}.json`, whatever the process
    count now. A file or stream that is not there is one line naming it."""
    per_file, files, positions = data_streams // saved_processes, {}, {}
    for s in streams:
        name = f"process_{s // per_file}-of-{saved_processes}.json"
        path = storage.join(directory, str(step), DATA_ITER, name)
        if name not in files:
            if not storage.isfile(path):
                raise InvalidInput(f"checkpoint {directory}/{step} lacks {DATA_ITER}/{name}, the position of data "
                                   f"stream {s}: resume from a complete checkpoint, or set "
                                   "--config.resume_data=allow_reseed")
            files[name] = json.loads(storage.read_text(path)).get("streams", {})
        if str(s) not in files[name]:
            raise InvalidInput(f"{path} holds no position for data stream {s} of {data_streams}: it was not saved "
                               "by a run read as those streams; set --config.resume_data=allow_reseed")
        positions[s] = files[name][str(s)]
    return positions


def data_iter_files(directory: str, step: int) -> list[str]:
    return [name for name in storage.listdir(storage.join(directory, str(step), DATA_ITER))
            if name != storage.COMMIT_FILE]


def _saved_tree(state_dir: str):
    """The saved state's tree with array metadata (shapes, dtypes) at the leaves; reads no array."""
    return ocp.PyTreeCheckpointHandler().metadata(epath.Path(state_dir)).tree


def _slot_fitted_target(saved: dict, abstract_state) -> tuple[dict, bool]:
    """(what to restore a checkpoint whose saved state tree is `saved` into, whether its policy slot is the run's):
    `abstract_state`'s fields by name, the fields the checkpoint lacks left out, and a saved policy slot of another
    structure than the run's read as saved (to be dropped)."""
    wanted = abstract_state.policy_state
    saved_slot = saved.get(POLICY_STATE)
    fits = (saved_slot is None) == (wanted is None) and (wanted is None or _shapes(saved_slot) == _shapes(wanted))
    target = {name: getattr(abstract_state, name) for name in abstract_state._fields if name in saved}
    if not fits:
        target.pop(POLICY_STATE, None)
        if saved_slot is not None:  # read as saved, then dropped
            sharding = abstract_state.step.sharding  # replicated, as the slot is
            target[POLICY_STATE] = jax.tree.map(
                lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), saved_slot)
    return target, fits


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="/"): tuple(leaf.shape) for path, leaf in leaves}


def check_state_matches(directory: str, step: int, abstract_state) -> None:
    """Raises `CheckpointMismatchError` naming the differences when checkpoint `step` does not hold a state of
    `abstract_state`'s structure and shapes (another model, another optimizer); dtypes may differ."""
    saved = _shapes(_saved_tree(storage.join(directory, str(step), STATE)))
    wanted = _shapes(abstract_state)
    if saved == wanted:
        return
    differences = [f"{k}: saved {saved[k]}, this run {wanted[k]}" for k in sorted(saved.keys() & wanted.keys())
                   if saved[k] != wanted[k]]
    differences += [f"{k}: only in the checkpoint" for k in sorted(saved.keys() - wanted.keys())]
    differences += [f"{k}: only in this run" for k in sorted(wanted.keys() - saved.keys())]
    meta = read_meta(directory, step)
    saved_model = meta.model if meta is not None else "unknown"
    raise CheckpointMismatchError(
        f"checkpoint {storage.join(directory, str(step))} (model {saved_model}) does not fit this run's model and "
        f"optimizer: {len(differences)} leaves differ, e.g. " + "; ".join(differences[:4])
        + ". Set --config.model to the checkpoint's model, or resume from a checkpoint of this model.")


def latest_complete_step(directory: str) -> int | None:
    """The newest complete step under `directory`: on disk Orbax's temporary folders of unfinished saves are not
    steps; on a bucket a step folder without its commit file is an unfinished save."""
    steps = [int(name) for name in storage.listdir(directory) if re.fullmatch(r"\d+", name)]
    return next((step for step in sorted(steps, reverse=True) if is_complete(directory, str(step))), None)


def is_complete(directory: str, name: str) -> bool:
    """Whether step folder `name` under `directory` holds a complete checkpoint (see `latest_complete_step`)."""
    step_dir = storage.join(directory, name)
    if storage.is_remote(directory):
        return storage.isfile(storage.join(step_dir, storage.COMMIT_FILE))
    return storage.isdir(storage.join(step_dir, STATE))


def read_step_variables(directory: str, step: int) -> dict:
    """Host variables of checkpoint `step` under the checkpoints folder `directory`: `{"params": ...}`, and
    `"batch_stats"` (float statistics float32, `num_batches_tracked` int32) when the run's image tower is a ResNet;
    what `model.apply` takes in eval mode (`run_directory.read_variables` reads them from a run's path)."""
    import numpy as np

    storage.prepare_for_orbax(directory)
    state_dir = storage.join(storage.absolute(directory), str(step), STATE)  # Orbax reads absolute paths only
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), _saved_tree(state_dir))
    state = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    to_host = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: x.astype(np.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
    variables = {"params": to_host(state["params"])}
    if state.get("batch_stats") is not None:
        variables["batch_stats"] = to_host(state["batch_stats"])
    return variables
