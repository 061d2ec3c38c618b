"""The trainer tests' small run over Fashion-MNIST shards (tests/conftest.py's trainer model), and the losses it
logs: shared by the tests that run the trainer in one process and in several."""

import json
import os

import numpy as np

from clip_jax.run_config import default_config


def tiny_config(data, logs, **overrides):
    """`data` is the (shard pattern, model .json) pair of the fixture."""
    c = default_config()
    c.train_data, c.model = data
    c.train_num_samples = 2048
    c.dataset_resampled = False
    c.workers = 0
    c.batch_size = 8  # x 8 devices = 64 per step, 32 steps per epoch
    c.epochs = 1
    c.lr = 3e-3
    c.warmup = 4
    c.precision = "fp32"
    c.grad_checkpointing = False
    c.logs = str(logs)
    c.name = "run"
    c.log_every_n_steps = 1
    c.save_every_steps = 8
    c.zeroshot_frequency = 0
    c.report_to = "none"
    for key, value in overrides.items():
        c[key] = value
    return c


def losses(run_dir) -> dict[int, float]:
    """Loss per step from metrics.jsonl; a step logged twice (before a crash and after resuming) keeps the last."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if "loss" in record:
                out[record["step"]] = record["loss"]
    return out


def nan_after(steps: set[int]):
    """`Trainer(edit_batch=...)` making the batches after the given step counts NaN, once each (a rollback replays a
    step number with new data)."""
    pending = set(steps)

    def edit(step: int, batch: dict) -> dict:
        if step not in pending:
            return batch
        pending.discard(step)
        return {**batch, "images": np.full_like(batch["images"], np.nan)}

    return edit
