"""A run directory's storage that fills up (or runs out of quota) stops the run with one line (`StorageFull`); so
does a bucket that keeps failing after every retry (`StorageFailed`).

A full disk shows up in several shapes: an `OSError` with errno ENOSPC / EDQUOT from a plain write (metrics.jsonl,
config.json), and, from Orbax's array writer (TensorStore), a `ValueError` whose text carries
"No space left on device [os_error_code='28']", raised when the next save or a wait collects the failed one. Both are
told the same way: the storage, the error, the last complete checkpoint (untouched: the failed save never replaced
it) and how to continue. On a bucket, requests that fail now and then (a 500 or 503 answer, a cut connection) are
retried by the storage clients (`clip_jax.runtime.storage.retry_attempts`); what still fails after those retries
(an outage) stops the run the same way, naming the bucket's checkpoint folder. Orbax also logs the failure of each
of its writer threads at error level before the error reaches the run; while a command that saves checkpoints runs
(`quiet_orbax_records`, entered by `python -m clip_jax.train` and `clip_jax.finetune`), those out-of-space lines are
left to the one line, and so are the traceback of another writer thread that dies of the full disk (TensorBoard's
event writer) and asyncio's "Event loop is closed" of the save's coroutines left behind when the run stops.
"""

import contextlib
import errno
import logging
import re
import sys
import threading
from collections.abc import Iterator

from clip_jax.errors import RunFailed

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXTS = ("No space left on device", "Disk quota exceeded",
                   *(f"os_error_code='{code}'" for code in _NO_SPACE_ERRNOS))


class StorageFull(RunFailed):
    """The run directory's storage has no space left: the run cannot save and stops."""


class StorageFailed(RunFailed):
    """The run directory's bucket kept failing (or did not answer) after every retry: the run cannot save."""


# TensorStore's errors reach Python as ValueError with an absl status text; these say the store failed, not the caller
_STORE_STATUS = ("UNAVAILABLE:", "ABORTED:", "DEADLINE_EXCEEDED:", "INTERNAL:", "UNKNOWN:", "RESOURCE_EXHAUSTED:",
                 "retry attempts failed", "HTTP response code", "CURL error")
_CLIENT_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "s3fs", "gcsfs", "google")


def is_storage_error(error: BaseException) -> bool:
    """Whether `error` (or one it was raised from) is the storage failing: an OSError or a timeout (s3fs turns
    S3's answers into those), an error of the storage clients (botocore, aiohttp), or TensorStore's status text of a
    store that failed. A programming error (TypeError, a KeyError of ours) is not."""
    while error is not None:
        if isinstance(error, (OSError, TimeoutError)):
            return True
        if type(error).__module__.split(".")[0] in _CLIENT_MODULES:
            return True
        if isinstance(error, ValueError) and any(text in str(error) for text in _STORE_STATUS):
            return True
        error = error.__cause__ or error.__context__
    return False


def is_out_of_space(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from) says the storage is full."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in _NO_SPACE_ERRNOS:
            return True
        if any(text in str(error) for text in _NO_SPACE_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


def first_line(error: BaseException) -> str:
    """The error's message, shortened to the file and the reason where TensorStore's long message names them."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    written = re.search(r'Failed writing: "([^"]+)"', text)
    if written:
        reason = next((t for t in _NO_SPACE_TEXTS[:2] if t in text), "no space")
        return f"{reason}, writing {written.group(1)}"
    return text if len(text) <= 300 else text[:297] + "..."


def storage_full(where: str, doing: str, error: BaseException, last_complete: int | None) -> StorageFull:
    """The one line for a full storage under `where` while `doing` (e.g. "saving checkpoint 12")."""
    kept = (f"checkpoint {last_complete} is complete and untouched" if last_complete is not None
            else "no checkpoint was complete yet")
    return StorageFull(f"the storage of {where} is full: {doing} failed ({first_line(error)}); {kept}. Free space "
                       "there (or move the run directory to a larger disk) and continue with --config.resume=latest")


def storage_failed(where: str, doing: str, error: BaseException, last_complete: int | None,
                   attempts: int) -> StorageFailed:
    """The one line for a bucket under `where` that failed while `doing`, after `attempts` tries of each request."""
    kept = (f"checkpoint {last_complete} is complete and untouched" if last_complete is not None
            else "no checkpoint was complete yet")
    return StorageFailed(f"the storage of {where} failed: {doing} failed after {attempts} attempts of each request "
                         f"({first_line(error)}); {kept}. Continue with --config.resume=latest once the storage "
                         "answers again")


class QuietOutOfSpace(logging.Filter):
    """Drops Orbax's own error-level records of an out-of-space write (the run tells it in one line), and its
    warning that a save waited for the previous one (RunCheckpoints waits for it on purpose, before each save)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" not in record.pathname:
            return True
        if record.levelno < logging.ERROR:
            return not record.getMessage().startswith("Waiting for previous save to complete")
        if record.exc_info and record.exc_info[1] is not None and is_out_of_space(record.exc_info[1]):
            return False
        return not any(text in record.getMessage() for text in _NO_SPACE_TEXTS)


ORBAX_LOGGERS = ("absl", "")  # the loggers Orbax writes through: absl's and the root logger


def is_closed_loop_error(error: BaseException | None) -> bool:
    """asyncio's complaint about work left on an event loop that was closed (a stopped save's coroutines)."""
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


class QuietStoppedSave(logging.Filter):
    """Drops asyncio's records of what a save stopped by the full disk leaves behind: its futures' out-of-space
    errors nobody collected ("Future exception was never retrieved"), its tasks on a closed event loop."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return error is None or not (is_out_of_space(error) or is_closed_loop_error(error))


def _quiet_thread_hook(previous):
    def hook(args):  # a writer thread (TensorBoard's) that died of the full disk: the run tells it in one line
        if not is_out_of_space(args.exc_value):
            previous(args)
    return hook


def _quiet_unraisable_hook(previous):
    def hook(args):  # a coroutine of a stopped save, collected after its loop was closed
        if not (is_closed_loop_error(args.exc_value) or is_out_of_space(args.exc_value)):
            previous(args)
    return hook


@contextlib.contextmanager
def quiet_orbax_records() -> Iterator[None]:
    """`QuietOutOfSpace` on the loggers Orbax writes through while inside, and what a save stopped by a full disk
    leaves behind kept quiet (`QuietStoppedSave`, a writer thread's death, an unraisable error): a command's
    setting, entered by the command modules whose runs save checkpoints (a process-wide effect, so no constructor
    installs it). Left by an error (the run stops), the latter stay: the stopped save is collected as the process
    ends."""
    quiet, stopped_save = QuietOutOfSpace(), QuietStoppedSave()
    for name in ORBAX_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    logging.getLogger("asyncio").addFilter(stopped_save)
    thread_hook, unraisable_hook = threading.excepthook, sys.unraisablehook
    threading.excepthook = _quiet_thread_hook(thread_hook)
    sys.unraisablehook = _quiet_unraisable_hook(unraisable_hook)
    stopped = False
    try:
        yield
    except BaseException:
        stopped = True
        raise
    finally:
        for name in ORBAX_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
        if not stopped:
            logging.getLogger("asyncio").removeFilter(stopped_save)
            threading.excepthook, sys.unraisablehook = thread_hook, unraisable_hook
