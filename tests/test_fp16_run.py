"""The trainer under `fp16`: overflows of the loss scale are counted apart from instability, the scale is saved and
resumed with the train state, checkpoints cross between policies with and without one, and a non-finite loss still
rolls back (here to bf16)."""

import json
import os

import numpy as np
import pytest
from test_loss_scale import gradscaler
from trainer_run import losses, nan_after, tiny_config

from clip_jax.runtime.checkpoints import _saved_tree
from clip_jax.training import trainer as train_lib

SHORT = {"train_num_samples": 512, "save_every_steps": 4}  # 8 steps of 64
# above what the trainer tests' model's float16 backward holds at first: overflows, then doubles after 2 finite steps
SCALED = {"loss_scale_init": 2.0**19, "loss_scale_growth_interval": 2}


@pytest.fixture(scope="module")
def shards(fashion_mnist_shards):
    return fashion_mnist_shards(1024)


class StopAt:
    """A stop signal received once the trainer has taken `step` steps."""

    received = "SIGTERM"

    def __init__(self, step: int):
        self.step, self.trainer = step, None

    def raise_if_received(self, moment: str) -> None:
        pass

    def agreed(self) -> bool:
        return self.trainer is not None and self.trainer.step >= self.step


def records(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def saved_state_keys(run_dir, step: int) -> set[str]:
    return set(_saved_tree(os.path.join(run_dir, "checkpoints", str(step), "state")))


def run(config, stop_at: int | None = None, edit_batch=None) -> train_lib.Trainer:
    stop = StopAt(stop_at) if stop_at is not None else None
    with train_lib.Trainer(config, stop=stop, edit_batch=edit_batch) as trainer:
        if stop is not None:
            stop.trainer = trainer
        trainer.train()
    return trainer


@pytest.mark.slow
def test_fp16_counts_overflows_apart_resumes_its_scale_and_crosses_policies(shards, tmp_path, capsys):
    base = dict(resume="latest", nan_patience=1, on_instability="rollback_bf16", **SCALED, **SHORT)
    run_dir = tmp_path / "run"
    # bf16 writes the layout it wrote before policies had state
    run(tiny_config(shards, tmp_path, precision="bf16", **base), stop_at=1)
    assert saved_state_keys(run_dir, 1) == {"params", "opt_state", "step", "batch_stats"}
    # resumed under fp16: the scale starts at loss_scale_init, said in one line
    first = run(tiny_config(shards, tmp_path, precision="fp16", **base), stop_at=4)
    said = capsys.readouterr().out
    assert said.count(f"loss scale started at loss_scale_init={SCALED['loss_scale_init']:g}: the checkpoint, saved "
                      "under bf16, has none\n") == 1
    assert saved_state_keys(run_dir, 4) == {"params", "opt_state", "step", "batch_stats", "policy_state"}
    # an overflow is not instability: under nan_patience=1 nothing rolled back or counted as non-finite
    assert first.overflows.skipped >= 1 and (first.rollbacks, first.skipped_updates) == (0, 0)
    assert not any(r.get("event") == "non_finite_step" for r in records(run_dir))

    # resumed under fp16 again: the saved scale and its count of finite steps go on (no note). Then a NaN batch:
    # a non-finite loss is instability as under any policy, and on_instability=rollback_bf16 rolls back to
    # checkpoint 4 (the loss scale dropped) and trains to the end under bf16
    second = run(tiny_config(shards, tmp_path, precision="fp16", **base), edit_batch=nan_after({5}))
    said = capsys.readouterr().out
    assert "resumed" in said and "loss scale started" not in said
    assert (second.skipped_updates, second.rollbacks) == (1, 1) and second.overflows.skipped >= first.overflows.skipped
    assert second.engine.spec.precision == "bf16" and second.step == 8
    assert all(np.isfinite(loss) for loss in losses(run_dir).values())

    # under log_every_n_steps=1 a step is logged when it updated (a window of skipped steps logs nothing): the
    # scale, through the resume at step 4, is GradScaler's rule from loss_scale_init fed with those flags
    logged = {}  # each step as first logged: step 5 under fp16, before the rollback replayed it under bf16
    for record in records(run_dir):
        if "loss" in record:
            logged.setdefault(record["step"], record)
    assert "loss_scale" not in logged[1] and "loss_scale" in logged[5]
    expected, overflows = (SCALED["loss_scale_init"], 0), 0
    for step in range(2, 6):
        finite = step in logged
        overflows += not finite
        expected = gradscaler(*expected, finite, SCALED["loss_scale_growth_interval"])
        if finite:
            assert (logged[step]["loss_scale"], logged[step]["overflow"]) == (expected[0], overflows), step
    # here steps 2 and 3 overflow, 4 and 5 do not: the second finite step in a row, after the resume, doubles it
    assert logged[5]["loss_scale"] == 2 * logged[4]["loss_scale"]

    # the fp16 checkpoint resumed under fp32, in another run: the scale dropped, said in one line; trains to the end
    last = run(tiny_config(shards, tmp_path, name="fp32", precision="fp32",
                           resume=str(run_dir / "checkpoints" / "4"), **SHORT))
    said = capsys.readouterr().out
    assert said.count("the checkpoint's loss scale dropped: fp32 has none (saved under fp16)\n") == 1
    assert last.step == 8 and all(np.isfinite(loss) for loss in losses(tmp_path / "fp32").values())
