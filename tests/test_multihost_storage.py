"""Multi-process runs and their storage: 2 processes x 2 devices training into an s3:// run directory on the local
S3 server, a rank SIGKILLed mid-run and the launch run again, end bit for bit as the launch left alone; a rank whose
run directory fails takes the whole launch down at once."""

import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import local_s3
import numpy as np
import pytest
from trainer_run import losses, tiny_config
from xla_flags import FAST_COMPILE

from clip_jax.runtime.checkpoints import read_params

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def shards(fashion_mnist_shards):
    return fashion_mnist_shards(512)


def launch(config, log_dir, *, processes=2, devices=1, heartbeat=10, out=subprocess.PIPE):
    """launch/local.py running the trainer as `processes` joined ranks of `devices` CPU devices each."""
    env = {**os.environ, "CLIP_JAX_TEST_CONFIG": config.to_json(), "CLIP_JAX_INIT_TIMEOUT": "60"}
    env["XLA_FLAGS"] = FAST_COMPILE  # the launcher adds each rank's devices
    return subprocess.Popen(
        [sys.executable, f"{REPO}/launch/local.py", str(processes), "--devices-per-process", str(devices),
         "--heartbeat-timeout", str(heartbeat), "--log-dir", str(log_dir), "--", sys.executable, "-m",
         "clip_jax.train", f"--config={REPO}/tests/train_config.py"],
        env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)


def rank_pids(launcher) -> list[int]:
    with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
        return [int(pid) for pid in f.read().split()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_rank_whose_run_directory_vanishes_takes_the_launch_down_at_once(shards, tmp_path):
    """Seen before the fix: rank 0 printed its FileNotFoundError (its TensorBoard file) and then waited at JAX's
    shutdown barrier for rank 1, which waited in a collective for rank 0: both alive minutes later."""
    heartbeat = 10
    config = tiny_config(shards, tmp_path / "logs", epochs=1000, save_every_steps=0, report_to="tensorboard")
    launcher = launch(config, tmp_path / "ranks", heartbeat=heartbeat)
    run_dir = tmp_path / "logs" / "run"
    deadline = time.time() + 240
    try:
        while not ((run_dir / "metrics.jsonl").exists() and losses(run_dir)):
            assert launcher.poll() is None and time.time() < deadline, launcher.stdout.read()
            time.sleep(0.2)
        ranks = rank_pids(launcher)
        shutil.rmtree(run_dir)
        removed = time.perf_counter()
        output = launcher.communicate(timeout=heartbeat * 3 + 30)[0]  # past it: the launch hangs (test fails)
        took = time.perf_counter() - removed
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    print(f"the launch exited {took:.1f} s after the run directory was removed")
    assert launcher.returncode != 0
    assert "FileNotFoundError" in output, output[-3000:]  # rank 0's error (both ranks may end before the launcher looks)
    assert took < heartbeat * 3, output[-3000:]
    assert len(ranks) == 2 and not any(alive(pid) for pid in ranks)


BUCKET = "clip-multihost"
BUCKET_RUN = dict(train_num_samples=512, save_every_steps=4, keep=10, resume="latest")  # 2 x 2 devices: 16 steps


@pytest.fixture(scope="module")
def s3():
    with local_s3.moto_server() as endpoint, local_s3.bucket_on(endpoint, BUCKET) as client:
        yield client


def final_state(client, run: str) -> tuple[dict, dict]:
    """(params by name, data-iterator files by name) of the run's newest checkpoint, read from the bucket."""
    params = {jax.tree_util.keystr(path): np.asarray(value) for path, value in
              jax.tree_util.tree_flatten_with_path(read_params(f"s3://{BUCKET}/{run}"))[0]}
    step = max(local_s3.committed_steps(client, BUCKET, run))
    prefix = f"{run}/checkpoints/{step}/data_iter/"
    positions = {key[len(prefix):]: client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
                 for key in local_s3.keys(client, BUCKET, prefix) if not key.endswith(local_s3.COMMIT_FILE)}
    return params, positions


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_by_two_on_a_bucket_killed_and_relaunched_ends_bit_for_bit_as_left_alone(s3, shards, tmp_path):
    alone = launch(tiny_config(shards, f"s3://{BUCKET}/alone", **BUCKET_RUN), tmp_path / "alone", devices=2)
    output = alone.communicate(timeout=400)[0]
    assert alone.returncode == 0, output[-3000:]

    config = tiny_config(shards, f"s3://{BUCKET}/killed", **BUCKET_RUN)
    with open(tmp_path / "killed.log", "w") as out:
        killed = launch(config, tmp_path / "killed", devices=2, out=out)
        try:
            deadline = time.time() + 300
            while 4 not in local_s3.committed_steps(s3, BUCKET, "killed/run"):  # then the kill, mid-run
                assert killed.poll() is None and time.time() < deadline, (tmp_path / "killed.log").read_text()
                time.sleep(0.1)
            rank_1 = rank_pids(killed)[1]
            os.kill(rank_1, signal.SIGKILL)
            killed.wait(timeout=120)
        finally:
            if killed.poll() is None:
                killed.kill()
                killed.wait()
    assert killed.returncode != 0, (tmp_path / "killed.log").read_text()[-3000:]
    saved = local_s3.committed_steps(s3, BUCKET, "killed/run")
    assert max(saved) < 16, saved  # the kill came before the end

    relaunched = launch(config, tmp_path / "relaunched", devices=2)
    output = relaunched.communicate(timeout=400)[0]
    assert relaunched.returncode == 0, output[-3000:]
    assert f"resumed s3://{BUCKET}/killed/run/checkpoints/{max(saved)}" in output, output[-3000:]
    print(f"killed after checkpoint {max(saved)} was committed; relaunched and resumed from it")

    alone_params, alone_positions = final_state(s3, "alone/run")
    params, positions = final_state(s3, "killed/run")
    assert max(local_s3.committed_steps(s3, BUCKET, "killed/run")) == 16
    assert params.keys() == alone_params.keys()
    for name in alone_params:
        np.testing.assert_array_equal(params[name], alone_params[name], err_msg=name)
    assert sorted(positions) == ["process_0-of-2.json", "process_1-of-2.json"]
    assert positions == alone_positions  # each process's data position, byte for byte
