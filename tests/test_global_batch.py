"""A run's global batch and schedule belong to the run: resumed on another device count, the saved global batch
stands (the per-device batch derived from it); a batch_size that would change it is refused; `resume_global_batch`
changes it explicitly, the rest of the run re-planned to the same sample count and the learning rate going on by
samples. The rule and the schedule as pure functions, then the trainer: a run of 4 devices (its own process),
resumed on this process's 8."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from trainer_run import losses, tiny_config
from xla_flags import xla_flags

from clip_jax import data
from clip_jax.errors import InvalidInput
from clip_jax.training import trainer as train_lib
from clip_jax.runtime.checkpoints import CheckpointMeta
from clip_jax.training.finetune_config import default_finetune_config
from clip_jax.training.global_batch import SavedBatch, batch_plan, derive_batch
from clip_jax.training.optimizer_spec import OptimizerSpec
from clip_jax.training.schedule import planned_schedule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR, WARMUP, STEPS = 3e-3, 4, 8  # tiny_config's rate and warm-up; 512 samples at 64 a step
SAVED = SavedBatch(64, 16, 16, 4, "checkpoint c/4")  # 16 per device on 4 devices


def open_clip_cosine(position: float, total: int = STEPS) -> float:
    """OpenCLIP's cosine_lr with warm-up, written out again, at a (possibly fractional) step position."""
    if position < WARMUP:
        return LR * (position + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * min((position - WARMUP) / (total - WARMUP), 1.0))) * LR


# -- the rule ------------------------------------------------------------------------------------------------------

def test_the_saved_global_batch_stands_on_another_device_count():
    assert derive_batch(16, 1, 4, SAVED)[:2] == (16, 64)  # as saved: nothing to say
    assert derive_batch(16, 1, 4, SAVED)[2] == ""
    per_device, global_batch, note = derive_batch(16, 2, 8, SAVED)  # the same command on 8 devices
    assert (per_device, global_batch) == (8, 64)
    assert note.startswith("resumed on 1 x 8 devices: batch_size 8 per device, global 64 as saved")
    assert derive_batch(8, 1, 8, SAVED)[:2] == (8, 64)  # 8 x 8 = 64: taken as is
    assert derive_batch(16, 1, 16, SAVED, processes=2)[2].startswith("resumed on 2 x 8 devices: batch_size 4 ")


def test_the_batch_size_the_run_started_with_counts_as_unchanged_after_a_re_derivation():
    # resumed once on 8 devices (8 per device, the command's 16 recorded as given), then on 2
    assert derive_batch(16, 1, 2, SavedBatch(64, 8, 16, 8, "c"))[:2] == (32, 64)


def test_an_older_checkpoint_without_the_record_keeps_its_global_batch():
    assert derive_batch(32, 1, 2, SavedBatch(64, None, None, None, "c"))[:2] == (32, 64)
    per_device, global_batch, note = derive_batch(16, 1, 2, SavedBatch(64, None, None, None, "c"))
    assert (per_device, global_batch) == (32, 64) and "global 64 as saved" in note


@pytest.mark.parametrize("batch_size, accum, devices, new_global, named", [
    (4, 1, 8, 0, ("batch_size 4 x 8 devices = 32 changes the global batch 64", "--config.batch_size=8",
                  "--config.resume_global_batch=32")),
    (16, 1, 3, 0, ("global batch 64 of checkpoint c/4 does not divide over 3 devices",)),
    (16, 4, 32, 0, ("accum_freq 4 does not divide the per-device batch 2", "--config.accum_freq=2")),
    (16, 1, 8, 100, ("global batch 100 asked by resume_global_batch does not divide over 8 devices",)),
])
def test_a_change_of_the_global_batch_is_refused_in_one_line(batch_size, accum, devices, new_global, named):
    with pytest.raises(InvalidInput) as refused:
        derive_batch(batch_size, accum, devices, SAVED, new_global=new_global)
    message = str(refused.value)
    assert "\n" not in message and all(part in message for part in named), message


def test_resume_global_batch_starts_a_new_global_batch_and_says_so():
    per_device, global_batch, note = derive_batch(16, 1, 8, SAVED, new_global=128)
    assert (per_device, global_batch) == (16, 128)
    assert note.startswith("global batch 64 -> 128 from here (resume_global_batch)")


def test_resume_global_batch_on_a_fresh_start_is_said_not_acted_on(tmp_path):
    from clip_jax.run_config import default_config
    from clip_jax.training.pretraining import ClipPretraining
    from clip_jax.training.run_setup import plan_run_start

    config = default_config()
    config.logs, config.name, config.batch_size, config.resume_global_batch = str(tmp_path), "fresh", 16, 128
    for resume in ("", "latest"):  # a new run, and the relaunch command before its first checkpoint
        config.resume = resume
        start = plan_run_start(config, ClipPretraining(config), process_count=1, now=lambda: 0, device_count=4)
        assert (start.resume_from, start.batch.global_batch, start.batch.per_device) == (None, 64, 16)
        assert start.notes[-1] == ("resume_global_batch 128 is read when a run resumes: this run starts at step 0 "
                                   "with global batch 64 (batch_size 16 x 4 devices)")


def test_a_fine_tuning_run_keeps_its_global_batch_the_same_way():
    config = default_finetune_config()  # batch_size 32 per device; no accum_freq, no resume_global_batch
    meta = CheckpointMeta(step=10, model="m", precision="fp32", global_batch=256, samples_seen=2560, epoch=1.0,
                          per_device_batch=32, batch_size_given=32, device_count=8, batch_segments=[[0, 0, 256]])
    plan = batch_plan(config, meta, devices=4, processes=2, step=10, where="checkpoint c/10")
    assert (plan.per_device, plan.global_batch, plan.segments, plan.given) == (64, 256, ((0, 0, 256),), 32)
    assert plan.note.startswith("resumed on 2 x 2 devices: batch_size 64 per device, global 256 as saved")
    assert plan.applied(config).batch_size == 64 and config.batch_size == 32
    config.batch_size = 16
    with pytest.raises(InvalidInput, match=r"= 64 changes the global batch 256 .*\(a run's global batch is fixed at "
                                           r"its start\)$"):
        batch_plan(config, meta, devices=4, processes=2, step=10, where="checkpoint c/10")


# -- the schedule -----------------------------------------------------------------------------------------------

def test_a_re_planned_schedule_ends_at_the_planned_samples_and_counts_epochs_in_samples():
    per_epoch = lambda batch: math.ceil(512 / batch)  # noqa: E731
    schedule = planned_schedule(per_epoch, 2, 96, ((0, 0, 64), (5, 320, 96)))
    assert schedule.planned_steps == 16 and schedule.total_steps == 5 + math.ceil((1024 - 320) / 96)
    assert schedule.samples(5) == 320 and schedule.samples(7) == 320 + 2 * 96
    assert schedule.samples(schedule.total_steps) >= 1024 > schedule.samples(schedule.total_steps - 1)
    assert schedule.epoch(7) == pytest.approx((320 + 192) / 512)
    # an epoch ends where the planned run's would have: at 512 samples (step 7 here), not at a multiple of 6 steps
    assert [schedule.epochs_ended(step) for step in range(5, 14)] == [0, 0, 1, 0, 0, 0, 0, 0, 2]
    one = planned_schedule(per_epoch, 2, 64)
    assert (one.total_steps, one.epoch(12), one.samples(12), one.lr_segments()) == (16, 1.5, 768, ())
    assert [one.epochs_ended(step) for step in (0, 7, 8, 9, 16)] == [0, 0, 1, 0, 2]


def test_the_learning_rate_goes_on_by_samples_after_the_global_batch_changes():
    # 64 a step for 4 steps, then 128: step 4 + k sits where step 4 + 2k of the first global batch was
    schedule = planned_schedule(lambda batch: 512 // batch, 1, 128, ((0, 0, 64), (4, 256, 128)))
    assert schedule.total_steps == 6
    rate = OptimizerSpec(lr=LR, warmup=WARMUP, total_steps=schedule.planned_steps,
                         lr_segments=schedule.lr_segments()).learning_rate_fn()
    got = [float(rate(np.int32(step))) for step in range(8)]
    positions = [0, 1, 2, 3, 4, 6, 8, 10]
    np.testing.assert_allclose(got, [open_clip_cosine(p) for p in positions], rtol=1e-6, atol=1e-12)


def test_a_data_position_restores_into_a_pipeline_of_another_per_process_batch(fashion_mnist_shards):
    """Grain's saved position counts samples, not batches: read on at half the batch, the same samples follow."""
    config = tiny_config(fashion_mnist_shards(512), "unused", train_num_samples=512)

    def iterator(global_batch):
        return data.build_train_iterator(data.TrainDataConfig.from_run_config(config), global_batch_size=global_batch,
                                         image_size=28, mean=tuple(config.image_mean), std=tuple(config.image_std),
                                         context_length=16)

    whole, stopped = iterator(64), iterator(64)
    try:
        expected = np.concatenate([next(whole)["images"] for _ in range(3)][2:])
        next(stopped), next(stopped)
        state = stopped.get_state()
    finally:
        whole.close(), stopped.close()
    halved = iterator(32)
    try:
        halved.set_state(state)
        got = np.concatenate([next(halved)["images"] for _ in range(2)])
    finally:
        halved.close()
    np.testing.assert_array_equal(got, expected)


# -- the trainer ----------------------------------------------------------------------------------------------

def run_config(shards, logs, **overrides):
    return tiny_config(shards, logs, **{"train_num_samples": 512, "save_every_steps": 4, "batch_size": 16,
                                        **overrides})


@pytest.fixture(scope="module")
def four_device_run(fashion_mnist_shards, tmp_path_factory):
    """A whole run of 8 steps at global batch 64 as its own process on 4 devices (16 per device), checkpoints at 4
    and 8: (shards, logs). Read only."""
    shards, logs = fashion_mnist_shards(512), tmp_path_factory.mktemp("four-devices")
    env = {**os.environ, "XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu",
           "CLIP_JAX_TEST_CONFIG": run_config(shards, logs).to_json()}
    done = subprocess.run([sys.executable, "-m", "clip_jax.train", f"--config={REPO}/tests/train_config.py"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "global batch 64, 8 steps/epoch x 1 epochs = 8 steps" in done.stdout
    return shards, logs


def saved_meta(run_dir, step) -> dict:
    return json.loads((run_dir / "checkpoints" / str(step) / "meta" / "metadata").read_text())


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_same_command_resumed_on_more_devices_trains_to_its_end_at_the_saved_global_batch(
        four_device_run, tmp_path, capsys):
    shards, logs = four_device_run
    reference = losses(logs / "run")
    saved = saved_meta(logs / "run", 4)
    assert (saved["global_batch"], saved["samples_seen"], saved["per_device_batch"], saved["device_count"],
            saved["batch_size_given"], saved["batch_segments"]) == (64, 256, 16, 4, 16, [[0, 0, 64]])
    config = run_config(shards, tmp_path, resume=str(logs / "run" / "checkpoints" / "4"))
    result = train_lib.train(config)
    out = capsys.readouterr().out
    assert "resumed on 1 x 8 devices: batch_size 8 per device, global 64 as saved (saved on 4 devices at 16)" in out
    assert "global batch 64, 8 steps/epoch x 1 epochs = 8 steps" in out
    assert result["step"] == 8
    got = losses(tmp_path / "run")
    assert sorted(got) == [5, 6, 7, 8]
    # the same batches on 8 devices as on 4: sums in another order only
    np.testing.assert_allclose([got[s] for s in range(5, 9)], [reference[s] for s in range(5, 9)], rtol=1e-4)
    meta = saved_meta(tmp_path / "run", 8)
    assert (meta["global_batch"], meta["samples_seen"], meta["per_device_batch"], meta["device_count"],
            meta["batch_size_given"], meta["epoch"]) == (64, 512, 8, 8, 16, 1.0)


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_batch_size_that_changes_the_global_batch_is_refused_before_anything_is_built(four_device_run, tmp_path):
    shards, logs = four_device_run
    config = run_config(shards, tmp_path, batch_size=4, resume=str(logs / "run" / "checkpoints" / "4"))
    with pytest.raises(InvalidInput, match=r"batch_size 4 x 8 devices = 32 changes the global batch 64 of "
                                           r"checkpoint .*/4 \(16 per device on 4 devices\)") as refused:
        train_lib.Trainer(config)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.subprocess
@pytest.mark.slow
def test_resume_global_batch_continues_at_the_new_batch_to_the_same_samples(four_device_run, tmp_path, capsys):
    shards, logs = four_device_run
    reference = json_records(logs / "run")
    config = run_config(shards, tmp_path, resume=str(logs / "run" / "checkpoints" / "4"), resume_global_batch=128)
    result = train_lib.train(config)
    out = capsys.readouterr().out
    assert "global batch 64 -> 128 from here (resume_global_batch) on 1 x 8 devices, batch_size 16 per device" in out
    assert "re-planned at step 4 for global batch 128: 256 samples seen, to end at 512 of the 512 planned" in out
    assert result["step"] == 6  # 256 samples left, 2 steps of 128
    records = json_records(tmp_path / "run")
    assert sorted(records) == [5, 6]
    # the record of step s holds the rate of its update (the s-th): the 4 steps of 64 before, then positions 4, 6
    rates = [reference[s]["learning_rate"] for s in range(1, 5)] + [records[s]["learning_rate"] for s in (5, 6)]
    np.testing.assert_allclose(rates, [open_clip_cosine(p) for p in (0, 1, 2, 3, 4, 6)], rtol=1e-6)
    assert (records[6]["samples_seen"], records[6]["epoch"]) == (512, 1.0)
    meta = saved_meta(tmp_path / "run", 6)
    assert (meta["global_batch"], meta["samples_seen"], meta["batch_segments"]) == (128, 512, [[0, 0, 64],
                                                                                               [4, 256, 128]])


def json_records(run_dir) -> dict[int, dict]:
    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            records[record["step"]] = record
    return records
