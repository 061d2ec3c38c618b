"""Long work that gives way to a stop signal. Inside `cut_short_when(should_stop)`, work that runs in many pieces
asks `check()` before each piece: every batch an evaluation encodes (`evaluation.encoder`), every shard the demo's
data writer writes (`data.make_shards`); `check()` raises `CutShort` once `should_stop()` answers True. The trainer
passes its stop check, so a SIGTERM that arrives while an ImageNet evaluation or the demo's shard writing runs is
heard within one piece, not after the whole. Outside such a context `check()` costs nothing.

Whoever passes a check that is a collective (a stop agreed across processes) must make sure every process runs
the same pieces: the evaluations do (their loops are the same length on every process); a shard writer does not
(one process writes while the others wait for it), so it is given a check of this process's signal only."""

import contextlib
import contextvars
from collections.abc import Callable, Iterator

_should_stop: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar("should_stop", default=None)


class CutShort(Exception):
    """A stop signal arrived during work that gives way to it. `done`: what finished before it, for whoever runs
    several pieces of work and keeps their results (the evaluations' metrics)."""

    def __init__(self):
        super().__init__("cut short by a stop signal")
        self.done: dict = {}


@contextlib.contextmanager
def cut_short_when(should_stop: Callable[[], bool]) -> Iterator[None]:
    token = _should_stop.set(should_stop)
    try:
        yield
    finally:
        _should_stop.reset(token)


def check() -> None:
    """Raises `CutShort` when the enclosing `cut_short_when` says to stop; nothing outside one."""
    should_stop = _should_stop.get()
    if should_stop is not None and should_stop():
        raise CutShort()
