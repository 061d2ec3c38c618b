"""The step loop's bookkeeping between the devices and the log: the dispatched step not read yet, and the metrics
window since the last log line (its steps, wall time and time spent waiting for data).

The host reads a step's scalars only after dispatching the next one, so the devices never wait for the host between
steps; at a log, save, evaluation or stop step the reads catch up first (`catch_up`), so nothing is logged or saved
unchecked. A read copies the step's replicated metrics from one of this process's devices: it runs no program, where
a jnp operation on them (a device copy, a merge on device) would run one across every process.

A read returns what it saw (a `Read`) and changes nothing else: the run loop looks at it and either `keep`s it (it
joins the window) or, when it shows a problem that rolls the run back, `drop`s the window and the step not read yet,
which belong to the abandoned trajectory.
"""

import dataclasses
import time

import jax
import numpy as np

from clip_jax.ops.writers import MetricsWindow
from clip_jax.training.spike_telemetry import flatten


def local_values(tree):
    """A tree of replicated arrays as numpy values, each copied from its first local device: no program runs, also
    when the arrays span other processes' devices."""

    def local_replica(x):
        if not isinstance(x, jax.Array):
            return x
        if not x.is_fully_replicated:
            raise ValueError(f"a step metric of sharding {x.sharding} is not replicated: no one device holds it")
        return x.addressable_shards[0].data

    return jax.device_get(jax.tree.map(local_replica, tree))


def step_scalars(metrics: dict) -> dict[str, np.ndarray]:
    """A step's metrics but its spike telemetry (read at log lines only), on the host."""
    return local_values({k: v for k, v in metrics.items() if k != "telemetry"})


@dataclasses.dataclass(frozen=True)
class Read:
    """Step `step` read: its scalars on the host, and its metrics as the step returned them (on the devices)."""

    step: int
    scalars: dict
    metrics: dict


class StepReads:
    """`averaged`: the scalars the window averages (`MetricsWindow`); `window`: the state of a window to go on with
    (a resumed run's, saved with its checkpoint)."""

    def __init__(self, averaged: tuple[str, ...] = MetricsWindow.AVERAGED, window: dict | None = None):
        self.averaged = averaged
        self._unread: tuple[int, dict] | None = None
        self.window = MetricsWindow.from_state(window, averaged)  # the steps read since the last log line
        self.last_read: Read | None = None  # the latest step read and kept
        self.restart_clock()

    def restart_clock(self) -> None:
        """A new timing window: after the first step's compilation (which is not training speed) and each log."""
        self.steps, self.data_wait, self.started = 0, 0.0, time.perf_counter()

    def count_step(self, data_wait: float) -> None:
        """One more step dispatched in this window, after waiting `data_wait` seconds for its batch."""
        self.steps += 1
        self.data_wait += data_wait

    def dispatched(self, step: int, metrics: dict) -> Read | None:
        """Step `step` is on the devices: reads the step before it (None when there is none)."""
        read = self.catch_up()
        self._unread = (step, metrics)
        return read

    def catch_up(self) -> Read | None:
        """Reads the unread step, if there is one."""
        if self._unread is None:
            return None
        (step, metrics), self._unread = self._unread, None
        return Read(step, step_scalars(metrics), metrics)

    def keep(self, read: Read) -> None:
        """`read` was checked: it joins the window."""
        self.last_read = read
        self.window.add(read.scalars)

    def drop(self) -> None:
        """A read showed a problem: the window and the step not read yet belong to the trajectory the run
        abandons."""
        self._unread, self.last_read = None, None
        self.window = MetricsWindow(self.averaged)

    def take_window(self) -> tuple[MetricsWindow, int, float, float]:
        """(metrics, steps, seconds, seconds waiting for data) of the window, and a new one begins."""
        taken = (self.window, self.steps, time.perf_counter() - self.started, self.data_wait)
        self.window = MetricsWindow(self.averaged)
        self.restart_clock()
        return taken

    def telemetry(self, step: int, every: int) -> dict[str, float]:
        """The spike telemetry of `step` (computed every `every` steps), flattened, when it is the step just read;
        else {}. Copied from a local device: a logging step's only read of it."""
        if self.last_read is None or self.last_read.step != step or "telemetry" not in self.last_read.metrics:
            return {}
        if not every or step % every:  # the final step of a run may fall between telemetry steps
            return {}
        return flatten(local_values(self.last_read.metrics["telemetry"]))
