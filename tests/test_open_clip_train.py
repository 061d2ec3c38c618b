"""`python -m clip_jax.open_clip_train`: OpenCLIP 3.3's launch line as a clip_jax run. Checked against OpenCLIP's
own parser (`open_clip_train.params`, installed with the test extras): every flag it defines is classified, its
defaults and parsed values are ours, and the reference run's line gives configs/l14_laion2b.py."""

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import threading
from unittest import mock

import pytest
from open_clip_train import params

from clip_jax.interop import open_clip_config, open_clip_flags
from clip_jax.interop.open_clip_flags import FLAGS, MAPPED, NO_OP, REFUSED
from clip_jax.run_config import default_config
from clip_jax.training import open_clip_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The reference run's srun line (CLIP-ViT-L-14-laion2B-s32B-b82K), as OpenCLIP's launch script spells it.
REFERENCE = ["--save-frequency", "1", "--zeroshot-frequency", "1", "--train-data=/data/laion2B-en/{00000..23295}.tar",
             "--train-num-samples=200000000", "--warmup", "10000", "--lr", "1e-3", "--batch-size=224",
             "--epochs=160", "--workers=6", "--model", "ViT-L-14", "--name", "L14-laion2B", "--report-to",
             "tensorboard", "--seed", "0", "--precision", "fp32", "--ddp-static-graph", "--local-loss",
             "--dataset-resampled", "--gather-with-grad", "--grad-checkpointing"]


def open_clip_parser() -> argparse.ArgumentParser:
    """The parser `open_clip_train.params.parse_args` builds (it returns only the namespace)."""
    built = []
    parse = argparse.ArgumentParser.parse_args

    def keep(self, *args, **kwargs):
        built.append(self)
        return parse(self, *args, **kwargs)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", keep):
        params.parse_args([])
    return built[0]


def open_clip_flag_names() -> set[str]:
    return {action.dest for action in open_clip_parser()._actions if action.dest != "help"}


def dry_run(argv, capsys) -> tuple[dict, list[str]]:
    assert open_clip_command.main([*argv, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err.splitlines()


def test_every_open_clip_flag_is_mapped_a_no_op_or_refused():
    names = open_clip_flag_names()
    assert names == set(FLAGS), f"unclassified: {sorted(names - set(FLAGS))}; not OpenCLIP's: {set(FLAGS) - names}"
    assert all(flag.kind in (MAPPED, NO_OP, REFUSED) and flag.why for flag in FLAGS.values())
    fields = set(default_config())
    assert all(flag.field in fields for flag in FLAGS.values() if flag.field)
    named_as_fields = {name for name in names if name in fields}
    assert named_as_fields and all(FLAGS[name].kind == MAPPED for name in named_as_fields)


@pytest.mark.parametrize("argv", [[], REFERENCE, ["--model", "RN50", "--aug-cfg", "scale=(0.5,1.0)", "use_timm=True",
                                                  "--image-mean", "0.5", "--force-image-size", "336",
                                                  "--batch-size", "32", "--accum-freq", "4", "--precision", "amp"]])
def test_our_parser_reads_every_flag_as_open_clips_does(argv):
    ours = vars(open_clip_flags.parse(argv))
    theirs = vars(params.parse_args(argv))
    assert ours == theirs
    assert open_clip_config.run_config(open_clip_flags.parse(argv)) == \
        open_clip_config.run_config(argparse.Namespace(**theirs))


def test_the_reference_line_gives_the_l14_config(capsys, tmp_path, monkeypatch):
    from configs import l14_laion2b

    monkeypatch.chdir(tmp_path)
    config, notes = dry_run(REFERENCE, capsys)
    expected = json.loads(l14_laion2b.get_config().to_json())
    given = {arg.lstrip("-").split("=")[0].replace("-", "_") for arg in REFERENCE if arg.startswith("--")}
    fields = {FLAGS[name].field for name in given if FLAGS[name].kind == MAPPED} - {"name", "precision"}
    assert len(fields) == 14
    assert {field: config[field] for field in fields} == {field: expected[field] for field in fields}
    assert (config["name"], config["precision"]) == ("L14-laion2B", "fp32")
    assert notes == ["note: --ddp-static-graph has no effect: XLA compiles one static program",
                     f"note: --local-loss --gather-with-grad have no effect: {open_clip_flags.GLOBAL_LOSS}",
                     "note: --workers 6 per GPU x 1 device(s) per process = workers 6 (assumed: one process per GPU)"]


def test_flags_left_out_take_open_clips_defaults(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config, _ = dry_run(["--train-data", "/data/{0..9}.tar", "--batch-size", "32", "--accum-freq", "4"], capsys)
    assert (config["model"], config["beta2"], config["eps"], config["precision"]) == ("RN50", 0.999, 1e-8, "fp16")
    assert (config["dataset_resampled"], config["grad_checkpointing"], config["report_to"]) == (False, False, "none")
    assert (config["zeroshot_frequency"], config["batch_size"], config["keep"]) == (2, 128, 32)
    assert config["name"].endswith("-model_RN50-lr_0.0005-b_32-j_4-p_amp")  # OpenCLIP's name: date first


@pytest.mark.parametrize("argv, line", [
    (["--horovod"], "--horovod is refused: the processes join"),
    (["--local-loss"], "--local-loss without --gather-with-grad is refused: its gradients differ"),
    (["--precision", "fp16"], "--precision fp16: OpenCLIP's pure float16 has no clip_jax policy"),
    (["--pretrained", "laion2b_s32b_b82k"], "--pretrained laion2b_s32b_b82k is an OpenCLIP hub tag"),
    (["--lr-scheduler", "const"], "--lr-scheduler is refused: clip_jax's schedule is cosine"),
    (["--batch-sise", "8"], "--batch-sise: no such OpenCLIP flag; did you mean --batch-size?"),
    (["--resume", "epoch_3.pt"], "--resume epoch_3.pt is an OpenCLIP checkpoint"),
])
def test_what_clip_jax_cannot_do_is_one_line_naming_the_flag(argv, line, capsys):
    assert open_clip_command.main([*argv, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith(f"error: {line}")


def test_precision_names_follow_open_clips_meaning(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for given, policy in (("amp", "fp16"), ("amp_bf16", "bf16"), ("amp_bfloat16", "bf16"), ("pure_bf16", "pure_bf16"),
                          ("fp32", "fp32")):
        assert dry_run(["--precision", given], capsys)[0]["precision"] == policy
    config, notes = dry_run(["--precision", "bf16"], capsys)
    assert config["precision"] == "pure_bf16" and "keeps those float32" in notes[0]


def test_an_existing_run_is_refused_unless_resumed(capsys, tmp_path):
    (tmp_path / "run").mkdir()
    argv = ["--logs", str(tmp_path), "--name", "run", "--dry-run"]
    assert open_clip_command.main(argv) == 2
    assert "already exists: give another --name, or --resume latest" in capsys.readouterr().err
    assert open_clip_command.main([*argv, "--resume", "latest"]) == 0


def test_a_config_reads_back_from_its_open_clip_line(tmp_path):
    from configs import l14_laion2b

    weights = tmp_path / "open_clip_model.safetensors"
    weights.write_bytes(b"")
    l14 = l14_laion2b.get_config()
    other = l14_laion2b.get_config()
    other.update(accum_freq=4, batch_size=448, loss="siglip", precision="pure_bf16", keep=1, report_to="none",
                 force_image_size=336, image_mean=(0.5, 0.4, 0.3), pretrained=str(weights), lock_image=True,
                 lock_image_unlocked_groups=2, grad_clip_norm=1.0, force_patch_dropout=0.5, dataset_type="csv")
    other.aug_cfg.scale = (0.5, 1.0)
    for config in (l14, other):
        flags, unflagged = open_clip_config.command_line(config)
        back = open_clip_config.run_config(open_clip_flags.parse(flags))
        fields = open_clip_config.flag_fields(config)
        assert {field: back[field] for field in fields} == {field: config[field] for field in fields}
        assert unflagged == [f"{key}={config[key]!r}" for key in config if key not in fields
                             and config[key] != default_config()[key]]
    assert "on_instability='rollback_fp32'" in open_clip_config.command_line(l14)[1]


@pytest.mark.subprocess
def test_the_command_prints_one_json_object_and_says_no_ops_on_stderr(tmp_path):
    run = subprocess.run([sys.executable, "-m", "clip_jax.open_clip_train", *REFERENCE, "--dry-run"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["batch_size"] == 224
    assert all(line.startswith("note: ") for line in run.stderr.splitlines())


@pytest.mark.subprocess
def test_the_open_clip_launch_script_runs_the_reference_line():
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "CLIP_JAX_"))}
    env.update(SLURM_JOB_NUM_NODES="1", SLURM_JOB_ID="1", SLURM_JOB_NAME="l14", SLURM_SUBMIT_DIR=REPO)
    run = subprocess.run(["bash", os.path.join(REPO, "launch", "l14_laion2b_open_clip.sbatch"), "--dry-run"],
                         env=env, capture_output=True, text=True, cwd="/")
    assert run.returncode == 0, run.stderr
    program, flags = run.stdout.strip().splitlines()[-1].split("cmd: python ", 1)[1].split(" ", 2)[1:]
    assert program == "clip_jax.open_clip_train" and flags.split() == [*REFERENCE, "--resume", "latest"]


def test_a_config_file_prints_its_open_clip_line_then_the_fields_without_a_flag(capsys):
    assert open_clip_command.main(["--print-open-clip", os.path.join(REPO, "configs", "l14_laion2b.py")]) == 0
    line, *unflagged = capsys.readouterr().out.splitlines()
    words = shlex.split(line)  # as a shell reads it
    assert words[:4] == ["python", "-m", "open_clip_train.main", "--train-data=/data/laion2B-en/{00000..23295}.tar"]
    assert "--precision=amp_bf16" in words and "--imagenet-val=/data/imagenet/val" in words
    assert "--wd=0.2" not in words  # OpenCLIP's default
    assert "# no OpenCLIP flag: keep=5" in unflagged and "# no OpenCLIP flag: resume='latest'" not in unflagged


def readme_table() -> list[str]:
    """The README's table of the flags, as `FLAGS` has them: the mapped ones, the no-ops, the refused."""
    return [f"| `{flag.option}` | {kind} | {f'`{flag.field}`' if flag.field else ''} | {flag.why} |"
            for kind in (MAPPED, NO_OP, REFUSED) for flag in sorted(FLAGS.values(), key=lambda flag: flag.name)
            if flag.kind == kind]


def test_the_readme_table_shows_every_flag_as_classified():
    readme = open(os.path.join(REPO, "README.md")).read().split("### From an OpenCLIP script", 1)[1]
    assert [row for row in readme.split("\n### ")[0].splitlines() if row.startswith("| `--")] == readme_table()


@pytest.mark.slow
def test_a_run_started_with_open_clip_flags_is_the_run_its_config_starts(fashion_mnist_shards, tmp_path,
                                                                         orbax_writes_replicated_arrays_whole):
    from trainer_run import losses, tiny_config

    from clip_jax.runtime.stop_signals import StopSignal
    from clip_jax.training import command

    pattern, model = fashion_mnist_shards(512)
    flags = ["--train-data", pattern, "--model", model, "--train-num-samples", "256", "--workers", "0",
             "--batch-size", "8", "--epochs", "1", "--lr", "3e-3", "--warmup", "2",
             "--beta2", "0.98", "--eps", "1e-6", "--precision", "fp32", "--log-every-n-steps", "1",
             "--logs", str(tmp_path / "open_clip"), "--name", "run"]
    assert open_clip_command.main(flags) == 0
    config = tiny_config((pattern, model), tmp_path / "config", train_num_samples=256, warmup=2, save_every_steps=0)
    command.run_task(config, "pretraining", StopSignal())
    started_with_flags = losses(tmp_path / "open_clip" / "run")
    assert len(started_with_flags) == 4 and started_with_flags == losses(tmp_path / "config" / "run")


def test_an_evaluation_frequency_of_0_means_never_as_in_open_clip(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config, _ = dry_run(["--imagenet-val", "/val", "--val-data", "/v.tar", "--zeroshot-frequency", "0"], capsys)
    assert (config["zeroshot_data"], config["val_data"]) == ("", "/v.tar")
    config, _ = dry_run(["--imagenet-val", "/val", "--val-data", "/v.tar", "--val-frequency", "0"], capsys)
    assert (config["zeroshot_data"], config["val_data"]) == ("/val", "")
    at_the_end = default_config()
    at_the_end.update(zeroshot_data="/val", zeroshot_frequency=0, epochs=7)
    assert "--zeroshot-frequency=7" in open_clip_config.command_line(at_the_end)[0]


@pytest.fixture
def process_hooks_restored(monkeypatch):
    """A run stopped by an error leaves `storage_faults.quiet_orbax_records`' thread and unraisable-error hooks and
    its asyncio log filter on for the rest of its process; a test that stops one in-process puts them back."""
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    monkeypatch.setattr(logging.getLogger("asyncio"), "filters", list(logging.getLogger("asyncio").filters))


def test_a_config_problem_names_the_open_clip_flag_to_change(capsys, tmp_path, process_hooks_restored):
    argv = ["--dataset-type", "synthetic", "--train-num-samples", "64", "--batch-size", "8", "--epochs", "4",
            "--warmup", "100", "--workers", "0", "--logs", str(tmp_path)]  # 8 devices: 4 steps of 64
    assert open_clip_command.main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("the largest warmup that fits is 3: --warmup=3, or "
                                                            "train for more steps")
