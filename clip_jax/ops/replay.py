"""The one rule for replayed steps, the same in metrics.jsonl, TensorBoard and W&B.

A run replays steps when it resumes from a checkpoint older than the last step it logged (a crash, `kill -9`, a
rerun of a finished run) and when it rolls back to its last checkpoint after a loss spike. From that restart on,
every record of a step the outputs already hold records for is a replay: its metrics.jsonl line says
`"replay": true` and its scalars carry `replay` = 1 in TensorBoard and W&B. The last record of a step is the true
one: `python -m clip_jax.report` keeps the last value of each step, TensorBoard is told at the restart to drop what
it holds from that step on (a `SessionLog.START` event there, TensorBoard's own rule for restarted runs), and W&B
is rewound there (`ops.wandb_writer`). A replayed record that equals, field for field, one metrics.jsonl already
holds for its step (a finished run run again evaluates again) is not written a second time.
"""

import json
import logging

from clip_jax.runtime import storage

log = logging.getLogger(__name__)


def read_records(path: str) -> list[dict]:
    """The records of a metrics.jsonl (none when it does not exist); a last line cut off by a crash is left out."""
    if not storage.isfile(path):
        return []
    records = []
    with storage.open_file(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s: a line that is not JSON (cut off by a crash?) is left out: %.80s", path, line)
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records


class Replays:
    """Which steps are replays, from the records a run directory holds when the run starts (`existing`) and the
    step it continues from (`resumed_at`, None for a fresh start)."""

    def __init__(self, existing: list[dict], resumed_at: int | None):
        steps = [r["step"] for r in existing]
        self.last_step = max(steps, default=-1)  # the highest step the outputs hold a record of
        self.through = self.last_step if resumed_at is not None else -1  # steps up to here are replays
        # the first step replayed over records the outputs hold, when the run resumed before its last record
        self.replay_from = resumed_at + 1 if resumed_at is not None and self.last_step > resumed_at else None
        self._held: dict[int, list[dict]] = {}
        for record in existing:
            if resumed_at is not None and record["step"] >= resumed_at:
                self._held.setdefault(record["step"], []).append(record)

    def is_replay(self, step: int) -> bool:
        return step <= self.through

    def held(self, step: int) -> dict:
        """The records of `step` metrics.jsonl held from the resumed step on, merged (later ones win)."""
        return {k: v for record in self._held.get(step, ()) for k, v in record.items()}

    def already_written(self, line: dict) -> bool:
        """Whether metrics.jsonl holds this record already (the same fields and values at its step)."""
        return any(all(held.get(k) == v for k, v in line.items()) for held in self._held.get(line["step"], ()))

    def wrote(self, step: int) -> None:
        self.last_step = max(self.last_step, step)

    def rolled_back(self, to_step: int) -> bool:
        """The run goes back to `to_step`: what it logged after that step is replayed. Whether there is any."""
        self.through = max(self.through, self.last_step)
        self._held = {}
        return self.last_step > to_step
