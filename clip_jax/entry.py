"""The one entry of every command: its `main` does the command's work, and `command` around it owns how it ends.

    @entry.command(stopped="before the scores were written")
    def main(argv=None) -> int:
        args = parse_args(argv)
        ...

- A user error (`clip_jax.errors.UserError`) is one line, `error: MESSAGE`, exit status 2 (`user_error=1` for the
  data tools, which keep 1); a run that failed (`RunFailed`) exits 1. An argument error is argparse's or absl's
  (`clip_jax.cli`): exit 2. Any other exception is a bug in clip_jax: its traceback, exit 1.
- Ctrl-C (SIGINT) is one line, `stopped (Ctrl-C) STOPPED`, exit 130, no traceback. A file being written when it
  came (`stop_signals.unfinished`: a staging file) is removed; files a command finished (embed's parts) stay, so
  that the same command run again continues.
- During an XLA compile, JAX holds the main thread in native code without the interpreter's lock, and a Python
  signal handler would run only once the compile returns (minutes for ViT-L). A watcher thread, woken by the
  signal itself (`signal.set_wakeup_fd`), ends such a process at once: the line, the unfinished files removed,
  `os._exit(130)` (no exit handlers run: nothing waits for the compile, and nothing crashes in it).
- A warning a library logs (`logging`: a shard that cannot be read, a filter field a sample lacks) is a line like
  the commands' own, `warning: MESSAGE`, where nothing else prints it (Python would print the bare message).

A multi-process run (`clip_jax.runtime.processes`) leaves through `processes.leave_run`, as the trainer does.
The test seam `CLIP_JAX_TEST_SIGINT_AT` (see `stop_signals.reached`) makes a command signal itself at "start"
(before its work), at "compile" (inside JAX's first XLA compile) or at a moment of its work.
"""

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from clip_jax.cuda_plugin import quiet_cuda_plugin
from clip_jax.errors import RunFailed, UserError
from clip_jax.runtime import private_apis, stop_signals

USAGE_ERROR = 2  # a usage or user error (the data tools: 1)
RUN_FAILED = 1
INTERRUPTED = stop_signals.EXIT_STOPPED  # 130
NOTHING_WRITTEN = "with nothing written"


def command(stopped: str = NOTHING_WRITTEN, *, user_error: int = USAGE_ERROR, run_failed: int = RUN_FAILED,
            interrupts: bool = True) -> Callable[[Callable[..., int | None]], Callable[..., int]]:
    """`main(argv=None) -> int` of a command, run by `run` (see the module's docstring). `stopped`: the Ctrl-C
    line's end, what it says of the outputs; `run_failed`: the status of a `RunFailed` (the planner, which runs
    nothing, gives 2); `interrupts=False` for a command that takes stop signals itself
    and sets up its own logging (the trainer)."""
    def wrap(main: Callable[..., int | None]) -> Callable[..., int]:
        @functools.wraps(main)
        def entry(*args, **kwargs) -> int:
            return run(functools.partial(main, *args, **kwargs), stopped=stopped, user_error=user_error,
                       run_failed=run_failed, interrupts=interrupts)
        return entry
    return wrap


def run(work: Callable[[], int | None], *, stopped: str = NOTHING_WRITTEN, user_error: int = USAGE_ERROR,
        run_failed: int = RUN_FAILED, interrupts: bool = True) -> int:
    """`work()`'s exit status (None: 0), or that of how it ended (see the module's docstring)."""
    quiet_cuda_plugin()  # no CUDA start-up traceback on a machine without a GPU
    line = f"stopped (Ctrl-C) {stopped}"
    try:
        with (ctrl_c_ends_compiles(line) if interrupts else contextlib.nullcontext(),
              warnings_as_lines() if interrupts else contextlib.nullcontext()):
            stop_signals.reached("start")
            return work() or 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return _leave(run_failed if isinstance(e, RunFailed) else user_error)
    except KeyboardInterrupt:
        stop_signals.remove_unfinished()
        print(line, file=sys.stderr, flush=True)
        return _leave(INTERRUPTED)
    except stop_signals.Stopped as e:  # the trainer's stop before there was anything to save
        print(e, file=sys.stderr, flush=True)
        return INTERRUPTED
    except Exception as e:  # a bug: its traceback, exit 1
        return _leave(RUN_FAILED, e)


def _leave(status: int, bug: Exception | None = None) -> int:
    processes = sys.modules.get("clip_jax.runtime.processes")  # loaded by a command that may have joined a run
    if processes is None:
        if bug is not None:
            raise bug
        return status
    return processes.leave_run(status, bug)


class _LineFormatter(logging.Formatter):
    """`warning: MESSAGE`: a logged record as the commands' own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


@contextlib.contextmanager
def warnings_as_lines() -> Iterator[None]:
    """Inside: warnings and errors logged where no handler prints them (none on the root logger) are printed on
    stderr as `warning: MESSAGE` (`error: ...`)."""
    root = logging.getLogger()
    if root.handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_LineFormatter())
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


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
    if os.environ.get(stop_signals.TEST_SIGINT_AT, "").startswith("compile"):
        private_apis.at_each_compile(lambda: stop_signals.reached("compile"))
    stop_signals.reset_moments()
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
            stop_signals.remove_unfinished(ending=True)
            os.write(2, (self.line + "\n").encode())
            os._exit(INTERRUPTED)
