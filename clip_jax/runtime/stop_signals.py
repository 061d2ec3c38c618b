"""Stopping a run: SLURM's warning signal (SIGTERM, see launch/: --signal=TERM@300) or Ctrl-C (SIGINT, to the whole
process group) is remembered instead of killing the process mid-step (`StopSignal`), the processes of a run agree
on it so that all of them save the same step (`StopSignal.agreed`), data workers leave both signals to their main
process (`held_back`, `ignore_in_worker`), and long work gives way to a stop within one piece (`cut_short_if`).

The command line (`python -m clip_jax.train`) starts remembering before it imports the trainer, so a signal at any
moment from start-up on is seen: the trainer looks at it between its set-up phases (`raise_if_received`, agreed
across processes as between steps; exit `EXIT_STOPPED` with nothing saved) and between steps (a checkpoint, exit
0). A second SIGINT stops the process at once (as soon as the call the main thread is in returns), in one line,
without saving.

**Whoever honours a stop is handed the check.** Work that runs in many pieces (every batch an evaluation encodes,
every shard the demo's data writer writes) takes a `should_stop` and calls `cut_short_if(should_stop)` before each
piece, which raises `CutShort` once it answers True; without one (`never`) it runs to the end. The trainer hands its
evaluations `StopSignal.agreed`, a collective: whoever hands over a check that is a collective must make sure every
process runs the same pieces. The evaluations do (their loops are the same length on every process); a shard writer
does not (one process writes while the others wait for it), so it is handed a check of this process's signal only.

**Data workers.** Ctrl-C reaches every process of the group, and SLURM signals every process of a step. A data
worker that takes the signal dies with a traceback of its own, and the main process then fails on the next batch
("Worker process was terminated unexpectedly") instead of saving. Grain spawns the workers from its own threads,
and a spawned interpreter imports for a second or more before a worker's init function runs, so setting the
disposition there alone comes too late: every call into the pipeline holds both signals back in its thread
(`held_back`); threads it starts inherit that mask, and so do the processes they spawn, which stay deaf until
`ignore_in_worker` (their init function) ignores both signals and lets them through again. The main process's own
handler still gets every signal: one that a thread holds back goes to another thread, or waits until the mask is
restored. Multiprocessing's resource tracker must be running before (`start_resource_tracker`): CPython starts it
with both signals blocked and then unblocks them in the starting thread, whatever that thread's mask was. A worker
whose main process is gone (SIGKILL, or a second Ctrl-C that exits at once) exits too.

**Commands** (`clip_jax.runtime.entry`) other than the trainer stop at once instead: SIGINT raises KeyboardInterrupt,
files half-written (`unfinished`) are removed, and a compile, which holds the main thread in native code where no
Python handler runs, is ended by a watcher thread (`ctrl_c_ends_compiles`). A test seam makes a command signal itself
at a named moment (`reached`).
"""

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from clip_jax.runtime import private_apis

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_STOPPED = 128 + signal.SIGINT  # what a shell reports for a command that Ctrl-C ended: 130
PARENT_CHECK_SECONDS = 1.0  # how often a data worker looks whether its main process is still there


class Stopped(Exception):
    """A stop signal arrived before the run had anything to save (its message is the line to print)."""


class CutShort(Exception):
    """A stop signal arrived during work that gives way to it. `done`: what finished before it, for whoever runs
    several pieces of work and keeps their results (the evaluations' metrics)."""

    def __init__(self):
        super().__init__("cut short by a stop signal")
        self.done: dict = {}


class StopSignal:
    """Remembers SIGTERM/SIGINT instead of dying mid-step; a second SIGINT exits at once (status 130)."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def _handle(self, signum, frame):
        if self.received and signum == signal.SIGINT:
            # os.write, not print: the main thread may be inside a print. Pending saves are not waited for (a
            # checkpoint is written to a temporary folder first, so a half-written one is never taken for a step).
            os.write(2, f"{self.received} then SIGINT: stopped at once, nothing more saved\n".encode())
            os._exit(EXIT_STOPPED)
        self.received = self.received or signal.Signals(signum).name

    def raise_if_received(self, moment: str) -> None:
        """Raises `Stopped` when a signal has arrived here or, once the processes have joined, in any process of the
        run; `moment` ("while writing the data shards") goes in its line. A collective like `agreed`: every process
        stops at the same check, instead of one leaving while the others wait for it in their next collective."""
        if self.agreed():
            raise Stopped(f"{self.received or 'a stop signal to another process'} {moment}: stopped before the "
                          "first step, nothing saved")

    def agreed(self) -> bool:
        """True on every process once any process got a signal (they then save the same step). A collective when
        the run has several processes."""
        import jax

        flag = self.received is not None
        if jax.process_count() > 1:
            import numpy as np
            from jax.experimental import multihost_utils

            flag = bool(np.any(multihost_utils.process_allgather(np.int32(flag))))
        return flag

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


# -- long work that gives way ---------------------------------------------------------------------------------

def never() -> bool:
    """The check of work that nobody stops: it runs to the end."""
    return False


def cut_short_if(should_stop: Callable[[], bool]) -> None:
    """Raises `CutShort` when `should_stop()` answers True; called before each piece of long work."""
    if should_stop():
        raise CutShort()


# -- data workers ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def held_back() -> Iterator[None]:
    """SIGINT and SIGTERM blocked in this thread while inside, and in the threads and processes it starts."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start_resource_tracker() -> None:
    """Starts multiprocessing's resource tracker unless it runs, leaving this thread's signal mask as it was."""
    from multiprocessing import resource_tracker

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_in_worker(worker_index: int = 0, worker_count: int = 1) -> None:
    """A data worker's init function (Grain's `worker_init_fn`): SIGINT and SIGTERM ignored, then unblocked (one
    that arrived while they were blocked is dropped); the worker exits when its main process does."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True,
                     name=f"exit-with-parent-{worker_index}-of-{worker_count}").start()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_SECONDS)
    os._exit(0)


# -- files a command is writing -------------------------------------------------------------------------------

_unfinished: set[str] = set()  # local paths being written now, removed if the process is stopped meanwhile
_unfinished_lock = threading.Lock()
_ending = threading.Event()  # set once the process ends at once (the entry's watcher): nothing new is begun


@contextlib.contextmanager
def unfinished(path: str) -> Iterator[str]:
    """`path` (a local file written inside the block, e.g. under a staging name) is removed when the command is
    stopped before the block ends (`remove_unfinished`), so that a half-written file never remains. Once the
    process is ending at once, a new file is not begun: the call waits for the end."""
    with _unfinished_lock:
        if _ending.is_set():
            threading.Event().wait()  # os._exit is on its way from the thread that set it
        _unfinished.add(path)
    try:
        yield path
    except BaseException:  # KeyboardInterrupt among them
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        raise
    finally:
        with _unfinished_lock:
            _unfinished.discard(path)


def remove_unfinished(*, ending: bool = False) -> list[str]:
    """Removes the files being written now (`unfinished`); returns their paths. `ending`: the process ends at once
    after this (no file is begun meanwhile)."""
    with _unfinished_lock:
        if ending:
            _ending.set()
        removed = sorted(_unfinished)
        for path in removed:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        _unfinished.clear()
    return removed


# -- the test seam: a process that signals itself at a named moment -------------------------------------------

TEST_SIGINT_AT = "CLIP_JAX_TEST_SIGINT_AT"  # "MOMENT" or "MOMENT:N" (the Nth time); tests only
_reached: dict[str, int] = {}


def reached(moment: str) -> None:
    """Marks a moment of a command's work ("start", "batch": an evaluation's next batch about to be encoded,
    "write": a file written under its staging name, not yet in place). Does nothing, unless the test seam `CLIP_JAX_TEST_SIGINT_AT=MOMENT[:N]` names it: then the
    process sends itself SIGINT the Nth time (default: the first) it gets there, as a Ctrl-C at that moment would."""
    wanted, _, nth = os.environ.get(TEST_SIGINT_AT, "").partition(":")
    if wanted != moment:
        return
    _reached[moment] = _reached.get(moment, 0) + 1
    if _reached[moment] == int(nth or 1):
        signal.raise_signal(signal.SIGINT)


def reset_moments() -> None:
    """Counts the moments afresh (a command run again in the same process)."""
    _reached.clear()


# -- Ctrl-C in a command, a compile included -------------------------------------------------------------------

@contextlib.contextmanager
def ctrl_c_ends_compiles(line: str) -> Iterator[None]:
    """Inside: SIGINT raises KeyboardInterrupt in the main thread, unless the main thread is compiling; then the
    watcher thread prints `line`, removes the unfinished files and ends the process at once with status 130."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    watch = _Watch(read_end, line)
    watcher = threading.Thread(target=watch.run, daemon=True, name="ctrl-c-watcher")
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    previous_handler = signal.signal(signal.SIGINT, watch.handle)
    if os.environ.get(TEST_SIGINT_AT, "").startswith("compile"):
        private_apis.at_each_compile(lambda: reached("compile"))
    reset_moments()
    watcher.start()
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        signal.set_wakeup_fd(previous_fd)
        os.close(write_end)  # the watcher reads the end of the pipe and returns
        watch.handled.set()
        watcher.join()
        os.close(read_end)


class _Watch:
    """The two halves of a SIGINT: `handle`, the Python handler (run by the main thread once it runs Python), and
    `run`, the watcher thread, woken by the interpreter's C-level handler through the wakeup pipe as the signal
    arrives. A compile on the main thread (JAX's compiler on its stack) is ended by the watcher: at once when it is in
    native code, where the handler cannot run; after the handler, which leaves it to the watcher, when the signal
    came in its Python part. Anywhere else the handler raises KeyboardInterrupt and the watcher does nothing."""

    def __init__(self, read_end: int, line: str):
        self.read_end, self.line = read_end, line
        self.handled, self.deferred = threading.Event(), False

    def handle(self, signum, frame) -> None:
        self.deferred = private_apis.jax_compiling(frame)
        self.handled.set()
        if not self.deferred:
            raise KeyboardInterrupt

    def run(self) -> None:
        while True:
            received = os.read(self.read_end, 64)
            if not received:
                return
            if signal.SIGINT not in received:
                continue
            if not private_apis.jax_compiling(sys._current_frames().get(threading.main_thread().ident)):
                self.handled.wait()  # the main thread runs Python: its handler decides
                self.handled.clear()
                if not self.deferred:
                    continue
            remove_unfinished(ending=True)
            os.write(2, (self.line + "\n").encode())
            os._exit(EXIT_STOPPED)
