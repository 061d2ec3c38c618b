"""A run directory, `LOGS/NAME/`: what the run wrote there, and the clean-up of a start that failed.

Its layout, every name a run writes into it, is `clip_jax.runtime.run_layout`. A `RunDirectory` refuses a folder
holding files of those names that clip_jax did not write (`refuse_foreign`),
records the entries its run writes before writing them (`record`, `clip_jax.runtime.ownership`), and notes the
folders it had to make, so that a run that fails before it has anything to show takes back what it wrote
(`remove_if_unused`). `resolve_resume` and `read_variables` read a run's checkpoints by the same layout.
"""

import os
import re

from clip_jax.runtime import checkpoints, ownership, storage
from clip_jax.runtime.run_layout import CHECKPOINTS, CONFIG, METRICS, RUN_ENTRIES

class RunDirectory:
    """The run directory at `path` (local or on a bucket). `entries`: every name the run may write there, checked
    by `refuse_foreign`. Made before anything is written: it notes the folders on disk that do not exist yet (the
    run directory and its missing parents; on a bucket, with no empty folders, none)."""

    def __init__(self, path: str, entries=RUN_ENTRIES):
        self.path, self.entries, self.made = path, tuple(entries), []
        folder = path
        while not storage.is_remote(folder) and not os.path.lexists(folder):
            self.made.append(folder)
            folder = os.path.dirname(folder)

    @property
    def name(self) -> str:
        return storage.basename(self.path)

    def join(self, *names: str) -> str:
        return storage.join(self.path, *names)

    @property
    def config(self) -> str:
        return self.join(CONFIG)

    @property
    def checkpoints(self) -> str:
        return self.join(CHECKPOINTS)

    @property
    def metrics(self) -> str:
        return self.join(METRICS)

    def refuse_foreign(self, writing: str) -> None:
        """`ownership.ForeignFiles` when the folder holds entries of the run's names that clip_jax did not write."""
        ownership.refuse_foreign(self.path, self.entries, writing=writing,
                                 change="give the run another --config.name, or another --config.logs")

    def record(self, names) -> None:
        """`names` are the run's from now on (recorded before they are written: what a crash leaves is known)."""
        ownership.record(self.path, names)

    def write_config(self, config) -> None:
        storage.write_text(self.config, config.to_json(indent=2))

    def has_results(self) -> bool:
        """A complete checkpoint or a metrics record: something a failed start must not take away."""
        return checkpoints.latest_complete_step(self.checkpoints) is not None or storage.exists(self.metrics)

    def remove_if_unused(self) -> None:
        """After a start that failed: when it made the folder and nothing in it is to keep (`has_results`), the
        entries of the folder's manifest, the manifest, then each folder it made that is left empty. Anything else
        there, or a folder that was there before, stays as it is."""
        if not self.made or not os.path.isdir(self.path) or self.has_results():
            return
        present = set(storage.listdir(self.path))
        for name in sorted(ownership.owned_names(self.path) & present):
            ownership.remove(self.path, name)
        if ownership.MANIFEST in present and not ownership.foreign_names(self.path):
            ownership.remove(self.path, ownership.MANIFEST)
        for folder in self.made:  # deepest first
            if os.path.isdir(folder) and not os.listdir(folder):
                os.rmdir(folder)


def resolve_resume(resume: str, run_dir: str) -> tuple[str, int | None]:
    """(checkpoints directory, step) that `resume` names: "latest" is the newest checkpoint of this run (None when
    there is none: the run starts fresh, so one command both starts and continues a preemptible job); a run
    directory means its newest checkpoint; `.../checkpoints/STEP` that step."""
    if resume == "latest":
        directory = storage.join(run_dir, CHECKPOINTS)
        return directory, checkpoints.latest_complete_step(directory)
    path = storage.absolute(resume)
    if not storage.exists(path):
        raise checkpoints.CheckpointNotFoundError(f"resume={resume!r} does not exist")
    name = storage.basename(path)
    if re.fullmatch(r"\d+", name) and storage.isdir(storage.join(path, checkpoints.STATE)):
        if not checkpoints.is_complete(storage.dirname(path), name):
            raise checkpoints.CheckpointNotFoundError(
                f"resume={resume!r}: that checkpoint was never completed (its save was interrupted: no "
                f"{storage.COMMIT_FILE}); resume from an earlier step")
        return storage.dirname(path), int(name)
    folder = storage.join(path, CHECKPOINTS)
    directory = folder if storage.isdir(folder) else path
    step = checkpoints.latest_complete_step(directory)
    if step is None:
        raise checkpoints.CheckpointNotFoundError(f"resume={resume!r}: no complete checkpoint in {directory}")
    return directory, step


def read_params(path: str) -> dict:
    """Host (numpy, float32) params from a run directory (its newest checkpoint), its `checkpoints` folder, or one
    step folder `.../checkpoints/STEP`: what evaluation needs, on any number of devices. A ResNet image tower also
    needs its BatchNorm statistics: `read_variables`."""
    return read_variables(path)["params"]


def read_variables(path: str) -> dict:
    """Host variables from a run (`path` as for `read_params`): `{"params": ...}`, and `"batch_stats"` (float
    statistics float32, `num_batches_tracked` int32) when the run's image tower is a ResNet; what `model.apply`
    takes in eval mode."""
    return checkpoints.read_step_variables(*resolve_resume(path, run_dir=path))
