"""Storage faults survived: the tiny trainer run into an s3:// run directory on a local S3 server (moto) through a
fault proxy (tests/s3_fault_proxy.py) at several request error rates, then an outage.

    PYTHONPATH=. python benchmarks/storage_faults.py [--rates 0,0.05,0.1,0.2] [--steps 16] [--save-every 2]
                                                     [--retries 8] [--out DIR]

Each run trains the same model on the same Fashion-MNIST shards on every local device, in this process, with a
checkpoint every `--save-every` steps (all kept). A rate's faults are 500, 503, slow (0.3 s) and cut-off answers in
equal shares, drawn from a seeded generator. Per rate: whether the run finished, the faults it met (each one a
request the clients retried), the checkpoints committed against those due, the steps lost (trained but not in a
committed checkpoint, 0 when the run finished), whether the final params equal the rate-0 run's bit for bit, and the
wall time against the rate-0 run's (measured in the same invocation; the first run also compiles, so it runs twice
and the second counts). The outage row: every request a 503 once the first checkpoint is committed, with
`--outage-retries` attempts per request: seconds from the outage to the run's stop and what it said. Writes
OUT/storage-faults-DEVICE.json (OUT: benchmarks/out).
"""

import argparse
import json
import os
import pathlib
import platform
import sys
import threading
import time

import jax

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import boto3  # noqa: E402
import local_s3  # noqa: E402
import numpy as np  # noqa: E402
from s3_fault_proxy import FaultProxy  # noqa: E402
from trainer_run import tiny_config  # noqa: E402

from clip_jax.data import make_shards  # noqa: E402
from clip_jax.errors import RunFailed  # noqa: E402
from clip_jax.runtime.run_directory import read_params  # noqa: E402
from clip_jax.training import trainer as train_lib  # noqa: E402

BUCKET = "storage-faults"
MODEL = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 28, "patch_size": 7, "width": 32, "layers": 2, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="0,0.05,0.1,0.2")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--retries", type=int, default=8, help="CLIP_JAX_STORAGE_RETRIES of the fault-rate runs")
    parser.add_argument("--outage-retries", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    return parser.parse_args()


def flat(run_dir: str) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(read_params(run_dir))[0]}


def main() -> int:
    args = parse_args()
    root = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"storage-faults-{os.getpid()}"
    paths = make_shards.write_shards(make_shards.fashion_mnist_samples("train", limit=2048), str(root / "shards"), 256)
    (root / "model.json").write_text(json.dumps(MODEL))
    batch = 64 // jax.device_count() or 1
    samples = args.steps * batch * jax.device_count()
    data = (make_shards.shard_pattern(paths), str(root / "model.json"))
    settings = dict(train_num_samples=samples, save_every_steps=args.save_every, keep=1000, batch_size=batch,
                    resume="latest")
    due = list(range(args.save_every, args.steps + 1, args.save_every))
    due += [args.steps] if args.steps not in due else []
    rows, reference = [], None
    with local_s3.moto_server() as endpoint, FaultProxy(endpoint, seed=0, slow_s=0.3) as proxy:
        os.environ.update(local_s3.aws_env(proxy.url))
        os.environ["CLIP_JAX_STORAGE_RETRIES"] = str(args.retries)
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=BUCKET)
        rates = [float(r) for r in args.rates.split(",")]
        for index, rate in enumerate([rates[0]] + rates):  # the first run again: it compiled
            name = f"rate-{index}"
            before = dict(proxy.counts)
            proxy.set(rate=rate)
            t0 = time.perf_counter()
            try:
                finished = train_lib.train(tiny_config(data, f"s3://{BUCKET}/{name}", **settings))["step"] == args.steps
                error = ""
            except RunFailed as e:
                finished, error = False, str(e)
            seconds = time.perf_counter() - t0
            proxy.set(rate=0.0)
            committed = local_s3.committed_steps(client, BUCKET, f"{name}/run")
            met = {k: proxy.counts[k] - before[k] for k in proxy.counts}
            run_dir = f"s3://{BUCKET}/{name}/run"
            if index == 1:
                reference = (flat(run_dir), seconds)
            equal = (finished and reference is not None
                     and all(np.array_equal(a, b) for a, b in zip(flat(run_dir).values(), reference[0].values())))
            row = dict(rate=rate, finished=finished, requests=met["requests"],
                       faults=sum(v for k, v in met.items() if k != "requests"),
                       faults_by_kind={k: v for k, v in met.items() if k != "requests"},
                       checkpoints_committed=len([s for s in committed if s in due]), checkpoints_due=len(due),
                       steps_lost=0 if finished else args.steps - max(committed, default=0),
                       params_equal_rate_0=equal, seconds=seconds, error=error)
            if index > 0:
                rows.append(row)
            print(json.dumps(row), flush=True)

        # The outage: every request a 503 once the first checkpoint is committed.
        os.environ["CLIP_JAX_STORAGE_RETRIES"] = str(args.outage_retries)
        began = {}

        def outage():
            while 0 not in began:
                if local_s3.committed_steps(client, BUCKET, "outage/run"):
                    proxy.set(rate=1.0, kinds=("503",))
                    began[0] = time.perf_counter()
                time.sleep(0.05)

        watcher = threading.Thread(target=outage, daemon=True)
        watcher.start()
        trainer = None
        try:
            with train_lib.Trainer(tiny_config(data, f"s3://{BUCKET}/outage", **settings)) as trainer:
                trainer.train()
            outage_row = {"stopped": False}
        except RunFailed as e:
            stopped = time.perf_counter()
            proxy.set(rate=0.0, kinds=("500", "503", "slow", "cut"))
            committed = local_s3.committed_steps(client, BUCKET, "outage/run")
            outage_row = dict(stopped=True, seconds_to_stop=stopped - began.get(0, stopped),
                              retries=args.outage_retries,
                              last_committed=max(committed, default=None), trained_to=trainer.step if trainer else None,
                              message=str(e))
            outage_row["steps_lost"] = (outage_row["trained_to"] or 0) - (outage_row["last_committed"] or 0)
        print(json.dumps(outage_row), flush=True)

    print(f"\n{'rate':>5} | finished | faults met (500/503/slow/cut) | checkpoints | steps lost | params = rate 0 | "
          "time / rate 0")
    for r in rows:
        kinds = "/".join(str(r["faults_by_kind"][k]) for k in ("500", "503", "slow", "cut"))
        print(f"{r['rate']:>5} | {'yes' if r['finished'] else 'no':>8} | {r['faults']:>4} of {r['requests']} "
              f"({kinds}) | {r['checkpoints_committed']}/{r['checkpoints_due']} | {r['steps_lost']} | "
              f"{'yes' if r['params_equal_rate_0'] else 'no'} | {r['seconds'] / reference[1]:.2f}")
    print(f"outage: {outage_row}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0].platform
    result = dict(machine=platform.processor() or platform.machine(), devices=jax.device_count(),
                  load=os.getloadavg(), steps=args.steps, save_every=args.save_every, retries=args.retries,
                  rows=rows, outage=outage_row, date=time.strftime("%Y-%m-%d"))
    (out / f"storage-faults-{device}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
