"""Preemption: SLURM's warning signal (SIGTERM, see launch/: --signal=TERM@300) or Ctrl-C is remembered instead of
killing the process mid-step, and the processes of a run agree on it, so that all of them save the same step."""

import signal

import jax
import numpy as np
from jax.experimental import multihost_utils


class StopSignal:
    """Remembers SIGTERM/SIGINT instead of dying mid-step; a second SIGINT interrupts at once."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def agreed(self) -> bool:
        """True on every process once any process got a signal (they then save the same step)."""
        flag = self.received is not None
        if jax.process_count() > 1:
            flag = bool(np.any(multihost_utils.process_allgather(np.int32(flag))))
        return flag

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
