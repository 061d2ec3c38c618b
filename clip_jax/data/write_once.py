"""Writes a folder of files once, when several processes ask for it at the same time.

The ranks of a local launch start together and all find the demo's shards missing. The first to take the folder's
lock writes the files into a hidden temporary folder inside it and moves them into place, the files that mark a set
complete last; the others wait for the lock, then find the set complete and write nothing. A writer killed half way
leaves no marker for its unfinished part, so the next run writes the set again (and removes the killed writer's
temporary folder). A writer cut short by a stop signal (`runtime.stop_signals.CutShort`) removes its temporary
folder, and the folders it made, at once.

Only a folder that is new, empty or holds nothing but what clip_jax wrote there (:mod:`clip_jax.runtime.ownership`) is
written: any other file in it stops the writer before it creates anything, with one line naming the files.

The lock is ``flock`` on ``FOLDER/.clip_jax.lock``: it holds between the processes of one machine (and on file
systems that pass ``flock`` on, such as NFS); it is released when its holder exits, however it exits.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

from clip_jax.runtime import ownership
from clip_jax.runtime.stop_signals import CutShort

log = logging.getLogger(__name__)

LOCK_FILE = ownership.OWN_PREFIX + ".lock"
STAGING_PREFIX = ownership.OWN_PREFIX + "-writing-"


@contextlib.contextmanager
def folder_lock(folder: str) -> Iterator[None]:
    """Holds the exclusive lock of ``folder`` (made when missing) against the other processes that ask for it."""
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish writing %s", folder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_once(folder: str, *, is_complete: Callable[[], bool], write: Callable[[str], None],
               marker_suffix: str, what: str = "files", change: str = "choose a new or empty folder") -> bool:
    """Calls ``write(temporary_folder)`` and moves what it wrote into ``folder``, unless ``is_complete()``.

    Files whose names end with ``marker_suffix`` move last, so that ``is_complete`` (which looks for them) is never
    true of a half-moved set. Returns whether this process wrote. A folder holding files clip_jax did not write is
    refused (``ownership.ForeignFiles``, ending with ``change``: the setting that points the writer elsewhere).
    """
    if is_complete():
        return False
    ownership.refuse_foreign(folder, writing=f"writing {what}", change=change)
    made = folders_to_make(folder)
    try:
        return _write_locked(folder, is_complete, write, marker_suffix, what, change)
    except CutShort:  # one process's stop signal (never given to several writers): nothing of it stays
        if made:
            os.remove(os.path.join(folder, LOCK_FILE))
            for made_folder in reversed(made):
                os.rmdir(made_folder)
        raise


def folders_to_make(folder: str) -> list[str]:
    """``folder`` and those of its parents that do not exist, outermost first."""
    missing = []
    while folder and not os.path.lexists(folder):
        missing.insert(0, folder)
        folder = os.path.dirname(folder)
    return missing


def _write_locked(folder, is_complete, write, marker_suffix, what, change) -> bool:
    with folder_lock(folder):
        if is_complete():
            return False
        ownership.refuse_foreign(folder, writing=f"writing {what}", change=change)
        for name in os.listdir(folder):  # a killed writer's unfinished set: no other writer holds the lock
            if name.startswith(STAGING_PREFIX):
                ownership.remove(folder, name)
        log.info("writing %s into %s (once; other processes wait for it)", what, folder)
        staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=folder)
        try:
            write(staging)
            names = sorted((name for name in os.listdir(staging) if name != ownership.MANIFEST),
                           key=lambda name: name.endswith(marker_suffix))
            ownership.record(folder, names)
            for name in names:
                os.replace(os.path.join(staging, name), os.path.join(folder, name))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if not is_complete():
            raise RuntimeError(f"wrote {what} into {folder} but the set is still incomplete")
        return True
