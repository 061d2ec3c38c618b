"""The trainer end to end on 8 simulated devices and the demo data: learning, resumption, faults, bad configs, and
what its step loop reads between steps."""

import dataclasses
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from trainer_run import losses, nan_after, tiny_config
from xla_flags import xla_flags

from clip_jax.evaluation import zeroshot
from clip_jax.ops import run_outputs
from clip_jax.ops.writers import MetricsWindow
from clip_jax.runtime.mesh import batch_sharding, create_mesh, replicated
from clip_jax.training import pretraining
from clip_jax.training import trainer as train_lib
from clip_jax.training.config_checks import check_config
from clip_jax.training.step_reads import local_values

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def shards(fashion_mnist_shards):
    """2,048 Fashion-MNIST training images in 8 shards."""
    return fashion_mnist_shards(2048)


def saved_steps(run_dir) -> list[int]:
    folder = os.path.join(run_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(folder) if n.isdigit())


def launch(config, *extra) -> subprocess.Popen:
    """The trainer as its own process; tests/train_config.py hands it `config` through the environment."""
    args = [sys.executable, "-m", "clip_jax.train", f"--config={REPO}/tests/train_config.py"]
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu",
           "CLIP_JAX_TEST_CONFIG": config.to_json()}
    return subprocess.Popen(args + list(extra), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO)


def wait_for_step(run_dir, step, process, timeout=240, checkpoint=None):
    """Until the trainer `process` has logged step `step` and, when given, completed checkpoint `checkpoint` (an
    asynchronous save may complete several steps after its own)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = os.path.join(run_dir, "metrics.jsonl")
        logged = os.path.exists(path) and losses(run_dir) and max(losses(run_dir)) >= step
        saved = checkpoint is None or (os.path.isdir(os.path.join(run_dir, "checkpoints"))
                                       and checkpoint in saved_steps(run_dir))
        if logged and saved:
            return
        if process.poll() is not None:
            raise AssertionError(f"trainer exited early ({process.returncode}):\n{process.stdout.read()}")
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


@pytest.mark.slow
def test_a_short_run_learns_and_saves(shards, tmp_path):
    result = train_lib.train(tiny_config(shards, tmp_path, epochs=3, zeroshot_data="demo", zeroshot_samples=512,
                                         zeroshot_frequency=3))  # evaluated once, at the end, as asserted
    run_dir = tmp_path / "run"
    per_step = losses(run_dir)
    assert sorted(per_step) == list(range(1, 97))
    first, last = np.mean([per_step[s] for s in range(1, 9)]), np.mean([per_step[s] for s in range(89, 97)])
    assert first > np.log(64) - 0.1  # chance level for 64 pairs
    assert last < first - 0.6, (first, last)
    assert saved_steps(run_dir)[-1] == 96
    assert result["zeroshot_top1"] > 0.3  # 10 classes: chance is 0.1
    assert json.loads((run_dir / "config.json").read_text())["lr"] == 3e-3

    # The eval script reads the run directory and gets the trainer's number on the same images.
    output = tmp_path / "zeroshot.json"
    assert zeroshot.main(["--model", shards[1], "--checkpoint", str(run_dir), "--demo", "--limit", "512",
                          "--output", str(output)]) == 0
    script_top1 = [m["top1"] for m in json.loads(output.read_text())["results"].values() if "top1" in m]
    assert script_top1 == [pytest.approx(result["zeroshot_top1"], abs=1e-9)]


@pytest.mark.slow
def test_the_host_reads_each_loss_after_dispatching_the_next_step(shards, tmp_path, monkeypatch):
    # 8 steps of 64, a log line every 4: between logs the devices always have the next step queued while the
    # host waits for a loss; at a log (or save) step the host catches up before reporting.
    trainer = train_lib.Trainer(tiny_config(shards, tmp_path, train_num_samples=512, log_every_n_steps=4,
                                            save_every_steps=0))
    events, step_fn, observe = [], trainer.engine.update, trainer.observe

    def dispatch(state, batch):
        events.append(f"dispatch {trainer.step + 1}")
        return step_fn(state, batch)

    def read(step, scalars):
        events.append(f"read {step}")
        return observe(step, scalars)

    trainer.engine = dataclasses.replace(trainer.engine, update=dispatch)
    monkeypatch.setattr(trainer, "observe", read)
    with trainer:
        trainer.train()
    assert events == ["dispatch 1", "dispatch 2", "read 1", "dispatch 3", "read 2", "dispatch 4", "read 3",
                      "read 4", "dispatch 5", "dispatch 6", "read 5", "dispatch 7", "read 6", "dispatch 8",
                      "read 7", "read 8"]
    assert sorted(losses(tmp_path / "run")) == [4, 8]


# The host side of one program's launch, once per execution (its per-device parts are "[i] CommonPjRt...").
PROGRAM_LAUNCH = re.compile(r"^CommonPjRtLoadedExecutable::Execute \((.+)\)$")


def programs_launched(trace_dir) -> list[str]:
    """The programs a profiler trace saw launched, by name, in launch order."""
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    profile = jax.profiler.ProfileData.from_file(path)
    launches = sorted((event.start_ns, match.group(1)) for plane in profile.planes for line in plane.lines
                      for event in line.events if (match := PROGRAM_LAUNCH.match(event.name)))
    return [name for _, name in launches]


@pytest.mark.slow
def test_a_step_runs_no_program_but_the_train_step_on_logging_steps_too(shards, tmp_path):
    # 7 steps of 64, a log line (with spike telemetry) at 3 and 6, and at 7, the last: traced from the dispatch of
    # step 2 (after compilation) to the final save, each program launched is attributed to the step dispatched
    # before it. Reading a metric through a jnp operation (a device copy, a merge on device) would run a program:
    # in a multi-process run one across every process, waiting for them all, on every step.
    config = tiny_config(shards, tmp_path, train_num_samples=448, log_every_n_steps=3, save_every_steps=0)
    trainer = train_lib.Trainer(config)
    step_fn, save = trainer.engine.update, trainer.save
    trace_dir, options = str(tmp_path / "trace"), jax.profiler.ProfileOptions()
    options.python_tracer_level, options.enable_hlo_proto = 0, False
    tracing = False

    def dispatch(state, batch):
        nonlocal tracing
        if trainer.step == 1:
            jax.profiler.start_trace(trace_dir, profiler_options=options)
            tracing = True
        return step_fn(state, batch)

    def stop_tracing_then_save(force=False):  # the first save follows the last step's log line
        nonlocal tracing
        if tracing:
            jax.profiler.stop_trace()
            tracing = False
        save(force=force)

    trainer.engine = dataclasses.replace(trainer.engine, update=dispatch)
    trainer.save = stop_tracing_then_save
    try:
        with trainer:
            trainer.train()
    finally:
        if tracing:  # the run failed part way: the next test may trace
            jax.profiler.stop_trace()
    step_program = f"jit_{step_fn.__name__}"
    per_step, step = {}, 1  # step -> the programs launched from its dispatch to the next one's
    for name in programs_launched(trace_dir):
        if name == step_program:
            step += 1
        per_step.setdefault(step, []).append(name)
    assert per_step == {step: [step_program] for step in range(2, 8)}
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [3, 6, 7]
    assert [any(k.startswith("telemetry/") for k in r) for r in logged] == [True, True, False]


def read_step(loss, learning_rate, finite=True) -> dict:
    """One step's scalars as `StepReads` hands them to the window."""
    return {"loss": np.float32(loss), "accuracy": np.float32(loss / 10), "logit_scale": np.float32(14),
            "grad_norm": np.float32(2 * loss), "learning_rate": np.float32(learning_rate), "finite": np.bool_(finite)}


def test_a_log_window_averages_its_finite_steps_and_keeps_their_last_learning_rate():
    window = MetricsWindow()
    assert window.scalars() == {}
    window.add(read_step(np.nan, 1e-3, finite=False))
    assert window.scalars() == {}  # nothing to log
    for loss, learning_rate, finite in [(3.0, 2e-3, True), (np.nan, 3e-3, False), (2.0, 4e-3, True)]:
        window.add(read_step(loss, learning_rate, finite))
    assert window.scalars() == pytest.approx(
        {"loss": 2.5, "accuracy": 0.25, "logit_scale": 14.0, "grad_norm": 5.0, "learning_rate": 4e-3})
    assert list(window.scalars()) == ["loss", "accuracy", "logit_scale", "grad_norm", "learning_rate"]


def test_step_metrics_are_read_from_a_local_replica_and_must_be_replicated():
    mesh = create_mesh()
    assert local_values({"loss": jax.device_put(np.float32(2.5), replicated(mesh))}) == {"loss": 2.5}
    with pytest.raises(ValueError, match="not replicated"):
        local_values({"loss": jax.device_put(np.arange(8.0), batch_sharding(mesh))})


@pytest.mark.slow
def test_a_stop_signal_with_an_unread_bad_step_rolls_back_once_then_stops(shards, tmp_path, monkeypatch):
    # The stop signal arrives while step 6 (NaN inputs, nan_patience 1) is dispatched but unread: the stop check
    # reads it first, rolls back to checkpoint 4 once, and stops there.
    config = tiny_config(shards, tmp_path, log_every_n_steps=100, save_every_steps=4, nan_patience=1)
    trainer = train_lib.Trainer(config, edit_batch=nan_after({5}))

    class StopAtStep6:
        received = "SIGTERM"

        def __init__(self):
            self.seen = False

        def agreed(self):
            self.seen = self.seen or trainer.step == 6
            return self.seen

        def restore(self):
            pass

    monkeypatch.setattr(train_lib, "StopSignal", StopAtStep6)
    with trainer:
        assert trainer.train() == {"stopped_at": 4}
    assert trainer.rollbacks == 1 and trainer.skipped_updates == 1


HALF_EPOCH = {"train_num_samples": 1024}  # 16 steps of 64


@pytest.fixture(scope="module")
def uninterrupted_logs(shards, tmp_path_factory):
    """The logs folder of a whole run of `tiny_config(shards, logs, **HALF_EPOCH)`: 16 steps, checkpoints every 8.
    Read only."""
    logs = tmp_path_factory.mktemp("reference")
    train_lib.train(tiny_config(shards, logs, **HALF_EPOCH))
    return logs


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_logs):
    return losses(uninterrupted_logs / "run")


@pytest.mark.subprocess
@pytest.mark.slow
def test_kill_9_then_resume_continues_exactly(shards, tmp_path, uninterrupted):
    config = tiny_config(shards, tmp_path, resume="latest", **HALF_EPOCH)
    process = launch(config)
    wait_for_step(tmp_path / "run", 11, process, checkpoint=8)
    process.kill()  # SIGKILL: no chance to save
    process.wait()
    assert 8 in saved_steps(tmp_path / "run")
    # A field no config has, saved by a run before misspelled fields were refused, is named once on resume.
    saved = tmp_path / "run" / "config.json"
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "batchsize": 128}))
    resumed = launch(config)
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    assert "resumed" in output
    assert f"{saved} set batchsize, which is no config field (did you mean 'batch_size'?)" in output
    assert "batchsize" not in json.loads(saved.read_text())
    got = losses(tmp_path / "run")
    assert sorted(got) == list(range(1, 17))
    np.testing.assert_allclose([got[s] for s in range(1, 17)], [uninterrupted[s] for s in range(1, 17)], rtol=1e-5)


@pytest.mark.subprocess
@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly_then_resumes_under_another_precision(shards, tmp_path):
    config = tiny_config(shards, tmp_path, resume="latest", precision="pure_bf16", save_every_steps=0)
    process = launch(config)
    wait_for_step(tmp_path / "run", 5, process)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert "SIGTERM: saved checkpoint" in output
    stopped_at = saved_steps(tmp_path / "run")[-1]
    assert 5 <= stopped_at < 32

    # Resume in fp32: the bf16 parameters load into fp32 and training carries on to the end.
    result = train_lib.train(tiny_config(shards, tmp_path, resume="latest", precision="fp32"))
    assert result["step"] == 32
    got = losses(tmp_path / "run")
    assert all(np.isfinite(got[s]) for s in range(stopped_at + 1, 33))
    meta = json.loads((tmp_path / "run" / "checkpoints" / "32" / "meta" / "metadata").read_text())
    assert meta["precision"] == "fp32"


@pytest.mark.slow
def test_non_finite_steps_are_skipped_then_rolled_back_to_fp32(shards, tmp_path):
    config = tiny_config(shards, tmp_path, precision="bf16", nan_patience=3, on_instability="rollback_fp32")
    with train_lib.Trainer(config, edit_batch=nan_after({13, 14, 15})) as trainer:
        trainer.train()
    assert trainer.skipped_updates == 3
    assert trainer.rollbacks == 1
    assert trainer.engine.spec.precision == "fp32"
    assert trainer.step == 32
    assert all(np.isfinite(v) for v in losses(tmp_path / "run").values())


def test_a_trainer_whose_set_up_fails_closes_what_it_had_opened(shards, tmp_path, monkeypatch):
    closed, build = [], pretraining.data.build_train_iterator

    def build_recording_close(*args, **kwargs):
        iterator = build(*args, **kwargs)
        close = iterator.close
        iterator.close = lambda: (closed.append("data iterator"), close())
        return iterator

    class Checkpoints(train_lib.RunCheckpoints):
        def close(self):
            closed.append("checkpoints")
            super().close()

    def unwritable(logdir):
        raise OSError(f"{logdir}: read-only file system")

    monkeypatch.setattr(pretraining.data, "build_train_iterator", build_recording_close)
    monkeypatch.setattr(train_lib, "RunCheckpoints", Checkpoints)
    monkeypatch.setattr(run_outputs, "TensorBoardWriter", unwritable)  # the last thing the set-up opens
    with pytest.raises(OSError, match="read-only file system"):
        train_lib.Trainer(tiny_config(shards, tmp_path, report_to="tensorboard"))
    assert sorted(closed) == ["checkpoints", "data iterator"]


@pytest.mark.slow
def test_a_single_skipped_step_does_not_roll_back(shards, tmp_path):
    # half an epoch: six steps after the bad one, twice the patience (and the program of `uninterrupted`'s run)
    config = tiny_config(shards, tmp_path, nan_patience=3, **HALF_EPOCH)
    with train_lib.Trainer(config, edit_batch=nan_after({10})) as trainer:
        trainer.train()
    assert trainer.skipped_updates == 1 and trainer.rollbacks == 0


@pytest.mark.slow
def test_a_loss_spike_is_caught(shards, tmp_path):
    # Without learning (lr 0) the loss only wanders from batch to batch; with a factor barely above 1 the first
    # loss above the recent mean counts as a spike.
    config = tiny_config(shards, tmp_path, loss_spike_factor=1.0001, on_instability="stop", lr=0.0)
    with pytest.raises(train_lib.TrainingUnstable, match="loss spike"):
        train_lib.train(config)


@pytest.mark.parametrize("overrides, message", [
    ({"train_data": ""}, "train_data is empty"),
    ({"precision": "amp"}, "precision='amp': choose one of .*; did you mean 'fp16'"),
    ({"batch_size": 6, "accum_freq": 4}, "not divisible by accum_freq=4"),
    ({"resume": "/nonexistent/run"}, "resume='/nonexistent/run' does not exist"),
    ({"resume_data": "fresh"}, "resume_data='fresh': choose one of ('exact', 'allow_reseed')"),
    ({"grad_reduce_dtype": "bf16"}, "grad_reduce_dtype='bf16': choose one of ('float32', 'bfloat16')"),
    ({"residual_dtype": "fp32"}, "residual_dtype='fp32': choose one of ('auto', 'compute', 'float32')"),
    ({"remat_policy": "dots"}, "remat_policy='dots': choose one of ('none', "),
    ({"zeroshot_data": "/nonexistent/val"}, "zeroshot_data='/nonexistent/val'"),
    ({"loss_scale_init": 0.0}, "loss_scale_init=0.0 must be positive (fp16's first loss scale"),
    ({"loss_scale_growth_interval": 0}, "loss_scale_growth_interval=0 must be at least 1"),
    ({"on_instability": "rollback_fp16"}, "on_instability='rollback_fp16': choose one of ('rollback', 'rollback_fp32', "
                                          "'rollback_bf16', 'stop')"),
])
def test_bad_configs_fail_before_compiling(overrides, message, tmp_path):
    config = tiny_config(("/data/{000..001}.tar", "ViT-B-32"), tmp_path, **overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_config(config, num_devices=8)


@pytest.mark.subprocess
@pytest.mark.slow
def test_an_unknown_override_is_refused_by_name(tmp_path):
    config = tiny_config(("/data/x.tar", "ViT-B-32"), tmp_path)
    process = launch(config, "--config.lrr=0.1")
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0
    assert "lrr" in output


def test_remat_policy_auto_on_a_cpu_builds_the_step_with_nothing_saveable(shards, tmp_path):
    config = tiny_config(shards, tmp_path, grad_checkpointing=True, remat_policy="auto")
    with train_lib.Trainer(config) as trainer:
        assert trainer.engine.spec.remat_policy == "nothing_saveable"


def test_a_missing_shard_pattern_is_named(shards, tmp_path):
    with pytest.raises(ValueError, match="nowhere"):
        train_lib.Trainer(tiny_config((str(tmp_path / "nowhere-{000..003}.tar"), shards[1]), tmp_path))


def test_loose_jpegs_named_as_shards_are_refused_before_the_step_is_built(shards, tmp_path, monkeypatch):
    from PIL import Image

    (tmp_path / "photos").mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8)).save(tmp_path / "photos" / f"{i:04d}.jpg")

    def compiled(*args, **kwargs):
        raise AssertionError("the step was built")

    monkeypatch.setattr(pretraining, "build_step", compiled)
    config = tiny_config((str(tmp_path / "photos" / "{0000..0002}.jpg"), shards[1]), tmp_path / "logs")
    with pytest.raises(ValueError, match=r"0000\.jpg is not a tar file \(a JPEG image\)"):
        train_lib.Trainer(config)


@pytest.mark.slow
def test_a_fresh_run_refuses_a_run_directory_that_has_checkpoints(shards, uninterrupted_logs):
    saved = saved_steps(uninterrupted_logs / "run")
    assert saved
    with pytest.raises(ValueError, match="already has checkpoints"):
        train_lib.Trainer(tiny_config(shards, uninterrupted_logs))
    assert saved_steps(uninterrupted_logs / "run") == saved


def test_device_count_is_what_the_tests_assume():
    assert jax.device_count() == 8
