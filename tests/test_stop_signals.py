"""Ctrl-C (SIGINT to the whole process group) at chosen moments of a run: one line, exit 130 before there is
anything to save and 0 once a checkpoint holds the stop, no traceback from the trainer or its data workers, no
leaked shared memory, and a resumed run equal to an uninterrupted one. The full sweep over six moments:
benchmarks/interrupt_sweep.py."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from trainer_run import losses, tiny_config
from xla_flags import xla_flags

from clip_jax.training import trainer as train_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_CLEAN = re.compile(r"Traceback|KeyboardInterrupt|Segmentation|leaked shared_memory|terminated unexpectedly")


@pytest.fixture(scope="module")
def shards(fashion_mnist_shards):
    return fashion_mnist_shards(1024)


def stop_config(shards, logs, **overrides):
    """2 epochs of 8 steps of 64 with one data worker, a checkpoint every 4 steps, a zero-shot evaluation on 64
    demo images at the end of each epoch."""
    return tiny_config(shards, logs, train_num_samples=512, epochs=2, workers=1, save_every_steps=4,
                       zeroshot_data="demo", zeroshot_samples=64, zeroshot_frequency=1, **overrides)


def launch(config, env=None) -> subprocess.Popen:
    """The trainer in a process group of its own (with its data workers), as a terminal runs a command."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu",
           "CLIP_JAX_TEST_CONFIG": config.to_json(), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "clip_jax.train", f"--config={REPO}/tests/train_config.py"],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def ctrl_c(process) -> None:
    os.killpg(process.pid, signal.SIGINT)


def wait_for_file(path, process, timeout=240) -> None:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert process.poll() is None, f"trainer exited early ({process.returncode}):\n{process.stdout.read()}"
        assert time.time() < deadline, f"{path} not created in {timeout} s"
        time.sleep(0.05)


def signal_mask(pid: int, field: str) -> int:
    """The `SigIgn`/`SigBlk`/... bit mask of process `pid` (Linux's /proc/PID/status): bit n-1 is signal n."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith(field + ":"))


@pytest.mark.subprocess
def test_data_workers_ignore_stop_signals_and_free_their_shared_memory(shards, tmp_path):
    # A data worker gets SIGINT and SIGTERM directly (kill, not the group): it goes on serving batches, and the
    # closed iterator leaves no shared memory to the resource tracker.
    script = tmp_path / "iterate.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing, os, signal
        from clip_jax import data
        from clip_jax.run_config import default_config

        if __name__ == "__main__":
            c = default_config()
            c.train_data, c.train_num_samples, c.dataset_resampled, c.workers = {shards[0]!r}, 1024, False, 1
            cfg = data.TrainDataConfig.from_run_config(c)
            it = data.build_train_iterator(cfg, global_batch_size=64, image_size=28, mean=(0.5,) * 3,
                                           std=(0.5,) * 3, context_length=16)
            next(it)
            (worker,) = multiprocessing.active_children()
            os.kill(worker.pid, signal.SIGINT)
            os.kill(worker.pid, signal.SIGTERM)
            for _ in range(6):
                batch = next(it)
            print("worker", worker.pid, "alive", worker.is_alive(), "rows", len(batch["images"]))
            del batch  # a batch still held at exit keeps its shared memory: the trainer holds none
            it.close()
            print("closed, worker alive", worker.is_alive())
            del it  # as the trainer drops it: Grain's own iterators cannot close again as the interpreter exits
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"worker \d+ alive True rows 64\nclosed, worker alive False", done.stdout), done.stdout
    assert not NOT_CLEAN.search(done.stderr), done.stderr


@pytest.mark.subprocess
def test_the_data_workers_are_started_deaf_to_stop_signals(shards):
    # What a worker inherits while it imports, before its own init function runs: both signals blocked.
    from clip_jax.runtime import stop_signals

    with stop_signals.held_back():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        blocked = signal_mask(child.pid, "SigBlk")
    finally:
        child.kill()
        child.wait()
    assert blocked & (1 << (signal.SIGINT - 1)) and blocked & (1 << (signal.SIGTERM - 1)), hex(blocked)
    mine = signal_mask(os.getpid(), "SigBlk")  # this thread's mask is back as it was
    assert not mine & (1 << (signal.SIGINT - 1)), hex(mine)


@pytest.mark.subprocess
def test_a_data_worker_hit_by_ctrl_c_while_it_starts_keeps_serving(shards, tmp_path):
    # Ctrl-C reaches a worker while its fresh interpreter still imports (seconds), in a process that has not yet
    # started multiprocessing's resource tracker (whose start lets both signals through in the thread starting it).
    script = tmp_path / "start.py"
    script.write_text(textwrap.dedent(f"""
        import glob, os, signal, threading, time
        from clip_jax import data
        from clip_jax.run_config import default_config

        def children():  # of any of this process's threads (Grain starts its worker from a thread of its own)
            found = 0
            for task in glob.glob(f"/proc/{{os.getpid()}}/task/*"):
                try:
                    found += len(open(task + "/children").read().split())
                except OSError:  # a thread that ended
                    pass
            return found

        def ctrl_c_while_the_worker_starts():
            deadline = time.time() + 60
            while children() < 2 and time.time() < deadline:  # the resource tracker, then the worker
                time.sleep(0.005)
            for _ in range(20):
                os.killpg(0, signal.SIGINT)
                time.sleep(0.05)

        if __name__ == "__main__":
            got = []
            signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
            c = default_config()
            c.train_data, c.train_num_samples, c.dataset_resampled, c.workers = {shards[0]!r}, 1024, False, 1
            cfg = data.TrainDataConfig.from_run_config(c)
            it = data.build_train_iterator(cfg, global_batch_size=64, image_size=28, mean=(0.5,) * 3,
                                           std=(0.5,) * 3, context_length=16)
            sender = threading.Thread(target=ctrl_c_while_the_worker_starts, daemon=True)
            sender.start()
            rows = len(next(it)["images"])
            sender.join()
            rows += len(next(it)["images"])
            print("rows", rows, "signals", len(got))
            it.close()
            del it
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, start_new_session=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^rows 128 signals [1-9]\d*$", done.stdout, re.M), done.stdout  # the main process heard them
    assert not NOT_CLEAN.search(done.stderr), done.stderr


@pytest.mark.subprocess
@pytest.mark.slow
def test_ctrl_c_while_the_trainer_imports_exits_130_in_one_line(shards, tmp_path):
    process = launch(stop_config(shards, tmp_path))
    time.sleep(0.5)  # the trainer's imports take seconds
    ctrl_c(process)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 130, output
    assert re.fullmatch(r"SIGINT [a-z ]+: stopped before the first step, nothing saved\n", output), output
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.fixture(scope="module")
def uninterrupted(shards, tmp_path_factory):
    logs = tmp_path_factory.mktemp("uninterrupted")
    train_lib.train(stop_config(shards, logs))
    return losses(logs / "run"), evaluations(logs / "run")


def evaluations(run_dir) -> list[dict]:
    """metrics.jsonl's zero-shot records, in order (without the `replay` mark a record of the step a run resumed at
    carries: the outputs held that step's loss)."""
    with open(run_dir / "metrics.jsonl") as f:
        return [{k: v for k, v in r.items() if k != "replay"} for r in map(json.loads, f) if "zeroshot_top1" in r]


def ctrl_c_at(moment: str, config, tmp_path) -> str:
    """Ctrl-C to the trainer once it reaches `moment` (the test seam of tests/train_config.py: "save" or
    "evaluation"); its output, after it exited 0 without a traceback."""
    pause = tmp_path / "paused"
    process = launch(config, {"CLIP_JAX_TEST_PAUSE_AT": moment, "CLIP_JAX_TEST_PAUSE_FILE": str(pause)})
    wait_for_file(pause, process)
    ctrl_c(process)
    pause.unlink()
    output, _ = process.communicate(timeout=180)
    assert process.returncode == 0, output
    assert not NOT_CLEAN.search(output), output
    return output


@pytest.mark.subprocess
@pytest.mark.slow
def test_ctrl_c_during_a_save_saves_a_checkpoint_and_the_run_resumes_identically(shards, tmp_path, uninterrupted):
    config = stop_config(shards, tmp_path, resume="latest")
    output = ctrl_c_at("save", config, tmp_path)
    stops = re.findall(r"^SIGINT: saved checkpoint (\d+) in .*; exiting\. Continue with --config.resume=latest$",
                       output, re.M)
    assert len(stops) == 1, output
    stopped_at = int(stops[0])
    assert 4 <= stopped_at < 16  # within a step of the save at step 4 on an idle machine; never the end

    resumed = train_lib.train(config)
    assert resumed["step"] == 16
    got = losses(tmp_path / "run")
    assert sorted(got) == list(range(1, 17))
    np.testing.assert_array_equal([got[s] for s in range(1, 17)], [uninterrupted[0][s] for s in range(1, 17)])
    assert evaluations(tmp_path / "run") == uninterrupted[1]  # at step 8 and 16, once each


@pytest.mark.subprocess
@pytest.mark.slow
def test_ctrl_c_during_an_evaluation_cuts_it_short_and_the_resumed_run_makes_it_first(shards, tmp_path,
                                                                                       uninterrupted):
    config = stop_config(shards, tmp_path, resume="latest")
    output = ctrl_c_at("evaluation", config, tmp_path)
    assert re.search(r"^SIGINT: saved checkpoint 8 in .*; evaluation cut short \(the resumed run makes it\); "
                     r"exiting\. Continue with --config.resume=latest$", output, re.M), output
    assert "zero-shot on" not in output  # not one batch encoded after the signal
    assert evaluations(tmp_path / "run") == []

    resumed = train_lib.train(config)
    assert resumed["step"] == 16
    got = losses(tmp_path / "run")
    np.testing.assert_array_equal([got[s] for s in range(1, 17)], [uninterrupted[0][s] for s in range(1, 17)])
    assert evaluations(tmp_path / "run") == uninterrupted[1]  # step 8's made up first, then step 16's


@pytest.mark.subprocess
@pytest.mark.slow
def test_ctrl_c_while_the_demo_writes_its_shards_stops_between_shards_and_leaves_no_partial_set(shards, tmp_path):
    folder = tmp_path / "new" / "fashion-mnist" / "train"  # named as the demo's own folder
    config = stop_config(shards, tmp_path, train_data=f"{folder}/{{00000..00059}}.tar", make_train_data="fashion-mnist")
    process = launch(config)
    first = process.stdout.readline()  # the writer's note: where, how many MB
    assert re.fullmatch(r"make_train_data='fashion-mnist': .* does not exist yet; writing the 60,000 Fashion-MNIST "
                        r"training images there as 60 shards \(about \d+ MB\)\n", first), first
    ctrl_c(process)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 130, first + output
    assert output == ("SIGINT while the data shards were written (the unfinished set was removed): stopped before "
                      "the first step, nothing saved\n")
    assert not list(folder.glob("*.tar")) and not list(folder.glob("*_stats.json"))
    assert not (tmp_path / "new").exists()  # the folders the writer made went with its unfinished set


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("moment, line", [("compile", "run "), ("first step", "step 1/")])
def test_ctrl_c_while_the_first_step_compiles_or_right_after_it_stops_in_one_line(shards, tmp_path, moment, line):
    """Ctrl-C as soon as the trainer prints `line` (the "run ..." line comes just before the first step compiles;
    step 1's log line just after it ran): exit 130 with nothing saved when the stop was seen before the first
    step, else 0 with the checkpoint that holds it."""
    process = launch(stop_config(shards, tmp_path))
    seen = []
    for printed in process.stdout:
        seen.append(printed)
        if printed.startswith(line):
            ctrl_c(process)
            break
    output = "".join(seen) + process.communicate(timeout=180)[0]
    assert not NOT_CLEAN.search(output), output
    stopped = output.splitlines()[-1]
    if process.returncode == 130:
        assert moment == "compile" and stopped == "SIGINT before the first step: nothing saved", output
        assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(tmp_path / "run" / "checkpoints")
    else:
        assert process.returncode == 0, output
        step = int(re.fullmatch(r"SIGINT: saved checkpoint (\d+) in .*; exiting\. Continue with "
                                r"--config.resume=latest", stopped).group(1))
        assert 1 <= step < 8 and os.listdir(tmp_path / "run" / "checkpoints") == [str(step)], output
