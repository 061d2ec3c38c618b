"""A checkpoint of another model or optimizer is refused with the differences named, before Orbax reads it."""

import sys
import types

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from clip_jax.runtime.checkpoints import CheckpointMeta, CheckpointMismatchError, RunCheckpoints
from clip_jax.training.train_step import TrainState


def train_state(width: int, *, extra: bool = False, dtype=jnp.float32) -> TrainState:
    params = {"visual": {"conv1": {"kernel": jnp.arange(4.0 * width, dtype=dtype).reshape(4, width)}},
              "logit_scale": jnp.asarray(2.0, dtype)}
    if extra:
        params["text_projection"] = jnp.ones((width, 3), dtype)
    return TrainState(params, optax.adamw(1e-3).init(params), jnp.asarray(7, jnp.int32))


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


@pytest.fixture()
def saved(tmp_path):
    checkpoints = RunCheckpoints(str(tmp_path / "checkpoints"), async_save=False)
    data_iter = iter(grain.MapDataset.range(4).to_iter_dataset())
    meta = CheckpointMeta(step=7, model="ViT-tiny-8", precision="fp32", global_batch=8, samples_seen=56, epoch=0.5)
    checkpoints.save(7, train_state(8), data_iter, meta)
    checkpoints.wait()
    yield checkpoints
    checkpoints.close()


def test_a_state_of_the_same_shapes_restores_also_in_another_dtype(saved):
    state, meta = saved.restore(7, abstract(train_state(8, dtype=jnp.bfloat16)))
    assert meta.model == "ViT-tiny-8" and meta.process_count is None  # not recorded: None
    assert state.params["visual"]["conv1"]["kernel"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(state.params["visual"]["conv1"]["kernel"], np.float32),
                                  np.arange(32.0).reshape(4, 8))


def test_another_width_is_refused_naming_the_leaf_both_shapes_and_the_saved_model(saved):
    with pytest.raises(CheckpointMismatchError) as error:
        saved.restore(7, abstract(train_state(16)))
    message = str(error.value)
    assert "model ViT-tiny-8" in message and "--config.model" in message
    assert "params/visual/conv1/kernel: saved (4, 8), this run (4, 16)" in message
    assert "3 leaves differ" in message  # the kernel and Adam's two moments of it


def test_a_leaf_only_this_run_has_is_named(saved):
    with pytest.raises(CheckpointMismatchError, match="params/text_projection: only in this run"):
        saved.restore(7, abstract(train_state(8, extra=True)))


def test_a_full_disk_leaves_no_writer_threads_or_closed_event_loops_traceback_beside_the_runs_line(monkeypatch):
    """TensorBoard's event writer thread dying of the full disk, and asyncio's "Event loop is closed" of a stopped
    save's coroutines, reach no hook that prints them while the command runs (the run's one line says it);
    anything else still does, and the hooks are as before afterwards."""
    import errno
    import logging
    import threading

    from clip_jax.runtime.storage_faults import quiet_orbax_records

    reached = []  # what the hooks in place before (Python's, which print a traceback) were handed
    monkeypatch.setattr(threading, "excepthook", lambda args: reached.append(args.exc_value))
    monkeypatch.setattr(sys, "unraisablehook", lambda args: reached.append(args.exc_value))
    # as a command's process starts: a run stopped by an error earlier in this process (an in-process test's)
    # leaves its asyncio filter on for the rest of it
    monkeypatch.setattr(logging.getLogger("asyncio"), "filters", [])
    hooks = threading.excepthook, sys.unraisablehook

    def thread_dying_of(error):
        def run():
            raise error
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()

    def unraisable(error):
        sys.unraisablehook(types.SimpleNamespace(exc_type=type(error), exc_value=error, exc_traceback=None,
                                                 err_msg="Exception ignored in", object=None))

    def asyncio_task_failed(error) -> bool:
        record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Task exception was never retrieved",
                                   None, (type(error), error, None))
        return all(f.filter(record) for f in logging.getLogger("asyncio").filters)

    full, closed = OSError(errno.ENOSPC, "No space left on device"), RuntimeError("Event loop is closed")
    bug, other = KeyError("a bug"), RuntimeError("something else")
    with quiet_orbax_records():
        thread_dying_of(full)
        unraisable(closed)
        assert not asyncio_task_failed(closed) and not asyncio_task_failed(full)  # a stopped save's futures
        assert reached == []
        thread_dying_of(bug)
        unraisable(other)
        assert asyncio_task_failed(other)
        assert reached == [bug, other]
    assert (threading.excepthook, sys.unraisablehook) == hooks and asyncio_task_failed(closed)
    assert asyncio_task_failed(full)


def test_orbax_records_the_run_tells_itself_stay_quiet_while_a_command_that_saves_runs(tmp_path):
    import logging

    from clip_jax.runtime.storage_faults import quiet_orbax_records

    def shown(message: str, level=logging.WARNING) -> bool:
        record = logging.LogRecord("absl", level, "/site-packages/orbax/checkpoint/checkpoint_manager.py", 1,
                                   message, None, None)
        return all(f.filter(record) for f in logging.getLogger("absl").filters)

    waited = "Waiting for previous save to complete took 1.5 seconds. If this number is high, consider ..."
    opened = RunCheckpoints.opened
    run = RunCheckpoints(str(tmp_path / "run"), async_save=False)
    other = RunCheckpoints(str(tmp_path / "run"), read_only=True)  # another run's, opened beside it
    assert shown(waited), "opening a checkpoint manager set a log filter: the command modules set it"
    with quiet_orbax_records():  # as `python -m clip_jax.train` and `clip_jax.finetune` run
        assert not shown(waited) and shown("some other Orbax warning")
        assert not shown("No space left on device [os_error_code='28']", logging.ERROR)
    assert shown(waited)
    other.close()
    other.close()  # closing twice counts once
    assert RunCheckpoints.opened == opened + 1  # the run's manager is still open
    run.close()
    assert RunCheckpoints.opened == opened
