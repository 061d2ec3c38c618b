"""How a resumed run's data begins: the saved position carried over (exactly) or new iterators (reseeded).

A run reads its data as `data_streams` streams (`data.stream_pipeline`), chosen at its start and recorded in its
checkpoints: a resume on any process count that divides them (whose devices divide the global batch) reads each
stream on from its saved position, so the global batches hold the samples the run would have read on its own
topology. Checkpoints saved before streams (one per process x data worker) continue exactly on their own layout
only. A position that cannot be carried is refused in one line naming the way out; with
`--config.resume_data=allow_reseed` the train state alone is restored and new iterators are seeded with
`reseeded_data_seed(seed, step)` (streams chosen afresh for the new topology).
"""

import dataclasses

import numpy as np

from clip_jax.data import streams as streams_lib
from clip_jax.errors import InvalidInput
from clip_jax.runtime.checkpoints import CheckpointMeta

CHOOSE = 0  # DataResume.streams: the data streams are chosen for this run's topology (data.streams.default_streams)


@dataclasses.dataclass(frozen=True)
class DataResume:
    """How a resumed run gets its data: Grain's saved iterator position (`restore`: a checkpoint of the
    per-process layout), the seed to build with, the data streams (None: the per-process layout, CHOOSE: chosen at
    build, else that many) and, to read on from saved stream positions, `positions`: (checkpoints, step, the
    process count that saved them)."""

    restore: bool
    seed: int
    note: str = ""  # what the user gets, when the position is not restored
    streams: int | None = None
    positions: tuple[str, int, int] | None = None


def fresh_data(config) -> DataResume:
    return DataResume(False, config.seed, streams=config.get("data_streams", 0) or CHOOSE)


def reseeded_data_seed(seed: int, step: int) -> int:
    """The data seed of a run resumed at `step` without its data position: a pure function of (seed, step), so all
    processes agree and resuming the same step twice reads the same data; unlike `seed` itself it does not replay
    the samples the run started with."""
    return int(np.random.SeedSequence([seed, 0xDA7A, step]).generate_state(1)[0])


def data_resume_plan(config, meta: CheckpointMeta | None, saved_processes: int | None, *, where: str, step: int,
                     process_count: int, device_count: int | None = None, global_batch: int | None = None,
                     checkpoints: str = "") -> DataResume:
    """The data plan of a run of `process_count` processes (`device_count` devices, `global_batch`) resuming
    checkpoint `where` (`checkpoints`/`step`): its streams read on from their saved positions when it was read as
    streams and this topology can own them whole; a checkpoint of the per-process layout restores Grain's position
    when the layout (processes x data workers) is this run's. Otherwise: a ValueError naming the way out
    (`resume_data="exact"`), or, with `"allow_reseed"`, new iterators with `reseeded_data_seed(seed, step)`: in
    resampled mode fresh shard draws, statistically the same as continuing; in epoch mode a new pass over all shards
    in a new order from this step (samples of the interrupted epoch may come again before it ends, some not at all).
    """
    saved_streams = meta.data_streams if meta is not None else None
    saved_seed = int(config.seed if meta is None or meta.data_seed is None else meta.data_seed)
    if saved_streams:
        asked = config.get("data_streams", 0)
        if asked and asked != saved_streams:
            raise InvalidInput(f"data_streams={asked}, but checkpoint {where} reads {saved_streams} data streams: "
                               "the streams belong to the run; drop --config.data_streams (or set it to "
                               f"{saved_streams})")
        if global_batch is not None and global_batch % saved_streams:
            raise InvalidInput(f"global batch {global_batch} does not divide over the {saved_streams} data streams "
                               f"of checkpoint {where}: each stream gives an equal share of every batch; choose a "
                               f"global batch that is a multiple of {saved_streams}")
        refusal = streams_lib.continuation_refusal(saved_streams, global_batch or 0, process_count,
                                                   (device_count or process_count) // process_count, where)
        if refusal is None:
            return DataResume(False, saved_seed, streams=saved_streams,
                              positions=(checkpoints, step, int(saved_processes or process_count)))
        if config.resume_data != "allow_reseed":
            raise InvalidInput(refusal)
        return _reseeded(config, step, where, saved_processes, meta, process_count,
                         f"its {saved_streams} data stream{'s' if saved_streams > 1 else ''} cannot be owned whole "
                         f"by {process_count} process{'es' if process_count > 1 else ''}")
    saved_workers = meta.data_workers if meta is not None else None  # None: predates the field, not checked
    if (saved_processes in (None, process_count)
            and (saved_workers is None or int(saved_workers) == config.workers)):
        return DataResume(True, saved_seed)
    if config.resume_data != "allow_reseed":
        saved, here = _layouts(saved_processes, saved_workers, process_count, config.workers)
        raise InvalidInput(
            f"checkpoint {where} was saved by {saved}, this run has {here}: the data-iterator position is saved "
            "per process and worker and cannot be carried to another layout. Resume with the layout that saved "
            "it, or set --config.resume_data=allow_reseed to restore the train state only and read on with new "
            "data iterators (no replay of the run's first samples)")
    return _reseeded(config, step, where, saved_processes, meta, process_count, "")


def _layouts(saved_processes, saved_workers, process_count: int, workers: int) -> tuple[str, str]:
    def layout(processes, workers):
        text = f"{processes} process" + ("" if processes == 1 else "es")
        return text + (f" x {workers} data workers" if saved_workers is not None else "")

    return layout(saved_processes, saved_workers), layout(process_count, workers)


def _reseeded(config, step: int, where: str, saved_processes, meta, process_count: int, why: str) -> DataResume:
    saved_workers = meta.data_workers if meta is not None else None
    saved, here = _layouts(saved_processes, saved_workers, process_count, config.workers)
    seed = reseeded_data_seed(config.seed, step)
    what = ("fresh shard draws" if config.dataset_resampled else
            "a new pass over all shards in a new order starts at this step")
    note = (f"data position not restored: checkpoint {where} was saved by {saved}, this run has {here}"
            f"{' (' + why + ')' if why else ''}; new data iterators with seed {seed} (from seed {config.seed} and "
            f"step {step}): {what}")
    return DataResume(False, seed, note, streams=config.get("data_streams", 0) or CHOOSE)
