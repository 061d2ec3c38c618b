"""One rule for replayed steps (clip_jax.ops.replay): after a resume from an older checkpoint or a rollback, every
record of a step already logged says `"replay": true`, and metrics.jsonl's readers, TensorBoard and W&B keep the
last record of each step."""

import importlib.machinery
import json
import sys
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from clip_jax.ops import report, wandb_writer
from clip_jax.ops.run_outputs import RunOutputs
from clip_jax.ops.writers import MetricsWindow


def lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tensorboard_losses(run_dir) -> dict[int, float]:
    """TensorBoard's own reader of the run's event files (every file of the folder, in order)."""
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {e.step: pytest.approx(e.value) for e in events.Scalars("loss")}


def outputs(run_dir, **kwargs):
    return RunOutputs(str(run_dir), is_main=True, targets=("tensorboard",), **kwargs)


def test_a_resume_before_the_last_record_marks_the_replayed_steps_and_the_last_record_is_the_curve(tmp_path):
    first = outputs(tmp_path)
    for step in range(1, 7):
        first.record(step, {"loss": float(step)})
    first.close()  # killed after step 6; its last checkpoint is step 4
    resumed = outputs(tmp_path, resumed_at=4)
    for step in range(5, 8):
        resumed.record(step, {"loss": 10.0 * step})
    resumed.close()
    records = lines(tmp_path)
    assert [(r["step"], r.get("replay", False)) for r in records[6:]] == [(5, True), (6, True), (7, False)]
    assert dict(report.read_metrics(str(tmp_path))["loss"]) == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 50.0, 6: 60.0,
                                                                  7: 70.0}
    assert tensorboard_losses(tmp_path) == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 50.0, 6: 60.0, 7: 70.0}


def test_a_rollback_marks_the_steps_it_replays(tmp_path):
    run = outputs(tmp_path)
    for step in range(1, 7):
        run.record(step, {"loss": float(step)})
    run.event("rollback", 6, reason="loss spike", to_step=4)
    run.record(5, {"loss": 0.5})
    run.close()
    assert lines(tmp_path)[-2:] == [{"event": "rollback", "step": 6, "reason": "loss spike", "to_step": 4},
                                    {"step": 5, "loss": 0.5, "replay": True}]
    assert tensorboard_losses(tmp_path) == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 0.5}


def test_a_finished_run_run_again_adds_no_duplicate_record(tmp_path):
    first = outputs(tmp_path)
    first.record(8, {"loss": 1.0})
    first.record(8, {"zeroshot_top1": 0.75, "zeroshot_top5": 0.99})
    first.close()
    again = outputs(tmp_path, resumed_at=8)
    again.record(8, {"zeroshot_top1": 0.75, "zeroshot_top5": 0.99})  # the same evaluation of the same weights
    again.close()
    assert len(lines(tmp_path)) == 2
    third = outputs(tmp_path, resumed_at=8)
    third.record(8, {"zeroshot_top1": 0.5})  # another evaluation set: a replayed record of its own
    third.close()
    assert lines(tmp_path)[-1] == {"step": 8, "zeroshot_top1": 0.5, "replay": True}


class FakeWandb:
    """wandb's `init` as the writer calls it: each call's arguments; `refuse_rewind` plays a server without it."""

    def __init__(self, refuse_rewind=False):
        self.inits, self.refuse_rewind = [], refuse_rewind
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # found as installed

    def init(self, **kwargs):
        if "resume_from" in kwargs and self.refuse_rewind:
            raise RuntimeError("rewind is not enabled for this entity")
        self.inits.append(kwargs)
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)


@pytest.mark.parametrize("refuse", [False, True], ids=["rewinds", "server-refuses"])
def test_wandb_is_rewound_to_the_step_before_a_replay(tmp_path, monkeypatch, caplog, refuse):
    fake = FakeWandb(refuse)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    (tmp_path / wandb_writer.RUN_ID_FILE).write_text("abc123\n")
    writer = wandb_writer.WandbWriter(str(tmp_path), project="p", name="run", config={}, replay_from=5)
    writer.restart(9)  # a rollback: go on from step 9 again
    resumed = [{k: v for k, v in i.items() if k in ("id", "resume", "resume_from")} for i in fake.inits]
    if refuse:
        assert resumed == [{"id": "abc123", "resume": "allow"}] * 2
        assert "W&B could not rewind run abc123 to step 4 (rewind is not enabled for this entity)" in caplog.text
    else:
        assert resumed == [{"id": "abc123", "resume_from": "abc123?_step=4"},
                           {"id": "abc123", "resume_from": "abc123?_step=8"}]


def test_a_fresh_wandb_run_is_not_rewound(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    wandb_writer.WandbWriter(str(tmp_path), project="p", name="run", config={}, replay_from=5)
    assert fake.inits[0]["resume"] == "allow" and "resume_from" not in fake.inits[0]


def test_the_log_window_carried_through_a_checkpoint_averages_the_same_steps():
    steps = [{"finite": True, "loss": 4.0 + i, "accuracy": 0.1 * i, "logit_scale": 14.0, "grad_norm": 1.0 + i,
              "learning_rate": 1e-3 * i} for i in range(5)]
    whole = MetricsWindow()
    for s in steps:
        whole.add(s)
    before = MetricsWindow()
    for s in steps[:2]:
        before.add(s)
    after = MetricsWindow.from_state(json.loads(json.dumps(before.state())))  # as saved in the checkpoint meta
    for s in steps[2:]:
        after.add(s)
    assert after.scalars() == whole.scalars()
    assert after.scalars()["loss"] == pytest.approx(sum(4.0 + i for i in range(5)) / 5)


def test_a_data_filter_changed_since_the_checkpoint_is_named_at_resume():
    from clip_jax.run_config import default_config
    from clip_jax.runtime.checkpoints import CheckpointMeta
    from clip_jax.training.run_setup import data_filter_settings, filter_change_note

    config = default_config()
    saved = CheckpointMeta(step=40, model="m", precision="fp32", global_batch=8, samples_seen=320, epoch=0.5,
                           data_filter=data_filter_settings(config))
    assert filter_change_note(config, saved, "logs/run/checkpoints/40") == ""
    config.train_data_filter = "punsafe < 0.5"
    config.train_data_min_image_size = 64
    assert filter_change_note(config, saved, "logs/run/checkpoints/40") == (
        "the data filter changed since checkpoint logs/run/checkpoints/40 was saved: train_data_filter '' -> "
        "'punsafe < 0.5'; train_data_min_image_size 0 -> 64; the samples read from here on are filtered by the new "
        "settings, those counted before by the old")
    older = CheckpointMeta(step=40, model="m", precision="fp32", global_batch=8, samples_seen=320, epoch=0.5)
    assert filter_change_note(config, older, "x") == ""  # a checkpoint from before the record: nothing to compare
