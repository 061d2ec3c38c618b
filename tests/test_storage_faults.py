"""A run directory on a bucket whose requests fail now and then (tests/s3_fault_proxy.py in front of the local S3
server): 5% of requests failing (500, 503, slow, cut off) changes nothing in the run, and an outage stops it with one
line naming the bucket, the previous checkpoint intact."""

import json
import os
import subprocess
import sys
import threading
import time

import jax
import local_s3
import numpy as np
import pytest
from s3_fault_proxy import FaultProxy
from trainer_run import tiny_config

from clip_jax.runtime.run_directory import read_params
from clip_jax.training import trainer as train_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "clip-faults"
SETTINGS = dict(train_num_samples=512, save_every_steps=2, keep=10)  # 8 steps, a checkpoint every 2
TRAINING_FIELDS = ("step", "loss", "accuracy", "logit_scale", "grad_norm", "learning_rate", "samples_seen", "replay")


@pytest.fixture(scope="module")
def s3():
    """(a boto3 client straight to a moto S3 server, the fault proxy in front of it); the AWS_* variables point at
    the proxy, which starts without faults."""
    with local_s3.moto_server() as endpoint, FaultProxy(endpoint, seed=0, slow_s=0.3) as proxy:
        with local_s3.bucket_on(endpoint, BUCKET, clients_via=proxy.url) as client:
            yield client, proxy


@pytest.fixture(scope="module")
def shards(fashion_mnist_shards):
    return fashion_mnist_shards(512)


def committed_steps(client, run: str) -> list[int]:
    return local_s3.committed_steps(client, BUCKET, run)


def flat_params(run_dir: str, step: int | None = None) -> dict:
    where = run_dir if step is None else f"{run_dir}/checkpoints/{step}"
    return {jax.tree_util.keystr(path): np.asarray(value)
            for path, value in jax.tree_util.tree_flatten_with_path(read_params(where))[0]}


def metrics(client, run: str) -> list[dict]:
    text = client.get_object(Bucket=BUCKET, Key=f"{run}/metrics.jsonl")["Body"].read().decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def clean_run(s3, shards):
    """The run without faults: its directory on the bucket."""
    client, proxy = s3
    proxy.set(rate=0.0)
    assert train_lib.train(tiny_config(shards, f"s3://{BUCKET}/clean", **SETTINGS))["step"] == 8
    return f"s3://{BUCKET}/clean/run"


@pytest.mark.slow
def test_five_percent_of_requests_failing_changes_nothing_and_loses_no_checkpoint(s3, shards, clean_run):
    client, proxy = s3
    before = dict(proxy.counts)
    proxy.set(rate=0.05)
    try:
        assert train_lib.train(tiny_config(shards, f"s3://{BUCKET}/faulty", **SETTINGS))["step"] == 8
    finally:
        proxy.set(rate=0.0)
    seen = {kind: proxy.counts[kind] - before[kind] for kind in proxy.counts}
    print(f"requests and faults met: {seen}")
    assert seen["500"] + seen["503"] + seen["cut"] >= 5, seen  # failures were met, and retried
    assert committed_steps(client, "faulty/run") == committed_steps(client, "clean/run") == [2, 4, 6, 8]
    clean, faulty = flat_params(clean_run), flat_params(f"s3://{BUCKET}/faulty/run")
    assert clean.keys() == faulty.keys()
    for name in clean:
        np.testing.assert_array_equal(faulty[name], clean[name], err_msg=name)
    training = lambda records: [{k: r.get(k) for k in TRAINING_FIELDS} for r in records]  # noqa: E731  not timings
    assert training(metrics(client, "faulty/run")) == training(metrics(client, "clean/run"))


@pytest.mark.slow
@pytest.mark.subprocess
def test_an_outage_stops_the_run_with_one_line_and_keeps_the_previous_checkpoint(s3, shards, clean_run):
    """The bucket stops answering (every request a 503) once checkpoint 4 is committed: the save of step 8 fails
    after its retries, and the run exits 1 with one line on stderr."""
    client, proxy = s3
    config = tiny_config(shards, f"s3://{BUCKET}/outage", **(SETTINGS | {"save_every_steps": 4}))
    stop = threading.Event()

    def outage_after_checkpoint_4():
        while not stop.is_set():
            if 4 in committed_steps(client, "outage/run"):
                proxy.set(rate=1.0, kinds=("503",))
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=outage_after_checkpoint_4, daemon=True)
    watcher.start()
    env = {**os.environ, "CLIP_JAX_TEST_CONFIG": config.to_json(), "CLIP_JAX_STORAGE_RETRIES": "2",
           "JAX_PLATFORMS": "cpu"}
    try:
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "clip_jax.train", f"--config={REPO}/tests/train_config.py"],
                              env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        took = time.perf_counter() - t0
    finally:
        stop.set()
        watcher.join()
        proxy.set(rate=0.0, kinds=("500", "503", "slow", "cut"))
    print(f"the run stopped {took:.0f} s after it started; stderr:\n{done.stderr}")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines == [lines[-1]] and lines[-1].startswith(
        f"error: the storage of s3://{BUCKET}/outage/run/checkpoints failed: saving checkpoint "), done.stderr
    assert "failed after 2 attempts of each request" in lines[-1]
    assert "Service Unavailable" in lines[-1] or "Please reduce your request rate" in lines[-1]  # the 503, by s3fs
    assert "checkpoint 4 is complete and untouched" in lines[-1]
    assert "--config.resume=latest" in lines[-1]
    assert max(committed_steps(client, "outage/run")) == 4
    kept, clean = flat_params(f"s3://{BUCKET}/outage/run"), flat_params(clean_run, 4)
    for name in clean:
        np.testing.assert_array_equal(kept[name], clean[name], err_msg=name)
