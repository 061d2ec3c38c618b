"""Two processes x 4 CPU devices joined with gloo against one process x 8 devices: same global batch, same
losses, same parameters; checkpoints cross the process count; a dead process makes its peer exit."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from clip_jax import data
from clip_jax import train as train_lib
from clip_jax.checkpoint import RunCheckpoints
from clip_jax.data import make_shards
from clip_jax.parallel import create_mesh, make_global_batch
from test_train import TINY, losses, tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "launch"))
import local as local_launch  # noqa: E402

STEPS = 4  # 256 samples / (8 per device x 8 devices)


@pytest.fixture(scope="module")
def shard_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("mh")
    model = out / "tiny.json"
    model.write_text(json.dumps(TINY))
    samples = make_shards.fashion_mnist_samples("train", limit=256)
    paths = make_shards.write_shards(samples, str(out / "shards"), 32)
    return make_shards.shard_pattern(paths), str(model)


def config_for(shard_data, logs, **overrides):
    settings = {"train_num_samples": 256, "save_every_steps": 2, "warmup": 2, **overrides}
    return tiny_config(shard_data, logs, **settings)


def start_ranks(config, num_processes, devices, *, heartbeat=60, init_timeout=60, log_dir=None):
    """The trainer as `num_processes` joined processes, `devices` CPU devices each."""
    port = local_launch.free_port()
    processes = []
    for rank in range(num_processes):
        env = local_launch.rank_env(os.environ, rank, num_processes, port, devices, heartbeat)
        env.update(CLIP_JAX_TEST_CONFIG=config.to_json(), CLIP_JAX_INIT_TIMEOUT=str(init_timeout))
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        out = open(os.path.join(log_dir, f"rank-{rank}.log"), "w") if log_dir else subprocess.PIPE
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "clip_jax.train", f"--config={REPO}/tests/train_config.py"], env=env, cwd=REPO,
            stdout=out, stderr=subprocess.STDOUT, text=True))
    return processes


def global_batches(config, process_count):
    """The global batches of a `process_count`-process run, assembled here from every process's iterator."""
    iterators = [data.build_train_iterator(
        train_lib.data_config(config), global_batch_size=64, image_size=28, mean=tuple(config.image_mean),
        std=tuple(config.image_std), process_index=p, process_count=process_count, context_length=16)
        for p in range(process_count)]
    while True:
        pieces = [next(it) for it in iterators]
        yield {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}


@pytest.fixture(scope="module")
def two_process_run(shard_data, tmp_path_factory):
    logs = tmp_path_factory.mktemp("two")
    config = config_for(shard_data, logs)
    t0 = time.perf_counter()
    processes = start_ranks(config, 2, 4)
    outputs = [p.communicate(timeout=400)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], "\n\n".join(outputs)
    print(f"2 processes x 4 devices, {STEPS} steps: {time.perf_counter() - t0:.1f} s")
    return config, logs / "run", outputs


@pytest.fixture(scope="module")
def one_process(two_process_run):
    """(mesh, engine) of this test process: 1 process x 8 devices, compiled once for the tests below."""
    config = two_process_run[0]
    mesh = create_mesh()
    schedule = train_lib.make_schedule(config, jax.device_count())
    return mesh, train_lib.build_engine(config, "fp32", mesh, schedule)


def run_steps(engine, mesh, state, batches, steps):
    out = []
    for _ in range(steps):
        state, metrics = engine.step_fn(state, make_global_batch(next(batches), mesh))
        out.append(float(metrics["loss"]))
    return state, out


def test_only_rank_0_reports_and_every_rank_writes_its_checkpoint_shards(two_process_run):
    _, run_dir, outputs = two_process_run
    assert "step 1/4" in outputs[0] and "step 1/4" not in outputs[1]
    step_dir = run_dir / "checkpoints" / str(STEPS)
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(os.listdir(step_dir / "data_iter"))
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(step_dir / "state"))


def test_two_processes_train_exactly_as_one_process_on_the_same_global_batch(two_process_run, one_process):
    config, run_dir, _ = two_process_run
    assert jax.process_count() == 1 and jax.device_count() == 8
    mesh, engine = one_process
    fresh = train_lib.fresh_state(engine, config.seed)
    state, got = run_steps(engine, mesh, fresh, global_batches(config, 2), STEPS)
    two = losses(run_dir)
    np.testing.assert_allclose(got, [two[s] for s in range(1, STEPS + 1)], rtol=1e-5)
    saved, meta = RunCheckpoints(str(run_dir / "checkpoints")).restore(STEPS, engine.abstract_state)
    assert meta["global_batch"] == 64
    # fp32 sums in another order (gloo across processes vs one process) differ in the last bits; Adam turns a
    # last-bit difference of a near-zero gradient into up to ~1% of one update (lr 3e-3).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4),
                 saved.params, state.params)
    initial = train_lib.fresh_state(engine, config.seed).params
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(saved.params), jax.tree.leaves(initial)))
    assert moved > 5e-3  # training moved the parameters far more than the tolerance


def test_a_two_process_checkpoint_continues_identically_in_one_process(two_process_run, one_process):
    config, run_dir, _ = two_process_run
    mesh, engine = one_process
    state, _ = RunCheckpoints(str(run_dir / "checkpoints")).restore(2, engine.abstract_state)
    batches = global_batches(config, 2)
    next(batches), next(batches)  # the two batches the checkpoint has seen
    _, got = run_steps(engine, mesh, state, batches, STEPS - 2)
    two = losses(run_dir)
    np.testing.assert_allclose(got, [two[s] for s in range(3, STEPS + 1)], rtol=1e-5)


def test_killing_one_process_makes_the_other_exit_within_the_heartbeat_timeout(shard_data, tmp_path):
    heartbeat = 5
    config = config_for(shard_data, tmp_path, epochs=1000, save_every_steps=0)
    processes = start_ranks(config, 2, 1, heartbeat=heartbeat, log_dir=str(tmp_path))
    try:
        deadline = time.time() + 240
        while not (os.path.exists(tmp_path / "run" / "metrics.jsonl") and losses(tmp_path / "run")):
            assert time.time() < deadline and all(p.poll() is None for p in processes), \
                (tmp_path / "rank-0.log").read_text()
            time.sleep(0.2)
        processes[1].send_signal(signal.SIGKILL)
        killed = time.perf_counter()
        processes[0].wait(timeout=heartbeat * 6 + 30)
        waited = time.perf_counter() - killed
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"survivor exited {waited:.1f} s after its peer was killed (heartbeat timeout {heartbeat} s)")
    assert processes[0].returncode != 0
    assert waited < heartbeat * 6 + 30


def test_resuming_on_another_process_count_stops_at_the_data_position_it_cannot_carry(two_process_run, tmp_path):
    # Each process saved its own data-iterator position (process_R-of-2.json); one process reads other shards
    # in another order, so there is no position to restore and the trainer refuses rather than guess.
    config, run_dir, _ = two_process_run
    other = config.copy_and_resolve_references()
    other.unlock()
    other.resume, other.name, other.logs = str(run_dir / "checkpoints" / "2"), "other", str(tmp_path)
    with pytest.raises(ValueError, match="process_0-of-1.json"):
        train_lib.Trainer(other)
