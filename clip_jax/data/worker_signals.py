"""Data workers leave SIGINT and SIGTERM to the main process, which shuts them down when it stops.

Ctrl-C sends SIGINT to the whole process group, workers included, and SLURM signals every process of a step. A
worker that takes it dies with a traceback of its own, and the main process then fails on the next batch ("Worker
process was terminated unexpectedly") instead of saving. Grain spawns the workers from its own threads, and a
spawned interpreter imports for a second or more before a worker's init function runs, so setting the disposition
there alone comes too late: every call into the pipeline holds both signals back in its thread (`held_back`);
threads it starts inherit that mask, and so do the processes they spawn, which stay deaf until `ignore_in_worker`
(their init function) ignores both signals and lets them through again. The main process's own handler still gets
every signal: one that a thread holds back goes to another thread, or waits until the mask is restored.

Multiprocessing's resource tracker (a process of its own, started with the first worker or shared object) must
be running before: CPython starts it with both signals blocked and then unblocks them in the starting thread,
whatever that thread's mask was, so a tracker first started inside `held_back` lets the worker spawned next take
Ctrl-C while it imports (`start_resource_tracker`).

A worker whose main process is gone (SIGKILL, or a second Ctrl-C that exits at once) exits too.
"""

import contextlib
import os
import signal
import threading
import time

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
PARENT_CHECK_SECONDS = 1.0


@contextlib.contextmanager
def held_back():
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

