"""How long a run is: its global batch, the steps of a (virtual) epoch and of the whole run, and the samples seen by
each step.

A run's length is planned once, at its start, from its first global batch: `planned_steps` steps of that batch,
the learning-rate schedule's horizon. A resume keeps that batch (`training.global_batch`); only
`resume_global_batch` changes it, which starts a segment: from its first step on, each step reads the new global
batch, and the remaining steps are re-planned so that the run ends at the planned sample count (rounded up to a whole
step). The segments are saved with every checkpoint (`CheckpointMeta.batch_segments`), so a later resume rebuilds
the same schedule. The epoch counter and the learning-rate schedule count samples.
"""

import dataclasses
import math

from clip_jax import data

# (first step, samples seen before it, global batch from it on)
Segment = tuple[int, int, int]


def samples_at(segments: tuple[Segment, ...], step: int) -> int:
    """Samples seen once `step` steps are done, the global batch of each step given by `segments`."""
    first, seen, batch = next(s for s in reversed(segments) if s[0] <= step)
    return seen + (step - first) * batch


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Numbers the config implies for the run's global batch(es). `global_batch` and `steps_per_epoch` are the
    current segment's; `segments` start with (0, 0, the first global batch)."""

    global_batch: int
    steps_per_epoch: int
    total_steps: int
    segments: tuple[Segment, ...] = ()
    planned_steps: int | None = None  # steps of the first global batch the run was planned for (None: total_steps)
    epoch_samples: int | None = None  # samples of a (virtual) epoch: its steps at the first global batch, times it

    def __post_init__(self):
        if not self.segments:
            object.__setattr__(self, "segments", ((0, 0, self.global_batch),))
        if self.planned_steps is None:
            object.__setattr__(self, "planned_steps", self.total_steps)
        if self.epoch_samples is None:
            object.__setattr__(self, "epoch_samples", self.steps_per_epoch * self.global_batch)

    @property
    def first_global_batch(self) -> int:
        return self.segments[0][2]

    def samples(self, step: int) -> int:
        """Samples seen once `step` steps are done: the sum of each step's global batch."""
        return samples_at(self.segments, step)

    def epoch(self, step: int) -> float:
        """(Virtual) epochs read once `step` steps are done, counted in samples (at one global batch, exactly
        step / steps_per_epoch)."""
        return self.samples(step) / self.epoch_samples

    def epochs_ended(self, step: int) -> int:
        """The number of the (virtual) epoch that step `step` completes; 0 when it completes none. Counted in
        samples, so that a changed global batch ends epochs where the planned run would have (at one global batch,
        the steps that are multiples of steps_per_epoch)."""
        ended = self.samples(step) // self.epoch_samples
        return ended if step > 0 and ended > self.samples(step - 1) // self.epoch_samples else 0

    def lr_segments(self) -> tuple[tuple[int, float, float], ...]:
        """The learning-rate schedule's segments after the first (`optimizer_spec.sample_position`): where each
        starts, its position there and per step, in steps of the first global batch."""
        first = self.first_global_batch
        return tuple((step, seen / first, batch / first) for step, seen, batch in self.segments[1:])

    def details(self) -> str:
        """What the run's first line adds when the global batch changed on a resume ("" otherwise)."""
        if len(self.segments) == 1:
            return ""
        step, seen, batch = self.segments[-1]
        return (f" (re-planned at step {step} for global batch {batch}: {seen} samples seen, to end at "
                f"{self.samples(self.total_steps)} of the {self.planned_steps * self.first_global_batch} planned)")


def make_schedule(config, num_devices: int, shards: data.ShardList | None = None,
                  segments: tuple[Segment, ...] = (), *, epoch_steps: int | None = None) -> Schedule:
    """`shards`: the run's resolved shards (`data.resolve_train_shards`), counted when the config gives no
    train_num_samples (resolved here when not given). `segments`: the run's global batches so far (none: a run at
    `config.batch_size` x `num_devices` from step 0). `epoch_steps`: the steps of an epoch at the first global batch
    as the run's start counted them (saved with its checkpoints; None: counted now), so that a resume with other
    data workers keeps the run's length."""
    global_batch = config.batch_size * num_devices
    data_config = data.TrainDataConfig.from_run_config(config)
    first = segments[0][2] if segments else global_batch

    def steps_per_epoch(batch: int) -> int:
        if epoch_steps and batch == first:
            return int(epoch_steps)
        return data.steps_per_epoch(data_config, batch, shards)

    return planned_schedule(steps_per_epoch, config.epochs, global_batch, segments)


def planned_schedule(steps_per_epoch, epochs: int, global_batch: int, segments: tuple[Segment, ...] = ()) -> Schedule:
    """The schedule of a run at `global_batch` now, `epochs` planned at its first global batch (`segments[0]`'s, or
    `global_batch`), `steps_per_epoch(global batch)` the steps of an epoch."""
    segments = tuple(tuple(int(v) for v in s) for s in segments) or ((0, 0, global_batch),)
    if segments[-1][2] != global_batch:
        raise ValueError(f"the last segment's global batch {segments[-1][2]} is not the run's {global_batch}")
    first = segments[0][2]
    first_epoch = steps_per_epoch(first)
    planned = first_epoch * epochs
    if len(segments) == 1:
        return Schedule(global_batch, first_epoch, planned, segments)
    step, seen, _ = segments[-1]
    total = step + max(0, math.ceil((planned * first - seen) / global_batch))
    return Schedule(global_batch, steps_per_epoch(global_batch), total, segments, planned, first_epoch * first)
