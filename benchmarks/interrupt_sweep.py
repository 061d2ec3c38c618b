"""Ctrl-C sweep: SIGINT to the trainer's process group at six moments of a run, `--runs` times each.

    PYTHONPATH=. python benchmarks/interrupt_sweep.py [--runs 3] [--out DIR]

The run: tests/train_config.py's trainer process (tests/trainer_run.py's tiny model on 1,024 Fashion-MNIST images,
16 steps of 64 on 8 simulated CPU devices, one data worker, a checkpoint every 4 steps, a zero-shot evaluation on
256 demo images after each of 2 epochs). The moments: `import` (0.5 s after start), `setup` and `compile` (the
same fractions of the time to the "run ..." line and to the first step, measured on an uninterrupted run first),
`first_step` (as soon as step 1 is logged), and `save` / `evaluation` (through the test seam of
tests/train_config.py: the trainer waits there until the signal is sent). Each interrupted run is then resumed with
the same command. Counted: exit statuses, segfaults, tracebacks (the trainer's and its workers'), leaked shared
memory warnings, stops that should have left a checkpoint and did not, and resumed runs whose losses differ from the
uninterrupted run's. Prints a table, writes OUT/interrupt_sweep.json (OUT: benchmarks/out).
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from trainer_run import losses, tiny_config  # noqa: E402

from clip_jax.data import make_shards  # noqa: E402

NOT_CLEAN = re.compile(r"Traceback|KeyboardInterrupt|terminated unexpectedly")
LEAK = "leaked shared_memory"
MODEL = {"embed_dim": 32,
         "vision_cfg": {"image_size": 28, "patch_size": 7, "width": 32, "layers": 2, "head_width": 16},
         "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}
MOMENTS = ("import", "setup", "compile", "first_step", "save", "evaluation")


def launch(config, pause_at=None, pause_file=None):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "CLIP_JAX_TEST_CONFIG": config.to_json()}
    if pause_at:
        env.update(CLIP_JAX_TEST_PAUSE_AT=pause_at, CLIP_JAX_TEST_PAUSE_FILE=pause_file)
    return subprocess.Popen([sys.executable, "-u", "-m", "clip_jax.train", f"--config={REPO}/tests/train_config.py"],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def timed_lines(process):
    """(seconds since start, line) of the process's output, as it comes."""
    t0 = time.perf_counter()
    for line in process.stdout:
        yield time.perf_counter() - t0, line


def run_config(data, logs):
    return tiny_config(data, logs, train_num_samples=1024, workers=1, save_every_steps=4, epochs=2,
                       zeroshot_data="demo", zeroshot_samples=256, zeroshot_frequency=1, resume="latest")


def interrupted_run(config, moment: str, timings: dict, tmp: str) -> dict:
    pause = os.path.join(tmp, f"pause-{moment}")
    process = launch(config, *((moment, pause) if moment in ("save", "evaluation") else ()))
    t0, sent = time.perf_counter(), None
    if moment in ("import", "setup", "compile"):
        time.sleep(timings[moment])
        os.killpg(process.pid, signal.SIGINT)
        sent = time.perf_counter() - t0
    elif moment in ("save", "evaluation"):
        while not os.path.exists(pause) and process.poll() is None:
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGINT)
        sent = time.perf_counter() - t0
        if os.path.exists(pause):
            os.unlink(pause)
    output = []
    for _, line in timed_lines(process):
        output.append(line)
        if moment == "first_step" and sent is None and line.startswith("step 1/"):
            os.killpg(process.pid, signal.SIGINT)
            sent = time.perf_counter() - t0
    process.wait()
    text = "".join(output)
    return {"moment": moment, "status": process.returncode, "sent_at_s": sent,
            "exit_s": time.perf_counter() - t0, "output": text}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "out"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="interrupt-sweep-") as tmp:  # ~400 MB of runs, removed at the end
        sweep(args, tmp)


def sweep(args, tmp: str) -> None:
    paths = make_shards.write_shards(make_shards.fashion_mnist_samples("train", limit=1024),
                                     os.path.join(tmp, "shards"), 256)
    model = os.path.join(tmp, "model.json")
    with open(model, "w") as f:
        json.dump(MODEL, f)
    data = (make_shards.shard_pattern(paths), model)

    reference = run_config(data, os.path.join(tmp, "reference"))
    process, run_line, first_step = launch(reference), None, None
    for t, line in timed_lines(process):
        run_line = run_line or (t if line.startswith("run ") else None)
        first_step = first_step or (t if line.startswith("step 1/") else None)
    assert process.wait() == 0
    uninterrupted = losses(os.path.join(tmp, "reference", "run"))
    timings = {"import": 0.5, "setup": 0.6 * run_line, "compile": run_line + 0.5 * (first_step - run_line)}

    rows = []
    for moment in MOMENTS:
        for r in range(args.runs):
            config = run_config(data, os.path.join(tmp, f"{moment}-{r}"))
            row = interrupted_run(config, moment, timings, tmp)
            run_dir = os.path.join(config.logs, "run")
            checkpoints = os.path.join(run_dir, "checkpoints")
            saved = sorted(int(n) for n in os.listdir(checkpoints) if n.isdigit()) if os.path.isdir(checkpoints) \
                else []
            stop_line = [line for line in row["output"].splitlines() if line.startswith("SIGINT")]
            resumed = launch(config)
            resumed_output, _ = resumed.communicate()
            got = losses(run_dir) if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else {}
            row.update(
                segfault=row["status"] in (-11, 139), traceback=bool(NOT_CLEAN.search(row["output"])),
                leak=LEAK in row["output"], stop_lines=len(stop_line), saved=saved,
                lost_checkpoint=row["status"] == 0 and not saved,
                resumed_status=resumed.returncode,
                resumed_identical=resumed.returncode == 0 and got == uninterrupted)
            found = NOT_CLEAN.search(row["output"]) or re.search(LEAK, row["output"])
            if found:  # what went wrong, for the JSON: the lines around the first traceback or leak
                row["problem"] = row["output"][max(0, found.start() - 400):found.end() + 1200]
            del row["output"]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "problem"}), flush=True)

    print(f"\n{'moment':<12} {'runs':>4} {'exit statuses':<16} {'segfaults':>9} {'tracebacks':>10} {'leaks':>5} "
          f"{'one line':>8} {'lost ckpt':>9} {'resumed equal':>13}")
    for moment in MOMENTS:
        mine = [r for r in rows if r["moment"] == moment]
        statuses = ",".join(str(r["status"]) for r in mine)
        print(f"{moment:<12} {len(mine):>4} {statuses:<16} {sum(r['segfault'] for r in mine):>9} "
              f"{sum(r['traceback'] for r in mine):>10} {sum(r['leak'] for r in mine):>5} "
              f"{sum(r['stop_lines'] == 1 for r in mine):>8} {sum(r['lost_checkpoint'] for r in mine):>9} "
              f"{sum(r['resumed_identical'] for r in mine):>13}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "interrupt_sweep.json"), "w") as f:
        json.dump({"timings_s": timings, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
