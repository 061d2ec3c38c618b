"""Multi-process runs and their storage: a rank whose run directory fails takes the whole launch down at once. (A
2 x 2 run on the local S3 server, a rank killed mid-save and the launch run again: tests/test_chaos.py.)"""

import os
import shutil
import subprocess
import sys
import time

import pytest
from trainer_run import losses, tiny_config
from xla_flags import FAST_COMPILE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def shards(fashion_mnist_shards):
    return fashion_mnist_shards(512)


def launch(config, log_dir, *, processes=2, devices=1, heartbeat=10, out=subprocess.PIPE):
    """launch/local.py running the trainer as `processes` joined ranks of `devices` CPU devices each, its children
    (`--loopback-mtu 0`: in this process's network, with its private loopback where it has one, private_loopback)."""
    env = {**os.environ, "CLIP_JAX_TEST_CONFIG": config.to_json(), "CLIP_JAX_INIT_TIMEOUT": "60"}
    env["XLA_FLAGS"] = FAST_COMPILE  # the launcher adds each rank's devices
    return subprocess.Popen(
        [sys.executable, f"{REPO}/launch/local.py", str(processes), "--loopback-mtu", "0",
         "--devices-per-process", str(devices), "--heartbeat-timeout", str(heartbeat), "--log-dir", str(log_dir),
         "--", sys.executable, "-m", "clip_jax.train", f"--config={REPO}/tests/train_config.py"],
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
