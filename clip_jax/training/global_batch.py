"""A run's global batch belongs to the run: on resume the checkpoint's global batch stands, whatever devices are
left, and the per-device batch is derived from it (`derive_batch`), decided before anything is built.

`batch_size` is the per-device batch. Resumed, a config whose `batch_size` gives the saved global batch on the
devices present is taken as it is; one equal to the batch size the run was saved with (per device, as used or as
its command gave it) counts as unchanged and is re-derived as global batch / devices, so the same command relaunched
on fewer or more nodes continues the same run. Any other `batch_size` would change the global batch and with it the
schedule: refused, as is a device count that does not divide the global batch or an `accum_freq` that does not
divide the derived batch. Only `resume_global_batch` changes a run's global batch: it then starts a new segment of
the schedule (`training.schedule`).
"""

import dataclasses

from clip_jax.errors import InvalidInput
from clip_jax.training.schedule import samples_at


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """The run's per-device batch on this start, its global batch, the schedule's segments so far (empty: a run
    from step 0 at this global batch), the line that says what changed ("" when nothing did), and the `batch_size`
    its command gave (recorded: the same command relaunched counts as unchanged; None: the config's)."""

    per_device: int
    global_batch: int
    segments: tuple[tuple[int, int, int], ...] = ()
    note: str = ""
    given: int | None = None

    def applied(self, config):
        """`config` with `batch_size` the per-device batch the run uses (the same object when it is already)."""
        if config.batch_size == self.per_device:
            return config
        config = config.copy_and_resolve_references()
        config.batch_size = self.per_device
        return config


@dataclasses.dataclass(frozen=True)
class SavedBatch:
    """What a checkpoint says of its batch: the global batch, the per-device batch it was trained at and the
    config's `batch_size` that gave it (None where the checkpoint predates the record), the device count, and
    where the checkpoint is (for messages)."""

    global_batch: int
    per_device: int | None
    given: int | None
    devices: int | None
    where: str


def derive_batch(batch_size: int, accum_freq: int, devices: int, saved: SavedBatch | None, *,
                 new_global: int = 0, processes: int = 1, replan: bool = True) -> tuple[int, int, str]:
    """(per-device batch, global batch, the line saying what changed or "") for a run of `devices` devices whose
    config says `batch_size` and `accum_freq`, resuming checkpoint `saved` (None: a fresh start, or a checkpoint
    with no global batch on record). `new_global` (`resume_global_batch`; 0: off): the global batch to continue at;
    `replan`: whether the config has that field (fine-tuning's has not), named in the refusals.

    An older checkpoint without the per-device record counts the config's `batch_size` as unchanged: the global
    batch it recorded is kept and the per-device batch derived from it (and said)."""
    if saved is None or not saved.global_batch:
        return batch_size, batch_size * devices, ""
    target = new_global or saved.global_batch
    unchanged = {saved.per_device, saved.given} - {None} or {batch_size}  # an older checkpoint: the config's
    per_device = target // devices
    if target % devices:
        fix = (f"--config.resume_global_batch to a multiple of {devices}" if new_global else
               f"resume on a device count that divides {target}" + (
                   f", or set --config.resume_global_batch to a multiple of {devices} to re-plan the schedule"
                   if replan else ""))
        whose = "asked by resume_global_batch" if new_global else f"of {saved.where}"
        raise InvalidInput(f"global batch {target} {whose} does not divide over {devices} devices: {fix}")
    if batch_size * devices != target and batch_size not in unchanged:
        saved_as = f"{saved.per_device} per device on {saved.devices} devices" if saved.devices else "as saved"
        raise InvalidInput(
            f"batch_size {batch_size} x {devices} devices = {batch_size * devices} changes the global batch "
            f"{target} of {saved.where} ({saved_as}): set --config.batch_size={per_device}"
            + (f" (or the run's {saved.given})" if saved.given not in (None, per_device) else "") + " to keep it" + (
                f", or --config.resume_global_batch={batch_size * devices} to continue at the new global batch "
                "with the schedule re-planned" if replan else " (a run's global batch is fixed at its start)"))
    if per_device % accum_freq:
        divisor = max(d for d in range(1, accum_freq + 1) if per_device % d == 0)
        raise InvalidInput(f"accum_freq {accum_freq} does not divide the per-device batch {per_device} (global batch "
                           f"{target} over {devices} devices): set --config.accum_freq={divisor} (or another "
                           f"divisor of {per_device})")
    note = ""
    if new_global and new_global != saved.global_batch:
        note = (f"global batch {saved.global_batch} -> {target} from here (resume_global_batch) on {processes} x "
                f"{devices // processes} devices, batch_size {per_device} per device: the rest of the run is "
                "re-planned to end at the planned sample count, the learning rate continuing by samples")
    elif (per_device != batch_size or devices != (saved.devices or devices)
          or per_device != (saved.per_device or per_device)):
        note = (f"resumed on {processes} x {devices // processes} devices: batch_size {per_device} per device, "
                f"global {target} as saved" + ("" if saved.devices is None else
                                               f" (saved on {saved.devices} devices at {saved.per_device})"))
    return per_device, target, note


def batch_plan(config, meta, *, devices: int, processes: int, step: int, where: str) -> BatchPlan:
    """The run's `BatchPlan` on `devices` devices of `processes` processes, resuming at `step` the checkpoint
    `where` whose record is `meta` (None: a fresh start, or none on record)."""
    if meta is None or not meta.global_batch:
        return BatchPlan(config.batch_size, config.batch_size * devices, given=config.batch_size)
    saved = SavedBatch(int(meta.global_batch), meta.per_device_batch, meta.batch_size_given, meta.device_count, where)
    new_global = int(config.get("resume_global_batch", 0) or 0)
    per_device, global_batch, note = derive_batch(config.batch_size, config.get("accum_freq", 1), devices, saved,
                                                  new_global=new_global, processes=processes,
                                                  replan="resume_global_batch" in config)
    # a checkpoint before the record ran one global batch from step 0
    segments = tuple(tuple(s) for s in meta.batch_segments or ()) or ((0, 0, saved.global_batch),)
    if global_batch != segments[-1][2]:
        segments += ((step, samples_at(segments, step), global_batch),)
    recorded = {saved.per_device, saved.given} - {None}
    given = (saved.given or config.batch_size) if config.batch_size in recorded else config.batch_size
    return BatchPlan(per_device, global_batch, segments, note, given)
