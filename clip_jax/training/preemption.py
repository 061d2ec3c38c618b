"""Preemption: SLURM's warning signal (SIGTERM, see launch/: --signal=TERM@300) or Ctrl-C (SIGINT, to the whole
process group) is remembered instead of killing the process mid-step, and the processes of a run agree on it, so
that all of them save the same step.

The command line (`python -m clip_jax.train`) starts remembering before it imports the trainer, so a signal at any
moment from start-up on is seen: the trainer looks at it between its set-up phases (`raise_if_received`, agreed
across processes as between steps; exit `EXIT_STOPPED` with nothing saved) and between steps (a checkpoint, exit
0). A second SIGINT stops the process at once (as soon as the call the main thread is in returns), in one line,
without saving. Data workers ignore both signals (`clip_jax.data.worker_signals`): the main process shuts them
down."""

import os
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_STOPPED = 128 + signal.SIGINT  # what a shell reports for a command that Ctrl-C ended: 130


class Stopped(Exception):
    """A stop signal arrived before the run had anything to save (its message is the line to print)."""


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
        """True on every process once any process got a signal (they then save the same step)."""
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
