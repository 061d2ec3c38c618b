"""How long a run is on its mesh: the global batch, the steps of a (virtual) epoch and of the whole run."""

import dataclasses

from clip_jax import data


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Numbers the config implies on this mesh."""

    global_batch: int
    steps_per_epoch: int
    total_steps: int

    def epoch(self, step: int) -> float:
        return step / self.steps_per_epoch


def make_schedule(config, num_devices: int, shards: data.ShardList | None = None) -> Schedule:
    """`shards`: the run's resolved shards (`data.resolve_train_shards`), counted when the config gives no
    train_num_samples (resolved here when not given)."""
    global_batch = config.batch_size * num_devices
    steps_per_epoch = data.steps_per_epoch(data.TrainDataConfig.from_run_config(config), global_batch, shards)
    return Schedule(global_batch, steps_per_epoch, steps_per_epoch * config.epochs)
