"""When a run is unstable: too many non-finite steps in a row, or a loss spike above its recent mean
(`InstabilityMonitor`), or a loss scale driven below 1 by overflows (`OverflowWatch`), and where it goes back to then
(`rollback_step`) under which precision (`ROLLBACK_PRECISIONS`)."""

import collections
import math

from clip_jax.errors import InvalidInput, RunFailed

MAX_ROLLBACKS_TO_ONE_CHECKPOINT = 3
# on_instability's actions that continue under another precision after rolling back (the reference run's fp16 ->
# fp32 restart, the other team's fp16 -> bf16)
ROLLBACK_PRECISIONS = {"rollback_fp32": "fp32", "rollback_bf16": "bf16"}


class TrainingUnstable(RunFailed):
    """The loss keeps diverging although the run rolled back to its last checkpoint."""


def rollback_step(latest: int | None, action: str, reason: str, at_step: int, rollbacks_to: dict[int, int]) -> int:
    """The checkpoint a run that saw `reason` at step `at_step` rolls back to: `latest`, counted in `rollbacks_to`
    (checkpoint step -> rollbacks to it). `TrainingUnstable` when `on_instability` (`action`) says stop, when there
    is no checkpoint yet, or after MAX_ROLLBACKS_TO_ONE_CHECKPOINT rollbacks to the same one."""
    if action == "stop" or latest is None:
        raise TrainingUnstable(f"{reason} at step {at_step}; " + ("stopping (on_instability='stop')" if latest is not None
                                                                  else "no checkpoint to roll back to yet"))
    if rollbacks_to.get(latest, 0) >= MAX_ROLLBACKS_TO_ONE_CHECKPOINT:
        raise TrainingUnstable(f"{reason} at step {at_step}, after {MAX_ROLLBACKS_TO_ONE_CHECKPOINT} rollbacks to "
                               f"checkpoint {latest}: stopping. Lower the learning rate, or resume under "
                               "--config.precision=fp32")
    rollbacks_to[latest] = rollbacks_to.get(latest, 0) + 1
    return latest


class InstabilityMonitor:
    """Fed every step's loss and finiteness; returns the reason to roll back, or None.

    A non-finite step is skipped by the train step itself; `nan_patience` of them in a row call for a rollback.
    A finite loss above `spike_factor` x the mean of the last `window` finite losses (once `min_history` are known)
    is a spike; `spike_factor=0` turns that check off. Spikes and non-finite losses do not enter the history.
    """

    def __init__(self, nan_patience: int, spike_factor: float = 0.0, window: int = 20, min_history: int = 10):
        if nan_patience < 1:
            raise InvalidInput(f"nan_patience must be at least 1, got {nan_patience}")
        self.nan_patience, self.spike_factor, self.min_history = nan_patience, spike_factor, min_history
        self.history: collections.deque = collections.deque(maxlen=window)
        self.non_finite_in_a_row = 0
        self.last_problem: str | None = None  # the kind of the latest problem: "non_finite" or "loss_spike"

    def observe(self, loss: float, finite: bool) -> str | None:
        if not finite or not math.isfinite(loss):
            self.non_finite_in_a_row += 1
            if self.non_finite_in_a_row >= self.nan_patience:
                self.last_problem = "non_finite"
                return f"{self.non_finite_in_a_row} non-finite steps in a row"
            return None
        self.non_finite_in_a_row = 0
        if self.spike_factor and len(self.history) >= self.min_history:
            mean = sum(self.history) / len(self.history)
            if loss > self.spike_factor * mean:
                self.last_problem = "loss_spike"
                return f"loss spike {loss:.4f} > {self.spike_factor} x recent mean {mean:.4f}"
        self.history.append(loss)
        return None

    def reset(self) -> None:
        """After a rollback: the history belongs to the abandoned trajectory."""
        self.history.clear()
        self.non_finite_in_a_row = 0


class OverflowWatch:
    """Fed every step under a dynamic loss scale (fp16): whether its scaled backward overflowed (the step skipped, the
    scale halved) and the scale after it. An overflow is how the scale finds its level, not instability: it is only
    counted (`skipped`, the run's total), unless overflows in a row drive the scale below 1, where the loss
    itself no longer fits float16's range: then `problem` holds the reason to roll back."""

    def __init__(self, skipped: int = 0):
        self.skipped, self.in_a_row = skipped, 0
        self.problem: str | None = None  # the reason to roll back the last overflow gave, or None

    def observe(self, scalars: dict) -> bool:
        """Whether the step read as `scalars` was skipped for an overflow (False for a step without a loss scale);
        `problem` says whether it calls for a rollback."""
        self.problem = None
        if not scalars.get("overflow"):
            self.in_a_row = 0
            return False
        self.skipped += 1
        self.in_a_row += 1
        loss_scale = float(scalars["loss_scale"])
        if loss_scale < 1:
            self.problem = f"loss scale driven below 1 ({loss_scale:g}) by {self.in_a_row} overflows in a row"
        return True

    def scalars(self, read) -> dict:
        """What a logged step says of the loss scale (fp16's): its value after the step `read` (the last one read)
        and the steps skipped for an overflow so far; nothing for a step without one."""
        if read is None or "loss_scale" not in read.scalars:
            return {}
        return {"loss_scale": float(read.scalars["loss_scale"]), "overflow": self.skipped}
