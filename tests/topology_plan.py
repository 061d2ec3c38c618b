"""A run's topology plan for tests/chaos_run.py: which topology (processes x devices per process) a launch takes, by
the step it resumes from, and the end of a launch where the plan moves the run to another one."""

import time

Topology = tuple[int, int]  # (processes, devices per process)


def topology_at(plan: list[tuple[int, Topology]], step: int) -> Topology:
    """The topology `plan` ([(from step, topology)], by step, the first from 0) gives a launch resuming at `step`."""
    return [topology for start, topology in plan if start <= step][-1]


def next_move(plan: list[tuple[int, Topology]], step: int) -> int | None:
    """The first step after `step` at which `plan` leaves the topology of `step` (None: it never does)."""
    here = topology_at(plan, step)
    return next((start for start, topology in plan if start > step and topology != here), None)


def committed_step(checkpoints: str) -> int | None:
    """The newest committed checkpoint step in `checkpoints` (None: none, or no such folder yet)."""
    from clip_jax.runtime import storage
    from clip_jax.runtime.checkpoints import latest_complete_step

    return latest_complete_step(checkpoints) if storage.exists(checkpoints) else None


class PlannedMove:
    """The end of a launch once its run has committed a checkpoint at or past `step` (None: never), where the
    topology plan moves the run: every rank SIGKILLed, as when a node is lost."""

    def __init__(self, checkpoints: str, step: int | None):
        self.checkpoints, self.step, self.made, self._looked = checkpoints, step, False, 0.0

    def due(self) -> bool:
        if self.step is None or time.perf_counter() - self._looked < 0.25:
            return False
        self._looked = time.perf_counter()
        return (committed_step(self.checkpoints) or 0) >= self.step

    def make(self, launch) -> None:
        """Ends `launch` (a chaos_run.Launch)."""
        launch.kill_all()
        self.made = True
