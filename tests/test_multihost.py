"""Two processes x 4 CPU devices joined with gloo against one process x 8 devices: same global batch, same
losses, same parameters; checkpoints cross the process count (the data position only where asked to reseed); a
dead process makes its peer exit."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from trainer_run import losses, tiny_config
from xla_flags import xla_flags

from clip_jax import data
from clip_jax.data import make_shards
from clip_jax.runtime.checkpoints import CheckpointMeta, RunCheckpoints, data_iter_files, read_meta, saved_process_count
from clip_jax.runtime.mesh import create_mesh, make_global_batch
from clip_jax.training import run_setup
from clip_jax.training import trainer as train_lib
from clip_jax.training.remat_choice import step_spec
from clip_jax.training.schedule import make_schedule
from clip_jax.training.step_factory import build_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "launch"))
import local as local_launch  # noqa: E402

STEPS = 4  # 256 samples / (8 per device x 8 devices)
NOT_CLEAN = re.compile(r"Traceback|KeyboardInterrupt|Segmentation|terminated unexpectedly")


@pytest.fixture(scope="module")
def shard_data(tmp_path_factory, trainer_model_file):
    out = tmp_path_factory.mktemp("mh")
    samples = make_shards.fashion_mnist_samples("train", limit=256)
    paths = make_shards.write_shards(samples, str(out / "shards"), 32)
    return make_shards.shard_pattern(paths), trainer_model_file


def config_for(shard_data, logs, **overrides):
    settings = {"train_num_samples": 256, "save_every_steps": 2, "warmup": 2, **overrides}
    return tiny_config(shard_data, logs, **settings)


def start_ranks(config, num_processes, devices, *, heartbeat=60, init_timeout=60, log_dir=None, env=None):
    """The trainer as `num_processes` joined processes, `devices` CPU devices each (`env`: more variables)."""
    port = local_launch.free_port()
    processes, extra = [], env or {}
    for rank in range(num_processes):
        env = local_launch.rank_env(os.environ, rank, num_processes, port, devices, heartbeat)
        env.update(CLIP_JAX_TEST_CONFIG=config.to_json(), CLIP_JAX_INIT_TIMEOUT=str(init_timeout), **extra)
        env["XLA_FLAGS"] = xla_flags(devices)
        out = open(os.path.join(log_dir, f"rank-{rank}.log"), "w") if log_dir else subprocess.PIPE
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "clip_jax.train", f"--config={REPO}/tests/train_config.py"], env=env, cwd=REPO,
            stdout=out, stderr=subprocess.STDOUT, text=True))
    return processes


def kill_survivors(processes) -> None:
    """SIGKILL for every rank still running (a test that failed midway leaves none behind)."""
    for p in processes:
        if p.poll() is None:
            p.kill()
            p.wait()


def global_batches(config, process_count, seed=None):
    """The global batches of a `process_count`-process run (data seed `seed`, else the config's), assembled here
    from every process's iterator."""
    iterators = [data.build_train_iterator(
        data.TrainDataConfig.from_run_config(config, seed=seed), global_batch_size=64, image_size=28,
        mean=tuple(config.image_mean), std=tuple(config.image_std), process_index=p, process_count=process_count,
        context_length=16)
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
    schedule = make_schedule(config, jax.device_count())
    return mesh, build_step(step_spec(config, schedule, mesh, "fp32"), mesh)


def saved_steps(checkpoints_dir) -> list[int]:
    with RunCheckpoints(str(checkpoints_dir), read_only=True) as saved:
        return saved.all_steps()


def restored(checkpoints_dir, step, abstract_state):
    with RunCheckpoints(str(checkpoints_dir), read_only=True) as saved:
        return saved.restore(step, abstract_state)


def run_steps(engine, mesh, state, batches, steps):
    out = []
    for _ in range(steps):
        state, metrics = engine(state, make_global_batch(next(batches), mesh))
        out.append(float(metrics["loss"]))
    return state, out


@pytest.mark.subprocess
@pytest.mark.slow
def test_only_rank_0_reports_and_every_rank_writes_its_checkpoint_shards(two_process_run):
    _, run_dir, outputs = two_process_run
    assert "step 1/4" in outputs[0] and "step 1/4" not in outputs[1]
    step_dir = run_dir / "checkpoints" / str(STEPS)
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(os.listdir(step_dir / "data_iter"))
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(step_dir / "state"))


@pytest.mark.subprocess
@pytest.mark.slow
def test_two_processes_train_exactly_as_one_process_on_the_same_global_batch(two_process_run, one_process):
    config, run_dir, _ = two_process_run
    assert jax.process_count() == 1 and jax.device_count() == 8
    mesh, engine = one_process
    fresh = engine.init(config.seed)
    state, got = run_steps(engine, mesh, fresh, global_batches(config, 2), STEPS)
    two = losses(run_dir)
    np.testing.assert_allclose(got, [two[s] for s in range(1, STEPS + 1)], rtol=1e-5)
    saved, meta = restored(run_dir / "checkpoints", STEPS, engine.abstract_state)
    assert meta.global_batch == 64
    # fp32 sums in another order (gloo across processes vs one process) differ in the last bits; Adam turns a
    # last-bit difference of a near-zero gradient into up to ~1% of one update (lr 3e-3).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4),
                 saved.params, state.params)
    initial = engine.init(config.seed).params
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(saved.params), jax.tree.leaves(initial)))
    assert moved > 5e-3  # training moved the parameters far more than the tolerance


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_two_process_checkpoint_continues_identically_in_one_process(two_process_run, one_process):
    config, run_dir, _ = two_process_run
    mesh, engine = one_process
    state, _ = restored(run_dir / "checkpoints", 2, engine.abstract_state)
    batches = global_batches(config, 2)
    next(batches), next(batches)  # the two batches the checkpoint has seen
    _, got = run_steps(engine, mesh, state, batches, STEPS - 2)
    two = losses(run_dir)
    np.testing.assert_allclose(got, [two[s] for s in range(3, STEPS + 1)], rtol=1e-5)


def wait_for_a_logged_step(processes, logs, timeout=240):
    """Until rank 0 has logged a step of the run in `logs`; fails if a rank exits first."""
    deadline = time.time() + timeout
    while not (os.path.exists(logs / "run" / "metrics.jsonl") and losses(logs / "run")):
        assert time.time() < deadline and all(p.poll() is None for p in processes), \
            (logs / "rank-0.log").read_text()
        time.sleep(0.2)


@pytest.mark.subprocess
@pytest.mark.slow
def test_killing_one_process_makes_the_other_exit_within_the_heartbeat_timeout(shard_data, tmp_path):
    """The survivor does not hang in a collective with the dead rank: either that collective fails on the closed
    connection and the survivor ends at once with the error (exit 1, `processes.leave_run`), or its coordination
    service, missing rank 1's heartbeats for the 5 s it was given, names it and terminates the process (SIGABRT
    from JAX's C++)."""
    heartbeat = 5
    config = config_for(shard_data, tmp_path, epochs=1000, save_every_steps=0)
    processes = start_ranks(config, 2, 1, heartbeat=heartbeat, log_dir=str(tmp_path))
    try:
        wait_for_a_logged_step(processes, tmp_path)
        processes[1].send_signal(signal.SIGKILL)
        killed = time.perf_counter()
        processes[0].wait(timeout=heartbeat * 6 + 30)  # no exit by then: the survivor hangs (the test fails)
        waited = time.perf_counter() - killed
    finally:
        kill_survivors(processes)
    print(f"survivor exited {waited:.1f} s after its peer was killed (heartbeat timeout {heartbeat} s)")
    log = (tmp_path / "rank-0.log").read_text()
    assert f"a dead peer fails the run after {heartbeat} s without heartbeat" in log
    assert processes[0].returncode in (1, -signal.SIGABRT), log[-3000:]
    if processes[0].returncode == 1:
        assert re.search(r"Gloo .* failed: .*(Connection reset by peer|Connection closed by peer)", log), log[-3000:]
        assert waited < heartbeat, log[-3000:]
    else:
        assert "UNAVAILABLE: Task 1 heartbeat timeout" in log, log[-3000:]
        assert "Terminating process because the JAX distributed service detected fatal errors" in log, log[-3000:]


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_rank_that_reaches_its_first_step_40_s_after_the_other_does_not_fail_the_run(shard_data, tmp_path):
    """Gloo gives the peers of a first collective 30 s to meet: a rank that set up more slowly (seen on a loaded
    machine, in relaunches under benchmarks/chaos.py) failed both with `Gloo context initialization failed:
    DEADLINE_EXCEEDED`. The ranks now meet at the coordination service's barrier before their first step."""
    # 2 x 2 devices: the step's collectives span 4 devices, a group no collective before the first step used (with
    # one device per process, the stop check's all-gather before it has met the peers already)
    config = config_for(shard_data, tmp_path, save_every_steps=0)
    processes = start_ranks(config, 2, 2, log_dir=str(tmp_path), env={"CLIP_JAX_TEST_SLOW_RANK": "1:40"})
    try:
        codes = [p.wait(timeout=300) for p in processes]
    finally:
        kill_survivors(processes)
    logs = [(tmp_path / f"rank-{r}.log").read_text() for r in (0, 1)]
    assert codes == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    assert sorted(losses(tmp_path / "run")) == list(range(1, 256 // (8 * 4) + 1))


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_sigterm_to_one_process_stops_both_at_the_same_step_with_a_checkpoint(shard_data, tmp_path):
    # SLURM signals every rank, but not at the same instant: the ranks must agree on one step to save.
    config = config_for(shard_data, tmp_path, epochs=1000, save_every_steps=0)
    processes = start_ranks(config, 2, 1, log_dir=str(tmp_path))
    try:
        wait_for_a_logged_step(processes, tmp_path)
        processes[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in processes]
    finally:
        kill_survivors(processes)
    logs = [(tmp_path / f"rank-{r}.log").read_text() for r in (0, 1)]
    assert codes == [0, 0], "\n\n".join(logs)
    stopped = int(re.search(r"saved checkpoint (\d+)", logs[0]).group(1))
    assert stopped % train_lib.STOP_CHECK_EVERY_STEPS == 0
    assert stopped in saved_steps(tmp_path / "run" / "checkpoints")
    files = os.listdir(tmp_path / "run" / "checkpoints" / str(stopped) / "data_iter")
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(files)


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_sigterm_to_one_process_during_the_set_up_stops_both_in_one_line_each(shard_data, tmp_path):
    # Rank 1 is signalled as it joins: both ranks stop at the same set-up check (none waits for the other in a
    # collective until the heartbeat fails it), exit 130 and save nothing.
    config = config_for(shard_data, tmp_path, epochs=1000, save_every_steps=0)
    processes = start_ranks(config, 2, 1, log_dir=str(tmp_path))
    try:
        deadline = time.time() + 120
        while "joining" not in (tmp_path / "rank-1.log").read_text():
            assert time.time() < deadline and processes[1].poll() is None, (tmp_path / "rank-1.log").read_text()
            time.sleep(0.05)
        processes[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in processes]
    finally:
        kill_survivors(processes)
    logs = [(tmp_path / f"rank-{r}.log").read_text() for r in (0, 1)]
    assert codes == [130, 130], "\n\n".join(logs)
    stop_line = r"^{} [a-z ]+: stopped before the first step, nothing saved$"
    assert re.search(stop_line.format("a stop signal to another process"), logs[0], re.M), logs[0]
    assert re.search(stop_line.format("SIGTERM"), logs[1], re.M), logs[1]
    assert not any("Traceback" in log for log in logs), "\n\n".join(logs)
    assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(tmp_path / "run" / "checkpoints")


def local_launch_run(config, log_dir) -> subprocess.Popen:
    """launch/local.py running the trainer as 2 ranks x 1 device, in a process group of its own as a terminal
    runs a command (Ctrl-C reaches the launcher and both ranks)."""
    command = [sys.executable, os.path.join(REPO, "launch", "local.py"), "2", "--devices-per-process", "1",
               "--log-dir", str(log_dir), "--", sys.executable, "-m", "clip_jax.train",
               f"--config={REPO}/tests/train_config.py"]
    return subprocess.Popen(command, env={**os.environ, "CLIP_JAX_TEST_CONFIG": config.to_json()}, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.subprocess
@pytest.mark.slow
def test_ctrl_c_to_a_local_launch_stops_both_ranks_with_a_checkpoint_and_the_run_resumes(shard_data, tmp_path):
    config = config_for(shard_data, tmp_path, epochs=2, save_every_steps=0, resume="latest")
    total = 2 * 256 // (8 * 2)  # epochs x samples / (8 per device x 2 devices)
    launcher = local_launch_run(config, tmp_path / "first")
    try:
        wait_for_a_logged_step([launcher], tmp_path)
        os.killpg(launcher.pid, signal.SIGINT)
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    rank_1 = (tmp_path / "first" / "rank-1.log").read_text()
    assert launcher.returncode == 0, output + "\n\n" + rank_1
    stops = re.findall(r"^SIGINT: saved checkpoint (\d+) in .*; exiting\. Continue with --config.resume=latest$",
                       output, re.M)
    assert len(stops) == 1, output
    stopped = int(stops[0])
    assert stopped % train_lib.STOP_CHECK_EVERY_STEPS == 0 and 0 < stopped < total, output
    assert not NOT_CLEAN.search(output + rank_1), output + "\n\n" + rank_1
    assert saved_steps(tmp_path / "run" / "checkpoints") == [stopped]

    resumed = local_launch_run(config, tmp_path / "resumed")
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    assert f"resumed {tmp_path / 'run' / 'checkpoints'}/{stopped} " in output, output
    assert sorted(losses(tmp_path / "run")) == list(range(1, total + 1))
    assert total in saved_steps(tmp_path / "run" / "checkpoints")


@pytest.mark.subprocess
@pytest.mark.slow
def test_resuming_on_another_process_count_stops_at_the_data_position_it_cannot_carry(two_process_run, tmp_path):
    # A checkpoint of the per-process layout (before data streams: its record names none): each process saved its
    # own data-iterator position (process_R-of-2.json); one process reads other shards in another order, so there
    # is no position to restore and the trainer refuses rather than guess.
    config, run_dir, _ = two_process_run
    older = tmp_path / "older" / "checkpoints"
    shutil.copytree(run_dir / "checkpoints" / "2", older / "2")
    meta_file = older / "2" / "meta" / "metadata"
    meta_file.write_text(json.dumps({k: v for k, v in json.loads(meta_file.read_text()).items()
                                     if k not in ("data_streams", "epoch_steps")}))
    other = config.copy_and_resolve_references()
    other.unlock()
    other.resume, other.name, other.logs = str(older / "2"), "other", str(tmp_path)
    with pytest.raises(ValueError) as refused:
        train_lib.Trainer(other)
    message = str(refused.value)
    assert f"checkpoint {older}/2 was saved by 2 processes x 0 data workers" in message
    assert "this run has 1 process x 0 data workers" in message
    assert "--config.resume_data=allow_reseed" in message
    assert not (tmp_path / "other").exists()  # refused before anything was built or written


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_saved_process_count_is_read_from_the_meta_and_else_from_the_data_iterator_files(two_process_run):
    _, run_dir, _ = two_process_run
    directory = str(run_dir / "checkpoints")
    meta, files = read_meta(directory, STEPS), data_iter_files(directory, STEPS)
    assert (meta.process_count, meta.data_workers) == (2, 0)
    assert saved_process_count(meta, files) == 2
    older = CheckpointMeta.from_json({"step": STEPS, "model": "tiny"})  # from before the field
    assert older.process_count is None
    assert saved_process_count(older, files) == 2  # Grain's file names tell
    assert saved_process_count(dataclasses.replace(older, process_count=3), []) == 3
    assert saved_process_count(older, [f"process_{r}-of-4.json" for r in range(4)] + ["other.json"]) == 4
    assert saved_process_count(None, []) is None
    with pytest.raises(ValueError, match="several process counts"):
        saved_process_count(older, ["process_0-of-1.json", "process_0-of-2.json"])
    assert read_meta(directory, 999) is None


def test_the_data_resume_plan(shard_data, tmp_path):
    config = config_for(shard_data, tmp_path)
    plan = lambda saved, processes, **fields: run_setup.data_resume_plan(  # noqa: E731
        config, CheckpointMeta.from_json({"step": 6, **fields}), saved, where="CKPT", step=6,
        process_count=processes)
    # Same layout: the saved position, with the data seed it was saved under (a run reseeded earlier keeps it).
    assert plan(2, 2, process_count=2, data_workers=0, data_seed=123) == run_setup.DataResume(True, 123)
    assert plan(None, 2) == run_setup.DataResume(True, config.seed)  # nothing tells: Grain restores or says
    with pytest.raises(ValueError, match="saved by 2 processes x 4 data workers, this run has 2 processes x 0"):
        plan(2, 2, process_count=2, data_workers=4)
    with pytest.raises(ValueError, match=r"CKPT was saved by 2 processes, this run has 1 process: .*allow_reseed"):
        plan(2, 1)
    config.resume_data = "allow_reseed"
    reseeded = plan(2, 1, process_count=2, data_workers=0)
    assert not reseeded.restore
    assert reseeded.seed == run_setup.reseeded_data_seed(config.seed, 6)
    assert "data position not restored" in reseeded.note and "a new pass over all shards" in reseeded.note
    seeds = {run_setup.reseeded_data_seed(s, step) for s in (0, 1) for step in (0, 1, 2, 1000)}
    assert len(seeds) == 8 and not seeds & {0, 1}  # a new stream per (seed, step), never the run's own


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_one_process_checkpoint_continues_in_two_processes_with_reseeded_data(shard_data, one_process, tmp_path):
    mesh, engine = one_process
    config = config_for(shard_data, tmp_path / "one")
    train_lib.train(config)  # this process: 1 x 8 devices, checkpoints 2 and 4
    saved = tmp_path / "one" / "run" / "checkpoints"
    assert read_meta(str(saved), 2).process_count == 1

    resumed = config_for(shard_data, tmp_path / "two", resume=str(saved / "2"), resume_data="allow_reseed")
    t0 = time.perf_counter()
    processes = start_ranks(resumed, 2, 4)
    outputs = [p.communicate(timeout=400)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], "\n\n".join(outputs)
    print(f"2 processes x 4 devices resumed from 1 process, {STEPS - 2} steps: {time.perf_counter() - t0:.1f} s")
    assert "data position not restored: checkpoint" in outputs[0]
    assert "saved by 1 process x 0 data workers, this run has 2 processes x 0 data workers" in outputs[0]
    got = losses(tmp_path / "two" / "run")
    assert sorted(got) == [3, 4]

    # Here: the same checkpoint, then the batches that 2 processes' iterators give under the reseeded data seed.
    seed = run_setup.reseeded_data_seed(config.seed, 2)
    state, _ = restored(saved, 2, engine.abstract_state)
    _, expected = run_steps(engine, mesh, state, global_batches(config, 2, seed=seed), STEPS - 2)
    np.testing.assert_allclose([got[3], got[4]], expected, rtol=1e-5)
    meta = read_meta(str(tmp_path / "two" / "run" / "checkpoints"), STEPS)
    assert (meta.step, meta.process_count, meta.data_seed) == (STEPS, 2, seed)

    # The new stream does not replay the run's start: its first batch is neither the run's first nor what two
    # processes would have read first under the run's own seed.
    first = next(global_batches(config, 2, seed=seed))["tokens"]
    assert not np.array_equal(first, next(global_batches(config, 1))["tokens"])
    assert not np.array_equal(first, next(global_batches(config, 2))["tokens"])
