"""Run directories on object storage: a tiny run on a local S3 server (moto), stopped, resumed from the bucket, and
compared with the same run on local disk; keep-N, half-written steps, the report CLI and the errors a user meets.
gs:// cannot be served locally: its choices are checked without network."""

import glob
import importlib.util
import json
import os
import subprocess
import sys
import time

import jax
import local_s3
import numpy as np
import pytest
from trainer_run import tiny_config
from xla_flags import xla_flags

from clip_jax.errors import MissingExtra, MissingInput, RunFailed
from clip_jax.ops import report as report_lib
from clip_jax.runtime import storage
from clip_jax.runtime.checkpoints import RunCheckpoints, latest_complete_step
from clip_jax.runtime.run_directory import read_params, resolve_resume
from clip_jax.training import trainer as train_lib
from clip_jax.training.config_checks import check_config

BUCKET = "clip-runs"
STOP_AT = 10  # the stopped run saves here; 16 steps in all, a checkpoint every 4, the newest 2 kept


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free localhost port, the AWS_* variables pointing at it, and an empty bucket."""
    with local_s3.moto_server() as endpoint, local_s3.bucket_on(endpoint, BUCKET) as client:
        yield client


def keys(client, prefix: str) -> list[str]:
    return local_s3.keys(client, BUCKET, prefix)


def steps_on_bucket(client, run: str) -> list[int]:
    """Step folders under RUN/checkpoints/ that hold a commit marker, read with boto3 alone."""
    return local_s3.committed_steps(client, BUCKET, run)


def losses_from_text(text: str) -> dict[int, float]:
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def shards(fashion_mnist_shards):
    """1,024 Fashion-MNIST training images in 4 shards."""
    return fashion_mnist_shards(1024)


def stop_at(step):
    """A stand-in for the trainer's StopSignal that agrees on a stop (as after SIGTERM) once `Stop.trainer` has
    reached `step`."""
    class Stop:
        received = "SIGTERM"
        trainer = None

        def agreed(self):
            return Stop.trainer.step >= step

        def restore(self):
            pass
    return Stop


@pytest.fixture(scope="module")
def runs(s3, shards, tmp_path_factory):
    """The same 16-step run on local disk, uninterrupted, and on the bucket, stopped at step 10 and resumed."""
    settings = dict(train_num_samples=1024, save_every_steps=4, keep=2, report_to="tensorboard")
    local_logs = tmp_path_factory.mktemp("local")
    train_lib.train(tiny_config(shards, local_logs, **settings))

    remote = tiny_config(shards, f"s3://{BUCKET}/runs", resume="latest", **settings)
    with pytest.MonkeyPatch.context() as patch:
        stop = stop_at(STOP_AT)
        patch.setattr(train_lib, "StopSignal", stop)
        with train_lib.Trainer(remote) as trainer:
            stop.trainer = trainer
            assert trainer.train() == {"stopped_at": STOP_AT}
    steps_when_stopped = steps_on_bucket(s3, "runs/run")
    metrics_when_stopped = s3.get_object(Bucket=BUCKET, Key="runs/run/metrics.jsonl")["Body"].read().decode()
    resumed = train_lib.train(remote)
    return {"local": str(local_logs / "run"), "remote": f"s3://{BUCKET}/runs/run", "resumed": resumed,
            "steps_when_stopped": steps_when_stopped, "metrics_when_stopped": metrics_when_stopped}


@pytest.mark.slow
def test_a_run_stopped_and_resumed_on_the_bucket_ends_as_the_uninterrupted_one(runs):
    assert runs["resumed"]["step"] == 16
    local = jax.tree_util.tree_flatten_with_path(read_params(runs["local"]))[0]
    remote = dict(jax.tree_util.tree_flatten_with_path(read_params(runs["remote"]))[0])
    assert len(local) == len(remote) > 0
    for path, value in local:
        np.testing.assert_allclose(remote[path], value, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_a_run_on_the_bucket_opens_as_a_model_as_on_disk(runs):
    from clip_jax.interop.opener import open_model

    local, remote = open_model(runs["local"]), open_model(runs["remote"])
    assert remote.source.kind == "a clip_jax run directory"
    assert (remote.config, remote.preprocessing) == (local.config, local.preprocessing)
    jax.tree.map(np.testing.assert_array_equal, remote.variables(), {"params": read_params(runs["remote"])})
    with pytest.raises(MissingInput, match=f"s3://{BUCKET}/runs/nothing does not exist: give a clip_jax run"):
        open_model(f"s3://{BUCKET}/runs/nothing")


@pytest.mark.slow
@pytest.mark.subprocess
def test_keep_n_deletes_old_steps_on_the_bucket(runs, s3):
    assert runs["steps_when_stopped"] == [8, STOP_AT]  # step 4 was deleted when 8 and 10 were saved
    assert steps_on_bucket(s3, "runs/run") == [12, 16]
    folders = {key.split("/")[3] for key in keys(s3, "runs/run/checkpoints/")}
    assert folders == {"12", "16"}, folders  # deleted steps leave no objects behind
    assert any(key.startswith("runs/run/checkpoints/16/data_iter/") for key in keys(s3, "runs/run/checkpoints/16/"))


@pytest.mark.slow
@pytest.mark.subprocess
def test_metrics_config_and_events_are_uploaded_at_saves_and_exit(runs, s3):
    stopped = losses_from_text(runs["metrics_when_stopped"])
    assert sorted(stopped) == list(range(1, STOP_AT + 1))
    final = losses_from_text(s3.get_object(Bucket=BUCKET, Key="runs/run/metrics.jsonl")["Body"].read().decode())
    assert sorted(final) == list(range(1, 17))  # the resumed run appended to the downloaded history
    with open(os.path.join(runs["local"], "metrics.jsonl")) as f:
        local = losses_from_text(f.read())
    np.testing.assert_allclose([final[s] for s in range(1, 17)], [local[s] for s in range(1, 17)], rtol=1e-5)
    config = json.loads(s3.get_object(Bucket=BUCKET, Key="runs/run/config.json")["Body"].read())
    assert config["logs"] == f"s3://{BUCKET}/runs"
    events = [k for k in keys(s3, "runs/run/tensorboard/") if "tfevents" in k]
    assert len(events) == 2  # one event file per session


def staged_losses(staging: str) -> dict[int, float]:
    """The losses a run on a bucket wrote to its local staging folder (under the TMPDIR it was given)."""
    found = glob.glob(os.path.join(staging, "clip_jax-run-*", "metrics.jsonl"))
    if not found:
        return {}
    with open(found[0]) as f:
        return losses_from_text(f.read())


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_run_killed_on_the_bucket_resumes_and_replays_its_lost_steps_exactly(s3, shards, tmp_path):
    """SIGKILL mid-run: no save, no upload. The resumed run restarts from the newest committed step on the bucket,
    and the steps the killed run had made past it come out exactly as they did (state and data position both
    restored); the bucket's metrics end up with every step once."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = tiny_config(shards, f"s3://{BUCKET}/killed", resume="latest", train_num_samples=1024, epochs=2,
                         save_every_steps=8, keep=2)  # 32 steps
    staging = tmp_path / "staging"
    staging.mkdir()
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu",
           "CLIP_JAX_TEST_CONFIG": config.to_json(), "TMPDIR": str(staging)}
    process = subprocess.Popen([sys.executable, "-m", "clip_jax.train", f"--config={repo}/tests/train_config.py"],
                               env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while True:  # a step committed on the bucket and a few made past it, then the kill
        committed = steps_on_bucket(s3, "killed/run")
        if committed and max(staged_losses(str(staging)), default=0) >= committed[-1] + 3:
            break
        assert process.poll() is None, f"trainer exited before the kill:\n{process.stdout.read()}"
        assert time.time() < deadline, "no checkpoint committed on the bucket in 300 s"
        time.sleep(0.05)
    process.kill()
    process.wait()
    before_kill = staged_losses(str(staging))
    last_saved = max(steps_on_bucket(s3, "killed/run"))
    replayed = [s for s in sorted(before_kill) if s > last_saved]
    assert replayed and max(before_kill) < 32, (last_saved, sorted(before_kill))

    result = train_lib.train(config)
    assert result["step"] == 32
    final = losses_from_text(s3.get_object(Bucket=BUCKET, Key="killed/run/metrics.jsonl")["Body"].read().decode())
    assert sorted(final) == list(range(1, 33))
    np.testing.assert_allclose([final[s] for s in replayed], [before_kill[s] for s in replayed], rtol=1e-5)
    np.testing.assert_allclose([final[s] for s in range(1, last_saved + 1)],
                               [before_kill[s] for s in range(1, last_saved + 1)], rtol=0)  # uploaded, kept


def copy_step(s3, source: str, target: str, *, without: str | None = None) -> None:
    """Copies the objects of step folder `source` to `target` (bucket keys), leaving out the key `without` ends in."""
    for key in keys(s3, source + "/"):
        if without is None or not key.endswith(without):
            s3.copy_object(Bucket=BUCKET, Key=target + key[len(source):], CopySource={"Bucket": BUCKET, "Key": key})


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_half_written_step_is_never_resumed_from(runs, s3):
    run, folder = f"s3://{BUCKET}/half/run", "half/run/checkpoints"
    copy_step(s3, "runs/run/checkpoints/16", f"{folder}/16")
    assert latest_complete_step(f"{run}/checkpoints") == 16
    # Step 16 again as step 20 without the step's commit marker, written last: a save cut off before its end (the
    # items' own markers are there).
    copy_step(s3, "runs/run/checkpoints/16", f"{folder}/20", without="16/commit_success.txt")
    assert f"{folder}/20/state/commit_success.txt" in keys(s3, f"{folder}/20/")
    assert f"{folder}/20/commit_success.txt" not in keys(s3, f"{folder}/20/")
    assert latest_complete_step(f"{run}/checkpoints") == 16
    assert resolve_resume("latest", run) == (f"{run}/checkpoints", 16)
    assert resolve_resume(run, run) == (f"{run}/checkpoints", 16)
    with pytest.raises(MissingInput, match="never completed"):
        resolve_resume(f"{run}/checkpoints/20", run)
    # A step another process completed since this one last looked is seen (no stale listing).
    copy_step(s3, "runs/run/checkpoints/16", f"{folder}/24")
    assert latest_complete_step(f"{run}/checkpoints") == 24
    checkpoints = RunCheckpoints(f"{run}/checkpoints")
    try:
        assert checkpoints.all_steps() == [16, 24]
    finally:
        checkpoints.close()
    # The manager of a restarted run clears the unfinished step, so that step can be saved again.
    assert keys(s3, f"{folder}/20/") == []


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_report_reads_a_remote_run(runs, s3, tmp_path, capsys):
    output = tmp_path / "report.png"
    assert report_lib.main([runs["remote"], "--output", str(output)]) == 0
    table = capsys.readouterr().out
    assert output.read_bytes()[:4] == b"\x89PNG"
    assert "loss" in table
    assert report_lib.main([runs["remote"]]) == 0  # the default PNG lands next to the metrics, on the bucket
    assert s3.get_object(Bucket=BUCKET, Key="runs/run/report.png")["Body"].read()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_paths_on_the_bucket_go_through_fsspec_where_tensorflow_is_importable(runs, monkeypatch):
    """epath would hand s3:// to tf.io.gfile (no S3 there) wherever TensorFlow is installed."""
    from etils.epath import gpath

    real_find_spec = importlib.util.find_spec
    monkeypatch.delenv("EPATH_USE_TF", raising=False)
    monkeypatch.setattr(gpath.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "tensorflow" else real_find_spec(name, *a))
    assert "checkpoints" in storage.listdir(runs["remote"])
    assert os.environ["EPATH_USE_TF"] == "false"


@pytest.mark.slow
@pytest.mark.subprocess
def test_restoring_from_another_runs_bucket_folder_leaves_it_as_it_is(runs, s3):
    """A run resuming from (or fine-tuning) another run's checkpoints must not clean up that run's unfinished
    save: it may still be writing it."""
    copy_step(s3, "runs/run/checkpoints/16", "live/run/checkpoints/16")
    copy_step(s3, "runs/run/checkpoints/16", "live/run/checkpoints/24", without="16/commit_success.txt")
    in_flight = keys(s3, "live/run/checkpoints/24/")
    checkpoints = RunCheckpoints(f"s3://{BUCKET}/live/run/checkpoints", read_only=True)
    try:
        assert checkpoints.all_steps() == [16]
    finally:
        checkpoints.close()
    assert keys(s3, "live/run/checkpoints/24/") == in_flight != []


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_failed_metrics_upload_at_a_save_is_a_warning_not_the_end_of_the_run(s3, shards, tmp_path, monkeypatch,
                                                                                caplog):
    calls = []

    def flaky_upload(local, remote):
        calls.append(remote)
        if len(calls) == 1:
            raise OSError("connection reset")
        real_upload(local, remote)

    real_upload = storage.upload
    monkeypatch.setattr(storage, "upload", flaky_upload)
    config = tiny_config(shards, f"s3://{BUCKET}/flaky", train_num_samples=512, save_every_steps=4)  # 8 steps
    assert train_lib.train(config)["step"] == 8
    assert "could not upload the run's metrics" in caplog.text
    final = losses_from_text(s3.get_object(Bucket=BUCKET, Key="flaky/run/metrics.jsonl")["Body"].read().decode())
    assert sorted(final) == list(range(1, 9))  # the next sync sent what the failed one had not


@pytest.mark.subprocess
def test_a_missing_bucket_is_one_clear_line(s3, shards):
    with pytest.raises(MissingInput, match="bucket s3://no-such-bucket .*does not exist"):
        train_lib.Trainer(tiny_config(shards, "s3://no-such-bucket/runs"))


@pytest.mark.subprocess
def test_missing_credentials_are_one_clear_line(s3, shards, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(RunFailed, match=f"s3://{BUCKET}/runs: no usable credentials .*AWS_ACCESS_KEY_ID"):
        train_lib.Trainer(tiny_config(shards, f"s3://{BUCKET}/runs"))


@pytest.mark.subprocess
def test_an_unreachable_endpoint_is_one_clear_line(s3, shards, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{local_s3.free_port()}")
    with pytest.raises(RunFailed, match="cannot reach the storage endpoint"):
        train_lib.Trainer(tiny_config(shards, f"s3://{BUCKET}/runs"))


def test_gs_run_directories_take_the_commit_file_scheme_without_network(shards, monkeypatch):
    from orbax.checkpoint._src.path import atomicity
    from orbax.checkpoint._src.serialization import tensorstore_utils

    check_config(tiny_config(shards, "gs://bucket/runs"), num_devices=8)
    assert storage.checkpoint_temporary_path_class("gs://bucket/runs/run/checkpoints") \
        is atomicity.CommitFileTemporaryPath
    assert storage.checkpoint_temporary_path_class("s3://bucket/runs/run/checkpoints") \
        is atomicity.CommitFileTemporaryPath
    assert storage.checkpoint_temporary_path_class("/tmp/runs/run/checkpoints") is None
    storage.enable_orbax_s3()  # s3 support leaves gs:// and local paths to Orbax's own specs
    gs_spec = tensorstore_utils.build_kvstore_tspec("gs://bucket/runs/1/state", use_ocdbt=False)
    assert gs_spec["driver"].startswith("gcs") and gs_spec["bucket"] == "bucket"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://store.example:9000")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv(storage.RETRIES_VARIABLE, "5")
    s3_spec = tensorstore_utils.build_kvstore_tspec("s3://bucket/runs/1/state", use_ocdbt=False)
    assert s3_spec == {"driver": "s3", "bucket": "bucket", "path": "runs/1/state/",
                       "endpoint": "http://store.example:9000", "aws_region": "eu-west-3",
                       "aws_credentials": {"type": "environment"},
                       "context": {"s3_request_retries": {"max_retries": 5, "initial_delay": "0.5s",
                                                          "max_delay": "16s"}}}
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    assert "aws_credentials" not in tensorstore_utils.build_kvstore_tspec("s3://bucket/x", use_ocdbt=False)
    assert tensorstore_utils.build_kvstore_tspec("/tmp/x", use_ocdbt=False)["driver"] == "file"

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gcsfs" else real_find_spec(name, *a))
    with pytest.raises(MissingExtra, match=r"a gs:// run directory needs the gcsfs package, which is not installed: "
                                           r"pip install 'clipjax-train\[remote\]'"):
        train_lib.Trainer(tiny_config(shards, "gs://bucket/runs"))
