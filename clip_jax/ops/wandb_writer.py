"""Weights & Biases as a metrics target (`report_to` naming `wandb`; `pip install 'clipjax-train[wandb]'`).

A run records its project, name and full config. Its W&B id is kept in `RUN_DIR/wandb_run_id`, so a resumed run
(`--config.resume=latest`) logs into the same W&B run. With `WANDB_MODE=offline` nothing touches the network: the run
is written under `RUN_DIR/wandb/` and `wandb sync` uploads it later. Steps a resumed run repeats (those after its
last checkpoint) are ones W&B already holds; it keeps the first values it got for them.
"""

import os
import uuid

from clip_jax.errors import InvalidInput, MissingExtra, require_extra

RUN_ID_FILE = "wandb_run_id"
# W&B's own rule for project names (its settings refuse these at wandb.init, after the run has started).
PROJECT_FORBIDDEN = "/\\#?%:"
PROJECT_MAX_LENGTH = 128


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
    """Scalars to one W&B run, the same one across resumptions of a run directory."""

    def __init__(self, run_dir: str, *, project: str, name: str, config: dict):
        problem = project_problem(project)
        if problem:
            raise InvalidInput(problem)
        import wandb

        self.id = run_id(run_dir)
        self._run = wandb.init(project=project, name=name, id=self.id, resume="allow", config=config, dir=run_dir)

    def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log({k: float(v) for k, v in scalars.items() if v is not None}, step=int(step))

    def close(self) -> None:
        self._run.finish()
