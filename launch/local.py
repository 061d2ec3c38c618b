"""Start N training processes on this machine, joined on 127.0.0.1 with CPU (gloo) collectives.

    python launch/local.py 2 --devices-per-process 4 -- python -m clip_jax.train --config configs/demo.py

The way to try a multi-process launch before booking nodes. Each process gets CLIP_JAX_COORDINATOR,
CLIP_JAX_NUM_PROCESSES and CLIP_JAX_PROCESS_ID (clip_jax.runtime.processes reads them), its own simulated CPU
devices, and a log file LOG_DIR/rank-I.log; rank 0 also prints to this terminal. When one process fails the
others are stopped and the launcher exits with the first failure's status.
"""

import argparse
import os
import shlex
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(base: dict, rank: int, num_processes: int, port: int, devices: int, heartbeat: int) -> dict:
    env = dict(base)
    env.update(CLIP_JAX_COORDINATOR=f"127.0.0.1:{port}", CLIP_JAX_NUM_PROCESSES=str(num_processes),
               CLIP_JAX_PROCESS_ID=str(rank), CLIP_JAX_HEARTBEAT_TIMEOUT=str(heartbeat), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{base.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip())
    return env


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("num_processes", type=int)
    parser.add_argument("--devices-per-process", type=int, default=4, help="simulated CPU devices per process")
    parser.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    parser.add_argument("--heartbeat-timeout", type=int, default=10,
                        help="seconds before the others give up on a dead process")
    parser.add_argument("--log-dir", default="logs/local-launch", help="per-rank log files go here")
    parser.add_argument("--dry-run", action="store_true", help="print each rank's command and environment")
    parser.epilog = "after --: the command each process runs, e.g. -- python -m clip_jax.train --config ..."
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        parser.error("give the command to run after --, e.g. -- python -m clip_jax.train --config configs/demo.py")
    if args.num_processes < 1 or args.devices_per_process < 1:
        parser.error("num_processes and --devices-per-process must be at least 1")
    return args, command


def main(argv=None) -> int:
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    port = args.port or free_port()
    envs = [rank_env(os.environ, r, args.num_processes, port, args.devices_per_process, args.heartbeat_timeout)
            for r in range(args.num_processes)]
    if args.dry_run:
        for rank, env in enumerate(envs):
            changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
            print(f"rank {rank}: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(changed.items()))
                  + " " + shlex.join(command))
        return 0
    os.makedirs(args.log_dir, exist_ok=True)
    processes, logs = [], []
    for rank, env in enumerate(envs):
        log = open(os.path.join(args.log_dir, f"rank-{rank}.log"), "w")
        logs.append(log)
        out = None if rank == 0 else log
        processes.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT if out else None))
    status = 0
    try:
        while any(p.poll() is None for p in processes):
            failed = [p for p in processes if p.poll() not in (None, 0)]
            if failed:
                status = failed[0].returncode
                rank = processes.index(failed[0])
                print(f"launch/local.py: rank {rank} exited with status {status}; stopping the others "
                      f"(its log: {args.log_dir}/rank-{rank}.log)", file=sys.stderr)
                for p in processes:
                    if p.poll() is None:
                        p.terminate()
                break
            time.sleep(0.2)
        for p in processes:
            p.wait()
    except KeyboardInterrupt:
        for p in processes:
            p.terminate()
        for p in processes:
            p.wait()
        return 130
    finally:
        for log in logs:
            log.close()
    return status or next((p.returncode for p in processes if p.returncode), 0)


if __name__ == "__main__":
    sys.exit(main())
