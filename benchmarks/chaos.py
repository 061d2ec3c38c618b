"""Random kills change nothing: a 2-process x 2-device training run SIGKILLed `--kills` times and relaunched, against
the same run left alone, bit for bit; with `--topologies`, across relaunches on changing topologies, against the
run that changed topology at the same steps without kills.

    PYTHONPATH=. python benchmarks/chaos.py [--kills 20] [--seed 0] [--storage local,s3] [--steps 160]
                                            [--save-every 4] [--save-share 0.4] [--topologies 2x2] [--out DIR]

The run: launch/local.py starting the trainer on tests/trainer_run.py's tiny model over Fashion-MNIST shards, 2
processes x 2 simulated CPU devices (global batch 32), `--steps` steps, a checkpoint every `--save-every` (the last
3 kept), `resume=latest`: the same command starts and continues it. Per storage (a local run directory; an s3://
one on a local S3 server, moto), the run is made once left alone, then under chaos (tests/chaos_run.py): each
launch gets one SIGKILL to a rank drawn at random (seeded), at a moment drawn at random: a share `--save-share` of
the kills are aimed at a checkpoint save held by the test seam (half as its writes begin, half before its commit),
the others come at a time uniform between 0.5 s and the run-alone launch's time to its first step plus two save
intervals. After each kill the same command is launched again, until a launch with no kill finishes. Then the
newest checkpoint's state (params, optimizer state, step), every process's data position and every step's logged
loss are compared with the run left alone's, bit for bit.

`--topologies 2x2,1x4,2x2` (PROCESSESxDEVICES each) moves the run through those topologies at evenly spaced planned
steps (the i-th of n from i/n of the steps, rounded to a multiple of `--save-every`; `data_streams` that every
process count can own whole): each launch runs on the topology of the step it resumes from, and a launch that
commits the checkpoint of a planned change is ended there (every rank SIGKILLed, as a node lost; a kill planned for
it and not made yet goes to the next launch). The kills are dealt to the topologies in equal shares, in order. The
run left alone is then the first topology's (every checkpoint kept); the steps at which the chaos run changed
topology (those its first launch on each new topology resumed from) are printed and written, and each change is
made again without kills: a launch on that topology resuming the previous leg's checkpoint there under a run name
of its own (tests/chaos_run.py's `run_chain`). The chaos run is compared with that chain: the last leg's
checkpoint, each step's loss and sample digest from the leg that trained it, and the data position stream by stream
where the process counts differ.

Per kill: the moment, the rank, whether the killed rank had a save in flight (and which), the last step logged
before the kill, the step the relaunch resumed from, the steps replayed, the newest checkpoint committed before the
kill (a relaunch resuming from older one: a lost checkpoint). Prints a table, writes OUT/chaos.json (OUT:
benchmarks/out). The processes run in a network namespace of their own with a 16 KiB loopback MTU where the
machine allows (tests/private_loopback.py), as in the tests.
"""

import argparse
import contextlib
import json
import logging
import math
import os
import pathlib
import platform
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import private_loopback  # noqa: E402

PRIVATE_LOOPBACK = private_loopback.enter()  # first, while this process has one thread

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import chaos_run  # noqa: E402
import finished_run  # noqa: E402
import local_s3  # noqa: E402
import numpy as np  # noqa: E402
from trainer_run import tiny_config  # noqa: E402

from clip_jax.data import make_shards  # noqa: E402

BUCKET = "chaos"
MODEL = {"embed_dim": 32,
         "vision_cfg": {"image_size": 28, "patch_size": 7, "width": 32, "layers": 2, "head_width": 16},
         "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}
PER_DEVICE = 8  # tiny_config's batch_size: the global batch is 8 x the first topology's devices


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--storage", default="local,s3", help="comma-separated: local, s3")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--save-share", type=float, default=0.4, help="share of the kills aimed at a save")
    parser.add_argument("--topologies", type=topologies, default=[(chaos_run.PROCESSES, chaos_run.DEVICES)],
                        help="comma-separated PROCESSESxDEVICES the run moves through at evenly spaced steps, "
                             "e.g. 2x2,1x4,2x2 (default: 2x2 throughout)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    parser.add_argument("--keep", metavar="DIR", help="work in DIR (a new folder) and keep it: the launches' logs")
    return parser.parse_args(argv)


def topologies(text: str) -> list[tuple[int, int]]:
    try:
        found = [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        found = []
    if not found or any(len(t) != 2 or min(t) < 1 for t in found):
        raise argparse.ArgumentTypeError(f"{text!r}: give PROCESSESxDEVICES, comma-separated, e.g. 2x2,1x4,2x2")
    return found


def topology_plan(args) -> list[tuple[int, tuple[int, int]]]:
    """[(the step from which, topology)]: `--topologies` at evenly spaced steps, each a multiple of --save-every."""
    n = len(args.topologies)
    return [(round(i * args.steps / n / args.save_every) * args.save_every, t) for i, t in enumerate(args.topologies)]


def global_batch(args) -> int:
    processes, devices = args.topologies[0]
    return PER_DEVICE * processes * devices


def planned_kinds(kills: int, save_share: float, rng: np.random.Generator) -> list[str]:
    """Each kill's kind: `write` or `commit` (aimed at a save, in equal shares) with probability `save_share`; else
    `startup` (two in five) or `training`."""
    rest = 1 - save_share
    return [str(k) for k in rng.choice(chaos_run.KINDS, size=kills,
                                       p=[0.4 * rest, 0.6 * rest, save_share / 2, save_share / 2])]


def storage_run(where: str, logs_root: str, data, workdir: str, args) -> dict:
    """The run left alone, then under chaos, in `logs_root` (a local folder or an s3:// prefix); with several
    topologies, the kill-free chain of the chaos run's topology changes too."""
    plan = topology_plan(args)
    moving = len(plan) > 1
    settings = dict(train_num_samples=args.steps * global_batch(args),
                    save_every_steps=args.save_every, keep=3, resume="latest")
    if moving:  # data streams every process count of the plan can own whole
        settings["data_streams"] = math.lcm(*(p for _, (p, _) in plan))
    alone_config = tiny_config(data, f"{logs_root}/alone", **{**settings, "keep": args.steps // args.save_every + 1}
                               if moving else settings)  # the chain resumes its checkpoints
    chaos_config = tiny_config(data, f"{logs_root}/chaos", **settings)
    rng = np.random.default_rng([args.seed, ["local", "s3"].index(where)])
    kinds = planned_kinds(args.kills, args.save_share, rng)

    t0 = time.perf_counter()
    alone = chaos_run.run_alone(alone_config, os.path.join(workdir, "alone"), topology=plan[0][1])
    print(f"{where}: left alone {alone['wall_s']:.1f} s (first step at {alone['first_step_s']:.1f} s, "
          f"{alone['step_s']:.2f} s/step)", flush=True)
    training_s = 2 * args.save_every * alone["step_s"]
    t1 = time.perf_counter()
    result = chaos_run.kill_and_relaunch(
        chaos_config, os.path.join(workdir, "chaos"), kinds, rng, startup_s=alone["first_step_s"],
        training_s=training_s, total_steps=args.steps, save_every=args.save_every,
        say=lambda line: print(f"{where}: {line}", flush=True), topologies=plan if moving else None)
    chaos_s = time.perf_counter() - t1
    print(f"{where}: topology changes (step, processes x devices): {result['changes']}", flush=True)
    found = ["the run did not finish: " + str(result["problem"])] if not result["finished"] else []
    legs, chain_s = [(0, f"{logs_root}/alone/run")], 0.0
    if result["finished"] and moving:
        t2 = time.perf_counter()
        legs = chaos_run.run_chain(alone_config, os.path.join(workdir, "chain"), legs[0][1], result["changes"],
                                   args.steps)
        chain_s = time.perf_counter() - t2
    if result["finished"]:
        expected = finished_run.chain_state([(step, finished_run.final_state(run)) for step, run in legs])
        found = finished_run.differences(finished_run.final_state(f"{logs_root}/chaos/run"), expected)
    landed = [k for k in result["kills"] if k["at_s"] is not None]
    return dict(storage=where, plan=plan, changes=result["changes"], per_launch=result["per_launch"],
                moves=sum(r["moved"] for r in result["per_launch"]), chain_legs=[step for step, _ in legs],
                chain_s=chain_s, training_window_s=training_s, alone=alone, chaos_s=chaos_s,
                total_s=time.perf_counter() - t0, kills_planned=len(kinds), kills=result["kills"],
                kills_landed=len(landed), kills_during_save=sum(k["during_save"] for k in landed),
                steps_replayed=sum(k["steps_replayed"] or 0 for k in landed),
                lost_checkpoints=sum(k["lost_checkpoint"] for k in landed), launches=result["launches"],
                finished=result["finished"], problem=result["problem"], identical=not found, differences=found)


def changes_text(changes) -> str:
    return ", ".join(f"{step}: {p}x{d}" for step, (p, d) in changes)


def print_tables(rows: list[dict]) -> None:
    for row in rows:
        on = {r["launch"]: "{}x{}".format(*r["topology"]) for r in row["per_launch"]}
        print(f"\n{row['storage']}: kill | launch | on  | kind   | planned              | at (s) | rank | "
              "save in flight | last step | resumed | replayed | newest committed | lost | launcher exit (s after)")
        for i, k in enumerate(row["kills"], 1):
            at = f"{k['at_s']:.1f}" if k["at_s"] is not None else "-"
            flight = str(k["save_step"]) if k["during_save"] else "no"
            ended = f"{k['launch_status']} ({k['ended_after_s']:.1f})" if k["at_s"] is not None else "launch ended first"
            print(f"{'':>7}{i:>4} | {k['launch']:>6} | {on.get(k['launch'], '-'):<3} | {k['kind']:<6} | "
                  f"{k['planned']:<20} | {at:>6} | {k['rank'] if k['rank'] is not None else '-':>4} | {flight:>14} | "
                  f"{k['last_step']!s:>9} | {k['resumed_from']!s:>7} | {k['steps_replayed']!s:>8} | "
                  f"{k['committed']!s:>16} | {'LOST' if k['lost_checkpoint'] else 'no':>4} | {ended}")
        if len(row["plan"]) > 1:
            print(f"\n{row['storage']}: launch | on  | from step | resumed | ended by the plan")
            for r in row["per_launch"]:
                print(f"{'':>7}{r['launch']:>6} | {on[r['launch']]:<3} | {r['from_step']:>9} | "
                      f"{r['resumed_from']!s:>7} | {'yes' if r['moved'] else 'no'}")
            print(f"{row['storage']}: planned {changes_text(row['plan'])}; changed topology at {changes_text(row['changes'])}"
                  f"; the kill-free chain's legs from steps {row['chain_legs']} ({row['chain_s']:.0f} s after the run "
                  "left alone)")
    print("\nstorage | kills landed | during a save | steps replayed | lost checkpoints | launches | finished | "
          "bit for bit | chaos time / alone | topology from step")
    for row in rows:
        print(f"{row['storage']:<7} | {row['kills_landed']:>5} of {row['kills_planned']:<4} | "
              f"{row['kills_during_save']:>13} | {row['steps_replayed']:>14} | {row['lost_checkpoints']:>16} | "
              f"{row['launches']:>8} | {'yes' if row['finished'] else 'no':>8} | "
              f"{'yes' if row['identical'] else 'NO':>11} | {row['chaos_s'] / row['alone']['wall_s']:>18.1f} | "
              f"{changes_text(row['changes'])}")
        for line in row["differences"]:
            print(f"  {line[:300]}")
    divergent = sum(not row["identical"] for row in rows)
    print(f"divergent runs: {divergent} of {len(rows)}")


def main(argv=None) -> int:
    args = parse_args(argv)
    storages = [s for s in args.storage.split(",") if s]
    if args.keep:
        os.makedirs(args.keep)
    with contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tmp, "xla-cache"))  # relaunches read it
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
        samples = make_shards.fashion_mnist_samples("train", limit=args.steps * global_batch(args))
        paths = make_shards.write_shards(samples, os.path.join(tmp, "shards"), 256)
        model = os.path.join(tmp, "model.json")
        with open(model, "w") as f:
            json.dump(MODEL, f)
        data = (make_shards.shard_pattern(paths), model)
        t0, rows = time.perf_counter(), []
        for where in storages:
            workdir = os.path.join(tmp, where)
            if where == "local":
                rows.append(storage_run(where, os.path.join(tmp, "logs"), data, workdir, args))
            else:
                logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request
                with local_s3.moto_server() as endpoint:
                    os.environ.update(local_s3.aws_env(endpoint))
                    import boto3

                    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
                    rows.append(storage_run(where, f"s3://{BUCKET}", data, workdir, args))
        total = time.perf_counter() - t0
    print_tables(rows)
    print(f"whole benchmark: {total:.0f} s")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(date=time.strftime("%Y-%m-%d"), machine=platform.processor() or platform.machine(),
                  cpus=os.cpu_count(), load=os.getloadavg(), private_loopback=PRIVATE_LOOPBACK, seed=args.seed,
                  steps=args.steps, save_every=args.save_every, save_share=args.save_share,
                  topologies=args.topologies, total_s=total, rows=rows)
    (out / "chaos.json").write_text(json.dumps(result, indent=1))
    return 0 if all(row["identical"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
