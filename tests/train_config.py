"""A training config for tests that launch the trainer as a process: the fields come as JSON in the environment.

Test seams, since this file runs inside the trainer's process:
- CLIP_JAX_TEST_PAUSE_AT=save (or evaluation) and CLIP_JAX_TEST_PAUSE_FILE=PATH: the trainer's first non-final
  checkpoint save (or first evaluation) creates PATH once it has started and waits until the test removes it, so
  that the test signals the trainer at that moment.
- CLIP_JAX_TEST_PAUSE_AT=write (or commit), CLIP_JAX_TEST_PAUSE_NTH=N (default 1) and CLIP_JAX_TEST_PAUSE_FILE=PATH:
  the background thread of this process's Nth checkpoint save waits while PATH-rankR exists (R: the process's rank,
  which creates it): `write` as the save's writes begin, nothing of it committed (every process); `commit` once
  every process has written its part, before the commit (the rename of the temporary folder on disk, the commit
  file on a bucket), which process 0 alone makes. The training goes on meanwhile, up to the next save.
- CLIP_JAX_TEST_SLOW_RANK=R:SECONDS: the process of rank R takes SECONDS longer to read its first batch (a rank
  that sets up more slowly than the others).
- CLIP_JAX_TESTS_XLA_CACHE (set by tests/conftest.py): every rank reads the session's compilation cache.
- CLIP_JAX_TEST_SAVE_LOG=PATH: each process appends a JSON line to PATH when a checkpoint save begins
  (`{"event": "begin", "step", "rank", "t"}`, t: time.time(); `"skipped"` follows when the step was saved before)
  and when its background part ends (`"end"`: on every process after process 0 has committed it; `"failed"`).

The orbax seams replace functions of orbax.checkpoint 0.12's async checkpointer, the cache seam one of jax 0.10's
cache key (test seams, not APIs)."""

import json
import os
import time

from clip_jax.run_config import default_config

PAUSE_AT, PAUSE_FILE, PAUSE_NTH = "CLIP_JAX_TEST_PAUSE_AT", "CLIP_JAX_TEST_PAUSE_FILE", "CLIP_JAX_TEST_PAUSE_NTH"
SAVE_LOG, SLOW_RANK = "CLIP_JAX_TEST_SAVE_LOG", "CLIP_JAX_TEST_SLOW_RANK"
SAVE_PHASES = {"write": "_background_wait_for_commit_futures", "commit": "_on_commit_callback"}


def get_config():
    c = default_config()
    for key, value in json.loads(os.environ["CLIP_JAX_TEST_CONFIG"]).items():
        c[key] = tuple(value) if isinstance(value, list) else value
    moment = os.environ.get(PAUSE_AT)
    if moment in SAVE_PHASES:
        pause_in_save(moment, int(os.environ.get(PAUSE_NTH, "1")), os.environ[PAUSE_FILE])
    elif moment:
        pause_once_at(moment, os.environ[PAUSE_FILE])
    if os.environ.get(SAVE_LOG):
        log_saves(os.environ[SAVE_LOG])
    slow_rank, _, seconds = os.environ.get(SLOW_RANK, "").partition(":")
    if slow_rank == rank():
        slow_first_batch(float(seconds))
    if os.environ.get("CLIP_JAX_TESTS_XLA_CACHE"):
        share_compiled_programs_across_ranks()
    return c


def share_compiled_programs_across_ranks() -> None:
    """The test session's persistent compilation cache (tests/conftest.py) serves every rank, not only process 0
    (the only one that writes to it). JAX keys a CPU program by the topology of the calling process's devices,
    which differs between processes, so rank 1 never found what rank 0 wrote and compiled every program itself;
    keyed instead by the device kinds, a program spanning all processes has one key (the device ids stay in it,
    through the compile options' device assignment)."""
    from jax._src import cache_key

    if hasattr(cache_key, "_hash_accelerator_config") and hasattr(cache_key, "_hash_devices"):  # else: slower only
        cache_key._hash_accelerator_config = cache_key._hash_devices


def slow_first_batch(seconds: float) -> None:
    from clip_jax.training.trainer import Trainer

    original, slowed = Trainer._next_batch, []

    def slow(self):
        if not slowed:
            slowed.append(True)
            time.sleep(seconds)
        return original(self)

    Trainer._next_batch = slow


def wait_while_exists(path: str, timeout: float = 120) -> None:
    """Creates `path` and returns once it is removed (or after `timeout` seconds)."""
    open(path, "w").close()
    deadline = time.time() + timeout
    while os.path.exists(path) and time.time() < deadline:
        time.sleep(0.02)


def pause_once_at(moment: str, path: str) -> None:
    from clip_jax.runtime.checkpoints import RunCheckpoints
    from clip_jax.training.evaluations import Evaluations

    cls, name = {"save": (RunCheckpoints, "save"), "evaluation": (Evaluations, "run")}[moment]
    original, paused = getattr(cls, name), []

    def pausing(self, *args, **kwargs):
        if moment == "save":  # the save is under way (written in the background) while the trainer waits
            result = original(self, *args, **kwargs)
        if not paused and not kwargs.get("force"):
            paused.append(True)
            wait_while_exists(path)
        return result if moment == "save" else original(self, *args, **kwargs)

    setattr(cls, name, pausing)


def rank() -> str:
    return os.environ.get("CLIP_JAX_PROCESS_ID", "0")  # set by launch/local.py; one process: 0


def pause_in_save(phase: str, nth: int, path: str) -> None:
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    name = SAVE_PHASES[phase]
    original, calls = getattr(async_checkpointer, name), [0]

    def pausing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            wait_while_exists(f"{path}-rank{rank()}")
        return original(*args, **kwargs)

    setattr(async_checkpointer, name, pausing)


def log_saves(path: str) -> None:
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    from clip_jax.runtime.checkpoints import RunCheckpoints

    save, background = RunCheckpoints.save, async_checkpointer._background_wait_for_commit_futures
    # the steps whose saves started and whose background part has not ended, oldest first: a save's background part
    # ends in the order the saves started, and may end after the next save was asked for (that save waits for it),
    # so an ending belongs to the oldest step here, not to the newest asked for
    pending = []

    def record(event: str, step: int) -> None:
        line = {"event": event, "step": step, "rank": int(rank()), "t": time.time()}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def logged_save(self, step, *args, **kwargs):
        pending.append(step)  # before the call: its background part may begin, and end, before it returns
        record("begin", step)
        started = save(self, step, *args, **kwargs)
        if not started:  # saved before: no background part
            pending.remove(step)
            record("skipped", step)
        return started

    def logged_background(*args, **kwargs):
        try:
            result = background(*args, **kwargs)
        except BaseException:
            record("failed", pending.pop(0) if pending else -1)
            raise
        record("end", pending.pop(0) if pending else -1)
        return result

    RunCheckpoints.save = logged_save
    async_checkpointer._background_wait_for_commit_futures = logged_background
