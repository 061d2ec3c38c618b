"""The layout of a run directory, `LOGS/NAME/`: every name a run writes into it is spelled here and nowhere else.

    config.json        the run's config (pretraining's or fine-tuning's), written anew at every start
    checkpoints/STEP/  train state, data position and the run's record (`clip_jax.runtime.checkpoints`)
    metrics.jsonl      one record a line (`clip_jax.ops.run_outputs`)
    tensorboard/       TensorBoard events; wandb/ and wandb_run_id: W&B's files (when the run reports there)
    report.png         the plots of `python -m clip_jax.report`
    export/            a fine-tuning run's exported model (and its WiSE-FT table and plot beside it)

A run directory written before clip_jax kept a manifest of what it wrote (`clip_jax.runtime.ownership`) is known by
its `config.json` (`written_before_manifests`). The directory itself, what its run wrote there and the clean-up of a
failed start: `clip_jax.runtime.run_directory`.
"""

import json

from clip_jax.runtime import storage

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
WANDB, WANDB_RUN_ID = "wandb", "wandb_run_id"
REPORT = "report.png"
EXPORT = "export"
# What a run directory written before manifests may hold (any clip_jax run: train, report, W&B).
RUN_ENTRIES = (CONFIG, CHECKPOINTS, METRICS, TENSORBOARD, WANDB, WANDB_RUN_ID, REPORT)
# The appended files a resumed run on a bucket continues (`storage.StagedOutputs`).
CARRIED = (METRICS, WANDB_RUN_ID)
_RUN_CONFIG_KEYS = {"model", "train_data", "logs", "make_train_data"}


def reported_entries(targets) -> list[str]:
    """The entries of the metrics targets ("tensorboard", "wandb") a run reports to."""
    return ([TENSORBOARD] if "tensorboard" in targets else []) + ([WANDB, WANDB_RUN_ID] if "wandb" in targets else [])


def written_before_manifests(folder: str) -> bool:
    """A run directory written before manifests: its `config.json` is a clip_jax run config."""
    config = storage.join(folder, CONFIG)
    if not storage.isfile(config):
        return False
    try:
        fields = json.loads(storage.read_text(config))
    except (OSError, ValueError):
        return False
    return isinstance(fields, dict) and _RUN_CONFIG_KEYS <= set(fields)
