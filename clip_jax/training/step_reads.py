"""The step loop's bookkeeping between the devices and the log: the dispatched step not read yet, and the metrics
window since the last log line (its steps, wall time and time spent waiting for data).

The host reads a step's scalars only after dispatching the next one, so the devices never wait for the host between
steps; at a log, save, evaluation or stop step the reads catch up first (`catch_up`), so nothing is logged or saved
unchecked. A read copies the step's replicated metrics from one of this process's devices and averages them on the
host: it runs no program, where a jnp operation on them (a device copy, a merge on device) would run one across
every process. A read may find a problem that rolls the run back (the trainer decides); the unread step and the
window then belong to the abandoned trajectory and are dropped, here and nowhere else.
"""

import time
from collections.abc import Callable

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


class StepReads:
    """`check(step, scalars) -> str | None` checks one step's scalars, read to the host: the problem it shows (the
    reason to roll the run back), or None."""

    def __init__(self, check: Callable[[int, dict], str | None], window: dict | None = None):
        """`window`: the state of a window to go on with (a resumed run's, saved with its checkpoint)."""
        self._check = check
        self._unread: tuple[int, dict] | None = None
        self.window = MetricsWindow.from_state(window)  # the steps read since the last log line
        self.last_read: tuple[int, dict] | None = None  # the latest step read and kept, with its metrics on device
        self.restart_clock()

    def restart_clock(self) -> None:
        """A new timing window: after the first step's compilation (which is not training speed) and each log."""
        self.steps, self.data_wait, self.started = 0, 0.0, time.perf_counter()

    def count_step(self, data_wait: float) -> None:
        """One more step dispatched in this window, after waiting `data_wait` seconds for its batch."""
        self.steps += 1
        self.data_wait += data_wait

    def dispatched(self, step: int, metrics: dict) -> tuple[int, str] | None:
        """Step `step` is on the devices: reads the step before it. A problem found there, as (its step, the
        reason); the step just dispatched is then dropped with it."""
        problem = self.catch_up()
        if problem is None:
            self._unread = (step, metrics)
        return problem

    def catch_up(self) -> tuple[int, str] | None:
        """Reads the unread step, if there is one: a problem it shows, as (its step, the reason), or None. With a
        problem the window is dropped too (it belongs to the trajectory the run abandons)."""
        if self._unread is None:
            return None
        (step, metrics), self._unread = self._unread, None
        scalars = step_scalars(metrics)
        reason = self._check(step, scalars)
        if reason is not None:
            self.window, self.last_read = MetricsWindow(), None
            return step, reason
        self.last_read = (step, metrics)
        self.window.add(scalars)
        return None

    def take_window(self) -> tuple[MetricsWindow, int, float, float]:
        """(metrics, steps, seconds, seconds waiting for data) of the window, and a new one begins."""
        taken = (self.window, self.steps, time.perf_counter() - self.started, self.data_wait)
        self.window = MetricsWindow()
        self.restart_clock()
        return taken

    def telemetry(self, step: int, every: int) -> dict[str, float]:
        """The spike telemetry of `step` (computed every `every` steps), flattened, when it is the step just read;
        else {}. Copied from a local device: a logging step's only read of it."""
        if self.last_read is None or self.last_read[0] != step or "telemetry" not in self.last_read[1]:
            return {}
        if not every or step % every:  # the final step of a run may fall between telemetry steps
            return {}
        return flatten(local_values(self.last_read[1]["telemetry"]))
