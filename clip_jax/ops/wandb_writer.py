"""Weights & Biases as a metrics target (`report_to` naming `wandb`; `pip install 'clipjax-train[wandb]'`).

A run records its project, name and full config. Its W&B id is kept in `RUN_DIR/wandb_run_id`, so a resumed run
(`--config.resume=latest`) logs into the same W&B run. With `WANDB_MODE=offline` nothing touches the network: the run
is written under `RUN_DIR/wandb/` and `wandb sync` uploads it later.

Steps a run replays (`ops.replay`: after a resume from a checkpoint older than its last record, or a rollback) are
steps W&B already holds, and a W&B run keeps the first values it got for a step. So the writer rewinds the W&B run
to the step before the replay (`wandb.init(resume_from="ID?_step=N")`, W&B's rewind; a rollback finishes the W&B
run and opens it again so): W&B drops what it held after that step and the replayed records become the curve. A
W&B server that refuses to rewind (rewinding is a preview feature W&B enables per account) gets the run resumed
as before, told in one line: W&B then keeps the first records of the replayed steps, metrics.jsonl and TensorBoard
the last.
"""

import logging
import os
import uuid

from clip_jax.errors import InvalidInput, MissingExtra, require_extra
from clip_jax.runtime.run_layout import WANDB_RUN_ID as RUN_ID_FILE

# W&B's own rule for project names (its settings refuse these at wandb.init, after the run has started).
PROJECT_FORBIDDEN = "/\\#?%:"
PROJECT_MAX_LENGTH = 128

log = logging.getLogger(__name__)


def project_problem(project: str) -> str | None:
    """Why `project` is not a W&B project name (or wandb is missing), else None."""
    try:
        require_extra("wandb", "wandb", "report_to=wandb")
    except MissingExtra as e:
        return str(e)
    if not project:
        return "wandb_project is empty: give the W&B project name"
    bad = sorted({ch for ch in project if ch in PROJECT_FORBIDDEN})
    if bad:
        return f"wandb_project={project!r} is not a W&B project name: it may not contain {' '.join(bad)}"
    if len(project) > PROJECT_MAX_LENGTH:
        return f"wandb_project is {len(project)} characters long; W&B allows at most {PROJECT_MAX_LENGTH}"
    return None


def run_id(run_dir: str) -> str:
    """The run's W&B id: the one stored in the run directory, else a new one, stored there."""
    path = os.path.join(run_dir, RUN_ID_FILE)
    if os.path.exists(path):
        with open(path) as f:
            stored = f.read().strip()
        if stored:
            return stored
    new = uuid.uuid4().hex[:16]
    with open(path, "w") as f:
        f.write(new + "\n")
    return new


class WandbWriter:
    """Scalars to one W&B run, the same one across resumptions of a run directory. `replay_from`: the first step
    this run replays over records it logged before (a resume from an older checkpoint), None when there is none."""

    def __init__(self, run_dir: str, *, project: str, name: str, config: dict, replay_from: int | None = None):
        problem = project_problem(project)
        if problem:
            raise InvalidInput(problem)
        import wandb

        self._wandb = wandb
        stored = os.path.exists(os.path.join(run_dir, RUN_ID_FILE))
        self.id = run_id(run_dir)
        self._init = dict(project=project, name=name, config=config, dir=run_dir)
        self._run = self._open(replay_from if stored else None)

    def _open(self, replay_from: int | None):
        """The W&B run, rewound to the step before `replay_from` when given (and the server allows it)."""
        if replay_from is not None:
            try:
                return self._wandb.init(id=self.id, resume_from=f"{self.id}?_step={replay_from - 1}", **self._init)
            except Exception as e:  # noqa: BLE001  a server without W&B's rewind: resume as before, and say so
                log.warning("W&B could not rewind run %s to step %d (%s): it keeps the first records of the steps "
                            "replayed from step %d; metrics.jsonl and TensorBoard hold the last", self.id,
                            replay_from - 1, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__,
                            replay_from)
        return self._wandb.init(id=self.id, resume="allow", **self._init)

    def restart(self, step: int) -> None:
        """The run goes on from `step` again (a rollback): the W&B run is rewound to the step before."""
        self._run.finish()
        self._run = self._open(step)

    def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log({k: float(v) for k, v in scalars.items() if v is not None}, step=int(step))

    def close(self) -> None:
        self._run.finish()
