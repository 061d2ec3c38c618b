"""Start N training processes on this machine, joined on 127.0.0.1 with CPU (gloo) collectives.

    python launch/local.py 2 --devices-per-process 4 -- python -m clip_jax.train --config configs/demo.py

The way to try a multi-process launch before booking nodes. Each process gets CLIP_JAX_COORDINATOR,
CLIP_JAX_NUM_PROCESSES and CLIP_JAX_PROCESS_ID (clip_jax.runtime.processes reads them), its own simulated CPU
devices, and a log file LOG_DIR/rank-I.log; rank 0 also prints to this terminal. When one process fails the
others are stopped and the launcher exits with the first failure's status. Ctrl-C stops the run as it stops one
process: the ranks agree on a step, save it and exit, and the launcher exits with their status (0 once saved).

The ranks run in a network namespace of their own whose loopback has a 16 KB MTU (`--loopback-mtu`; Linux, as root
or with unprivileged user namespaces): on loopback's default 64 KB MTU their gloo sockets can stall on TCP's delayed
acknowledgements, one 64 KB segment every 40 ms, and a small step takes many times as long as in one process
(benchmarks/RESULTS.md section 17). Where no namespace can be made the launcher says so in one line and the ranks
share this machine's loopback. Nothing in the namespace reaches other hosts or servers on this machine (a W&B run
there must be offline, a local S3 server is out of reach): `--loopback-mtu 0` keeps the ranks on this machine's
network. Real multi-node networks are not affected.
"""

import argparse
import fcntl
import os
import shlex
import socket
import struct
import subprocess
import sys
import time

LOOPBACK_MTU = 16384  # the ranks' loopback unless told otherwise (benchmarks/RESULTS.md section 17)
SIOCGIFMTU = 0x8921  # Linux's ioctl that reads an interface's MTU


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
    parser.add_argument("--loopback-mtu", type=int, default=None, metavar="BYTES",
                        help=f"the MTU of the ranks' loopback, in a network namespace of their own (default: "
                        f"{LOOPBACK_MTU} where one can be made, else this machine's, said in one line; 0: this "
                        "machine's network; see the module docstring)")
    parser.epilog = "after --: the command each process runs, e.g. -- python -m clip_jax.train --config ..."
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        parser.error("give the command to run after --, e.g. -- python -m clip_jax.train --config configs/demo.py")
    if args.num_processes < 1 or args.devices_per_process < 1:
        parser.error("num_processes and --devices-per-process must be at least 1")
    return args, command


def in_private_loopback(command: list[str], mtu: int) -> list[str]:
    """`command` run inside a new network namespace whose loopback is up with MTU `mtu` (`unshare`, as root; else in
    a new user namespace too, where the kernel allows it)."""
    setup = f"ip link set lo up && ip link set lo mtu {int(mtu)} && exec \"$@\""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", "--net", *user, "--", "sh", "-c", setup, "sh", *command]


def private_loopback_problem(mtu: int) -> str | None:
    """Why no network namespace with its loopback at `mtu` can be made here (unshare's or ip's own words), or None:
    it can (made and left at once)."""
    try:
        done = subprocess.run(in_private_loopback(["true"], mtu), capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return "util-linux's unshare is not installed"
    if done.returncode == 0:
        return None
    return (done.stderr.strip().splitlines() or [f"unshare exited with status {done.returncode}"])[-1]


def loopback_mtu() -> int | None:
    """The MTU of loopback in this process's network namespace (Linux's SIOCGIFMTU; /sys shows the namespace that
    mounted it), or None where it cannot be read."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            return struct.unpack("16si", fcntl.ioctl(s, SIOCGIFMTU, struct.pack("16si", b"lo", 0)))[1]
    except OSError:
        return None


def relaunch_in_private_loopback(argv: list[str], mtu: int) -> int:
    """Runs this launcher again with `argv` inside a network namespace whose loopback has MTU `mtu`; its exit status.
    Ctrl-C reaches the ranks as in one launcher: this one waits for the other, which waits for them."""
    relaunch = [sys.executable, os.path.abspath(__file__), "--loopback-mtu=0", *without_option(argv, "--loopback-mtu")]
    return wait_all([subprocess.Popen(in_private_loopback(relaunch, mtu))])[0]


def choose_loopback(requested: int | None) -> int:
    """The MTU of the ranks' private loopback (0: none, this machine's network), from `--loopback-mtu`: the default
    where a namespace can be made, else 0 with one line saying so; a size asked for that cannot be had stops the
    launch (exit status 2)."""
    mtu = LOOPBACK_MTU if requested is None else requested
    problem = private_loopback_problem(mtu) if mtu else None
    if problem is None:
        return mtu
    if requested is not None:
        print(f"launch/local.py: --loopback-mtu {mtu} needs a network namespace, which `unshare --net` cannot make "
              f"here ({problem}): leave the option out to run on this machine's loopback", file=sys.stderr)
        raise SystemExit(2)
    mtu_here = loopback_mtu()
    print(f"launch/local.py: no network namespace of the ranks' own can be made here ({problem}): they share this "
          f"machine's loopback{'' if mtu_here is None else f' (MTU {mtu_here})'}, where gloo can stall on delayed "
          "ACKs and a small step take many times as long (benchmarks/RESULTS.md section 17)", file=sys.stderr)
    return 0


def without_option(argv: list[str], name: str) -> list[str]:
    """`argv` without `name VALUE` / `name=VALUE` before the `--` that starts the command."""
    split = argv.index("--") if "--" in argv else len(argv)
    head, kept, skip = argv[:split], [], False
    for arg in head:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            kept.append(arg)
    return kept + argv[split:]


def wait_all(processes) -> list[int]:
    """The exit statuses of `processes`, waiting through further Ctrl-Cs: the ranks get them too, and a second
    one makes each exit at once (clip_jax.runtime.stop_signals)."""
    while True:
        try:
            return [p.wait() for p in processes]
        except KeyboardInterrupt:
            continue


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, command = parse_args(argv)
    mtu = 0 if args.dry_run else choose_loopback(args.loopback_mtu)
    if mtu:
        return relaunch_in_private_loopback(argv, mtu)
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
    except KeyboardInterrupt:  # Ctrl-C reached the ranks too (one process group): each saves and stops
        for p in processes:
            if p.poll() is None:
                p.terminate()  # for a SIGINT to this launcher alone; a rank that has a stop signal keeps it
        codes = wait_all(processes)
        return next((code for code in codes if code), 0)
    finally:
        for log in logs:
            log.close()
    return status or next((p.returncode for p in processes if p.returncode), 0)


if __name__ == "__main__":
    sys.exit(main())
