"""What the run loop does after a step (`Decision`), decided in one place: `Trainer._decide`."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the loop does after a step: roll back to the last checkpoint (the step whose read showed the problem,
    and the reason), or stop, or any of log, save and the evaluations due."""

    roll_back: tuple[int, str] | None = None
    stop: bool = False
    log: bool = False
    save: bool = False
    evaluate: tuple[str, ...] = ()

    @property
    def due(self) -> bool:
        return self.stop or self.log or self.save or bool(self.evaluate)
