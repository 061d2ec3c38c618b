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
  signal itself, ends such a process at once: the line, the unfinished files removed, `os._exit(130)` (no exit
  handlers run: nothing waits for the compile, and nothing crashes in it); see `stop_signals.ctrl_c_ends_compiles`.
- A warning a library logs (`logging`: a shard that cannot be read, a filter field a sample lacks) is a line like
  the commands' own, `warning: MESSAGE`, where nothing else prints it (Python would print the bare message).

A multi-process run (`clip_jax.runtime.processes`) leaves through `processes.leave_run`, as the trainer does.
The test seam `CLIP_JAX_TEST_SIGINT_AT` (see `stop_signals.reached`) makes a command signal itself at "start"
(before its work), at "compile" (inside JAX's first XLA compile) or at a moment of its work.
"""

import contextlib
import functools
import logging
import sys
from collections.abc import Callable, Iterator

from clip_jax.cuda_plugin import quiet_cuda_plugin
from clip_jax.errors import RunFailed, UserError
from clip_jax.runtime import stop_signals

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
        with (stop_signals.ctrl_c_ends_compiles(line) if interrupts else contextlib.nullcontext(),
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
