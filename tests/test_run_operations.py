"""Operating a run end to end on 8 simulated devices: telemetry in the log (a fake NVML library injected), validation
every epoch, TensorBoard and W&B (offline) together, a resume that continues the same W&B run, the report PNG, and
the refusals of bad settings."""

import contextlib
import functools
import io
import json
import math
import os
import re

import numpy as np
import pytest
from fake_nvml import fake_nvml
from PIL import Image
from trainer_run import tiny_config
from wandb_offline import offline_runs

from clip_jax.data import make_shards
from clip_jax.errors import InvalidInput
from clip_jax.ops import report as report_lib
from clip_jax.ops import run_outputs
from clip_jax.ops.device_telemetry import Telemetry
from clip_jax.training import trainer as train_lib
from clip_jax.training.config_checks import check_config, report_targets
from clip_jax.training.run_setup import run_entries

GPUS = [dict(util=81, used=20e9, total=80e9, temp=55, power=300_000)] * 2


def read_jsonl(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def run(tmp_path_factory, trainer_model_file):
    """Two epochs of 4 steps, then a resume for a third; returns (run_dir, console output of each part)."""
    root = tmp_path_factory.mktemp("ops")
    train = make_shards.write_shards(make_shards.fashion_mnist_samples("train", limit=256), str(root / "train"), 128)
    val = make_shards.write_shards(make_shards.fashion_mnist_samples("test", limit=24), str(root / "val"), 24)
    config = tiny_config((make_shards.shard_pattern(train), trainer_model_file), root / "logs",
                         train_num_samples=256, epochs=2, log_every_n_steps=2, save_every_steps=0,
                         val_data=make_shards.shard_pattern(val), report_to="tensorboard,wandb",
                         wandb_project="clip-jax-tests")
    outputs = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        patch.setattr(run_outputs, "Telemetry", functools.partial(Telemetry, nvml=fake_nvml(GPUS),
                                                                  cuda_visible_devices=""))
        for overrides in ({}, {"resume": "latest", "epochs": 3}):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                part = config.copy_and_resolve_references()
                part.update(overrides)
                train_lib.train(part)
            outputs.append(out.getvalue())
    return root / "logs" / "run", outputs


@pytest.mark.slow
def test_telemetry_in_the_metrics_and_the_progress_line(run):
    run_dir, (first, _) = run
    logged = [r for r in read_jsonl(run_dir) if "loss" in r]
    assert [r["step"] for r in logged] == [2, 4, 6, 8, 10, 12]
    for record in logged:
        assert record["gpu0_utilization"] == 0.81 and record["gpu1_memory_used"] == 20e9
        assert record["gpu_temperature_max_c"] == 55 and record["gpu_power_w_total"] == 600
        assert record["host_ram_total"] > 0 and "host_cpu_percent" in record
        assert record["data_wait_per_step"] >= 0
        assert not any(k.startswith("device") for k in record)  # the CPU backend keeps no allocator stats
    assert "no device memory stats: the cpu backend keeps none" in first
    assert re.search(r"step 2/8 .* \| GPU 81% \(min 81%\) \| mem 25% \| 55C \| 600W \| host CPU \d+% RAM \d+%", first)


@pytest.mark.slow
def test_validation_every_epoch_and_at_the_end(run):
    run_dir, (first, second) = run
    val = {r["step"]: r for r in read_jsonl(run_dir) if "val_loss" in r}
    assert sorted(val) == [4, 8, 12]
    for record in val.values():
        assert record["val_loss"] > 0
        for k in (1, 5, 10):
            for direction in ("image_to_text", "text_to_image"):
                assert 0 <= record[f"val_{direction}_recall@{k}"] <= 1
        assert record["val_image_to_text_recall@1"] <= record["val_image_to_text_recall@10"]
    assert "validation on 24 images at step 4: val_image_to_text_recall@1" in first
    assert re.search(r"done: 12 steps in .*, val_image_to_text_recall@1 \d", second)


@pytest.mark.slow
def test_wandb_offline_holds_the_logged_scalars_and_a_resume_continues_the_same_run(run):
    run_dir, _ = run
    runs = offline_runs(run_dir)
    assert len(runs) == 2
    stored_id = (run_dir / "wandb_run_id").read_text().strip()
    assert [r["id"] for r in runs] == [stored_id, stored_id]
    assert {(r["project"], r["name"]) for r in runs} == {("clip-jax-tests", "run")}
    assert runs[0]["config"]["lr"] == 3e-3 and runs[0]["config"]["wandb_project"] == "clip-jax-tests"
    history = {**runs[0]["history"], **runs[1]["history"]}
    records = {}
    for record in read_jsonl(run_dir):
        records.setdefault(record["step"], {}).update(record)
    assert sorted(history) == sorted(records)
    for step, record in records.items():
        for key, value in record.items():
            if key != "step" and not isinstance(value, str):  # the sample digest is metrics.jsonl's only
                assert history[step][key] == pytest.approx(value, rel=1e-12), (step, key)


@pytest.mark.slow
def test_the_report_png_and_its_table_come_from_the_metrics_file(run, capsys, tmp_path):
    run_dir, _ = run
    output = tmp_path / "report.png"
    assert report_lib.main([str(run_dir), "--output", str(output)]) == 0
    with Image.open(output) as image:
        assert image.format == "PNG" and image.width >= 800 and image.height >= 600
    table = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[1:-1]}
    records = read_jsonl(run_dir)
    for name in ("loss", "learning_rate", "logit_scale", "samples_per_sec", "val_loss", "val_text_to_image_recall@5"):
        values = [(r["step"], r[name]) for r in records if name in r]
        step, first, last, low, high = table[name]
        assert int(step) == values[-1][0]
        assert [float(first), float(last), float(low), float(high)] == pytest.approx(
            [values[0][1], values[-1][1], min(v for _, v in values), max(v for _, v in values)], rel=1e-5)
    assert "mfu" not in table  # a CPU has no peak FLOPs to measure against: no panel, no row


def test_the_learning_rate_panel_plots_an_earlier_fine_tunes_lr_too(tmp_path):
    lines = [{"step": 1, "loss": 2.0, "lr": 1e-4}, {"step": 2, "loss": 1.5, "lr": 2e-4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    patterns = dict(report_lib.PANELS)["learning rate"]
    assert report_lib.panel_series(report_lib.read_metrics(str(tmp_path)), patterns) == ["lr"]


def test_the_report_of_a_folder_without_metrics_is_one_clear_error(tmp_path, capsys):
    assert report_lib.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}/metrics.jsonl does not exist: give a run directory " \
                                              "the trainer wrote (LOGS/NAME)"


@pytest.mark.parametrize("overrides, message", [
    ({"report_to": "wandb", "wandb_project": "team/clip"},
     "wandb_project='team/clip' is not a W&B project name: it may not contain /"),
    ({"report_to": "tensorboard,mlflow"}, "report_to='tensorboard,mlflow': 'mlflow' unknown"),
    ({"logs": "http://host/runs"}, "logs='http://host/runs': http:// is not a run-directory location; give a "
     "local path, s3://bucket/prefix or gs://bucket/prefix"),
    ({"resume": "hdfs://cluster/runs/a"}, "resume='hdfs://cluster/runs/a': hdfs:// is not a run-directory location"),
    ({"val_frequency": -1}, "val_frequency=-1 must not be negative"),
    ({"pretrained": "s3://bucket/weights.safetensors"},
     "pretrained='s3://bucket/weights.safetensors': pretrained weights are read from a local path"),
])
def test_bad_settings_are_one_clear_line(overrides, message, tmp_path):
    config = tiny_config(("x.tar", "m.json"), tmp_path)
    config.update(overrides)
    with pytest.raises(InvalidInput) as error:
        check_config(config, num_devices=8)
    assert str(error.value).startswith("bad config: ") and "\n" not in str(error.value)  # one problem, one line
    assert message in str(error.value)


@pytest.mark.parametrize("value, targets", [
    ("none", set()), ("", set()), ("tensorboard", {"tensorboard"}), ("wandb", {"wandb"}),
    ("tensorboard,wandb", {"tensorboard", "wandb"}), ("wandb, tensorboard", {"tensorboard", "wandb"}),
])
def test_report_to_accepts_openclip_forms_and_each_names_its_writers(value, targets, tmp_path):
    """Each of OpenCLIP's forms passes the checks and names the metrics targets the run writes to, and so the
    entries its directory gets for them (a wrong name is refused in test_bad_settings_are_one_clear_line)."""
    config = tiny_config(("x.tar", "m.json"), tmp_path, report_to=value)
    check_config(config, num_devices=8)
    assert set(report_targets(config.report_to)) == targets
    entries = set(run_entries(config)) - {"config.json", "checkpoints", "metrics.jsonl"}
    assert entries == ({"tensorboard"} if "tensorboard" in targets else set()) | (
        {"wandb", "wandb_run_id"} if "wandb" in targets else set())


def test_the_learning_rate_panel_draws_the_schedule_of_every_step_not_the_window_means(tmp_path):
    """Warm-up 50 of 300 steps (3 epochs of 100), logged every 20 steps as window means: the panel draws OpenCLIP's
    cosine_lr at each of the 120 steps made, its peak at step 50 where the warm-up ends."""
    lr, warmup, total = 1e-3, 50, 300
    (tmp_path / "config.json").write_text(json.dumps({"lr": lr, "warmup": warmup, "epochs": 3}))

    def cosine_lr(update):  # OpenCLIP's schedule, in float64
        if update < warmup:
            return lr * (update + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (update - warmup) / (total - warmup))) * lr

    records = [{"step": s, "loss": 1.0, "epoch": s / 100,
                "learning_rate": sum(cosine_lr(u) for u in range(s - 20, s)) / 20} for s in range(20, 121, 20)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    series = report_lib.read_metrics(str(tmp_path))
    panels = dict(report_lib.panel_lines(series, report_lib.schedule_per_step(str(tmp_path), series)))
    ((name, label, steps, values),) = panels["learning rate"]
    assert name == "learning_rate" and label == "learning_rate (schedule, per step)"
    assert list(steps) == list(range(1, 121))
    np.testing.assert_allclose(values, [cosine_lr(s - 1) for s in steps], rtol=1e-6)
    assert steps[int(np.argmax(values))] == 50
    assert max(records, key=lambda r: r["learning_rate"])["step"] > warmup  # where the window means peak
    (tmp_path / "config.json").unlink()  # a folder that does not say: the logged values
    assert [line[1] for line in dict(report_lib.panel_lines(series))["learning rate"]] == ["learning_rate"]
    assert report_lib.schedule_per_step(str(tmp_path), series) is None
