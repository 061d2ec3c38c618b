"""Training metrics: the train step's scalars averaged over the logging window on the host, written to TensorBoard
and the console.

TensorBoard event files are written here with the `tensorboard` package alone, which needs no TensorFlow.
"""

import math
import os
import time
from collections.abc import Mapping


class MetricsWindow:
    """The train step's scalars over one logging window, summed on the host (in float64) as each step is read:
    those named `averaged` (CLIP pretraining's `loss`, `accuracy`, `logit_scale` and `grad_norm` by default) averaged
    over the window's finite steps, `learning_rate` that of the last finite step. A skipped (non-finite) step is left
    out: its loss would only turn the averages into NaN.
    """

    AVERAGED = ("loss", "accuracy", "logit_scale", "grad_norm")

    def __init__(self, averaged: tuple[str, ...] = AVERAGED):
        self.averaged = tuple(averaged)
        self.finite_steps = 0
        self._sums = dict.fromkeys(self.averaged, 0.0)
        self._learning_rate = math.nan

    def add(self, scalars: Mapping[str, float]) -> None:
        """One step's scalars, read to the host (`finite` among them)."""
        if not scalars["finite"]:
            return
        self.finite_steps += 1
        for name in self.averaged:
            self._sums[name] += float(scalars[name])
        self._learning_rate = float(scalars["learning_rate"])

    def state(self) -> dict:
        """The window so far, as JSON (saved with a checkpoint): `from_state` gives it back."""
        return {"finite_steps": self.finite_steps, "sums": dict(self._sums), "learning_rate": self._learning_rate}

    @classmethod
    def from_state(cls, state: dict | None, averaged: tuple[str, ...] = AVERAGED) -> "MetricsWindow":
        """The window `state` describes (a new one for None, or a state of other fields)."""
        window = cls(averaged)
        if state and set(state.get("sums", ())) == set(window.averaged):
            window.finite_steps = int(state["finite_steps"])
            window._sums = {name: float(state["sums"][name]) for name in window.averaged}
            window._learning_rate = float(state["learning_rate"])
        return window

    def scalars(self) -> dict[str, float]:
        """The averages and the last learning rate; empty when no step of the window was finite."""
        if not self.finite_steps:
            return {}
        return {name: total / self.finite_steps for name, total in self._sums.items()} | {
            "learning_rate": self._learning_rate}


class TensorBoardWriter:
    """Scalars to a TensorBoard event file."""

    def __init__(self, logdir: str):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        os.makedirs(logdir, exist_ok=True)
        self._event, self._summary, self._session_log = Event, Summary, SessionLog
        self._writer = EventFileWriter(logdir)

    def restart(self, step: int) -> None:
        """The run goes on from `step` again (a resume or a rollback): TensorBoard drops the scalars it holds of
        `step` and later (its rule for a `SessionLog.START` event), so the replayed ones are the curve."""
        self._writer.add_event(self._event(wall_time=time.time(), step=int(step),
                                           session_log=self._session_log(status=self._session_log.START)))
        self._writer.flush()

    def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        values = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()
                  if v is not None and math.isfinite(float(v))]
        self._writer.add_event(self._event(wall_time=time.time(), step=int(step),
                                           summary=self._summary(value=values)))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds:02d}s"


# (scalar, label, format) of the scalars a progress line shows after the loss, those the run logs
PROGRESS_ACCURACIES = (("accuracy", "pair acc", ".3f"), ("logit_scale", "scale", ".2f"), ("train_acc1", "acc", ".3f"))


def progress_line(step: int, total_steps: int, epoch: float, scalars: dict[str, float]) -> str:
    """One line a person reads: where the run is, how it learns, how fast it goes."""
    parts = [f"step {step}/{total_steps}", f"epoch {epoch:.2f}", f"loss {scalars['loss']:.4f}"]
    for name, label, form in PROGRESS_ACCURACIES:  # the task's own: CLIP's pair accuracy and scale, a classifier's
        if name in scalars:
            parts.append(f"{label} {scalars[name]:{form}}")
    parts += [f"lr {scalars['learning_rate']:.3g}", f"gnorm {scalars['grad_norm']:.3g}",
              f"{scalars['samples_per_sec']:,.0f} samples/s ({scalars['samples_per_sec_per_device']:,.1f}/device)"]
    if scalars.get("mfu") is not None:
        parts.append(f"MFU {100 * scalars['mfu']:.1f}%")
    parts.append(f"data wait {100 * scalars['data_wait_fraction']:.0f}%")
    if scalars.get("skipped_samples"):
        parts.append(f"skipped {int(scalars['skipped_samples'])}")
    if scalars.get("filtered_samples"):
        parts.append(f"filtered {int(scalars['filtered_samples'])}")
    if scalars.get("skipped_updates"):
        parts.append(f"non-finite {int(scalars['skipped_updates'])}")
    if "loss_scale" in scalars:  # fp16's
        parts.append(f"loss scale {scalars['loss_scale']:g}" + (f", overflow {int(scalars['overflow'])}"
                                                                 if scalars.get("overflow") else ""))
    parts.append(f"ETA {format_duration(scalars['eta_seconds'])}")
    return " | ".join(parts)
