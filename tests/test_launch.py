"""Launch scripts: syntax, what each rank would run (SLURM dry run under fake job variables, local launcher),
how a process finds its group, and a rank that cannot join naming itself."""

import glob
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from clip_jax.runtime import processes as distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(REPO, "launch", "*.sh"))
                 + glob.glob(os.path.join(REPO, "launch", "*.sbatch")))
FAKE_JOB = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "123", "SLURM_JOB_NAME": "l14", "SLURM_SUBMIT_DIR": REPO}


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CLIP_JAX_", "XLA_FLAGS"))}
    return {**env, **extra}


@pytest.mark.subprocess
def test_there_are_launch_scripts_and_bash_parses_them_all():
    names = {os.path.basename(s) for s in SCRIPTS}
    assert {"l14_laion2b.sbatch", "l14_laion2b_per_node.sbatch", "local.sh"} <= names
    for script in SCRIPTS:
        result = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
        assert result.returncode == 0, (script, result.stderr)


def dry_run(script, *args):
    result = subprocess.run(["bash", os.path.join(REPO, "launch", script), "--dry-run", *args],
                            env=clean_env(**FAKE_JOB), capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()


@pytest.mark.subprocess
def test_slurm_dry_run_prints_one_line_per_gpu_rank():
    lines = dry_run("l14_laion2b.sbatch", "--config.lr=1e-4")
    assert len(lines) == 8  # 2 fake nodes x 4 tasks
    for rank, line in enumerate(lines):
        assert line.startswith(f"rank {rank} (node {rank // 4}, local {rank % 4}):")
        assert f"SLURM_PROCID={rank} SLURM_LOCALID={rank % 4} SLURM_NTASKS=8" in line
        assert f"logs/slurm-l14-123/rank-{rank}.log" in line
        assert "CLIP_JAX_LOCAL_DEVICE_IDS= " in line  # one GPU per task: JAX's SLURM detection picks it
        assert "--xla_gpu_enable_latency_hiding_scheduler=true" in line
        assert "JAX_COMPILATION_CACHE_DIR=" in line and "CLIP_JAX_HEARTBEAT_TIMEOUT=100" in line
        assert line.endswith("cmd: python -m clip_jax.train --config configs/l14_laion2b.py --config.lr=1e-4")


@pytest.mark.subprocess
def test_slurm_dry_run_of_one_process_per_node_gives_each_all_four_gpus():
    lines = dry_run("l14_laion2b_per_node.sbatch")
    assert len(lines) == 2
    assert all("CLIP_JAX_LOCAL_DEVICE_IDS=0,1,2,3" in line for line in lines)
    assert lines[1].startswith("rank 1 (node 1, local 0):")


def test_the_reference_job_asks_slurm_for_the_reference_resources():
    text = open(os.path.join(REPO, "launch", "l14_laion2b.sbatch")).read()
    for option in ("--nodes=96", "--gres=gpu:4", "--ntasks-per-node=4", "--cpus-per-task=6"):
        assert f"#SBATCH {option}\n" in text


@pytest.mark.subprocess
def test_slurm_script_outside_an_allocation_says_so():
    result = subprocess.run(["bash", os.path.join(REPO, "launch", "l14_laion2b.sbatch"), "--dry-run"],
                            env=clean_env(SLURM_SUBMIT_DIR=REPO), capture_output=True, text=True)
    assert result.returncode != 0
    assert "not inside a SLURM allocation" in result.stderr


@pytest.mark.subprocess
def test_local_launcher_dry_run_gives_each_rank_its_coordinates():
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "launch", "local.py"), "3", "--port", "4567", "--devices-per-process",
         "2", "--dry-run", "--", "python", "-m", "clip_jax.train", "--config", "configs/demo.py"],
        env=clean_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3
    for rank, line in enumerate(lines):
        assert line.startswith(f"rank {rank}: ")
        for part in ("CLIP_JAX_COORDINATOR=127.0.0.1:4567", "CLIP_JAX_NUM_PROCESSES=3",
                     f"CLIP_JAX_PROCESS_ID={rank}", "JAX_PLATFORMS=cpu", "--xla_force_host_platform_device_count=2"):
            assert part in line
        assert line.endswith("python -m clip_jax.train --config configs/demo.py")


@pytest.mark.subprocess
def test_local_launcher_can_run_the_ranks_on_a_loopback_of_their_own(tmp_path):
    """`--loopback-mtu`: every rank sees loopback with that MTU (one namespace for all, so they still reach each
    other on 127.0.0.1); where the kernel refuses a network namespace, the launch fails naming unshare."""
    command = [sys.executable, os.path.join(REPO, "launch", "local.py"), "2", "--loopback-mtu", "16384",
               "--log-dir", str(tmp_path), "--", "ip", "-o", "link", "show", "lo"]
    allowed = subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True)
    if allowed:
        assert result.returncode == 0, result.stderr
        for output in (result.stdout, (tmp_path / "rank-1.log").read_text()):
            assert " mtu 16384 " in output, output
    else:
        assert result.returncode != 0 and "unshare" in result.stderr


# What each rank prints: its network namespace and the MTU of the loopback there (read with SIOCGIFMTU: /sys shows
# the namespace that mounted it).
RANK_NETWORK = ("import fcntl, os, socket, struct; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                "print(os.readlink('/proc/self/ns/net'), struct.unpack('16si', fcntl.ioctl(s, 0x8921, "
                "struct.pack('16si', b'lo', 0)))[1])")


def ranks_network(tmp_path, *options, env=None):
    """(namespace, loopback MTU) of rank 0 and rank 1 of a local launch with `options`, and its stderr."""
    result = subprocess.run([sys.executable, os.path.join(REPO, "launch", "local.py"), "2", *options, "--log-dir",
                             str(tmp_path), "--", sys.executable, "-c", RANK_NETWORK],
                            env=env or clean_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    seen = [tuple(output.split()) for output in (result.stdout, (tmp_path / "rank-1.log").read_text())]
    return [(namespace, int(mtu)) for namespace, mtu in seen], result.stderr


def this_network():
    namespace, mtu = subprocess.run([sys.executable, "-c", RANK_NETWORK], capture_output=True, text=True,
                                    check=True).stdout.split()
    return namespace, int(mtu)


def namespace_can_be_made() -> bool:
    """Whether `unshare` makes a network namespace here and sets its loopback's MTU (as root; else in a user
    namespace too)."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    try:
        return subprocess.run(["unshare", "--net", *user, "--", "sh", "-c", "ip link set lo mtu 16384"],
                              capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


@pytest.mark.subprocess
def test_by_default_the_ranks_get_a_16k_loopback_of_their_own_or_are_told_in_one_line_why_not(tmp_path):
    """Two local processes on loopback's 64 KB MTU step many times slower (gloo and delayed ACKs, benchmarks/RESULTS.md
    section 17): by default the launcher gives them one namespace of their own with a 16 KB loopback where one can be
    made (CI may not permit it: either way the choice is checked against what this machine allows)."""
    ranks, said = ranks_network(tmp_path)
    here = this_network()
    assert ranks[0] == ranks[1]  # one namespace for both: they reach each other on 127.0.0.1
    if namespace_can_be_made():
        assert ranks[0][0] != here[0] and ranks[0][1] == 16384 and said == ""
    else:
        assert ranks[0] == here, ranks
        assert re.fullmatch(r"launch/local.py: no network namespace of the ranks' own can be made here \(.+\): they "
                            rf"share this machine's loopback \(MTU {here[1]}\), .*section 17\)\n", said), said


@pytest.mark.subprocess
def test_where_no_namespace_can_be_made_the_ranks_share_this_loopback_and_the_launcher_says_why(tmp_path):
    """`unshare` refused (as in a container without the permission): the ranks run on this machine's loopback, and
    one line says so with unshare's reason; `--loopback-mtu 0` chooses that loopback without a word; a loopback size
    asked for explicitly stops the launch."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "unshare").write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    (fake / "unshare").chmod(0o755)
    env = clean_env(PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    here = this_network()
    ranks, said = ranks_network(tmp_path, env=env)
    assert ranks == [here, here]
    assert said.count("\n") == 1 and said.startswith("launch/local.py: no network namespace of the ranks' own can be "
                                                     "made here (unshare: unshare failed: Operation not permitted)")
    assert ranks_network(tmp_path, "--loopback-mtu", "0", env=env) == ([here, here], "")
    asked = subprocess.run([sys.executable, os.path.join(REPO, "launch", "local.py"), "2", "--loopback-mtu", "9000",
                            "--", "true"], env=env, capture_output=True, text=True, timeout=60)
    assert asked.returncode == 2 and asked.stderr.count("\n") == 1 and "--loopback-mtu 9000" in asked.stderr
    assert "`unshare --net` cannot make here (unshare: unshare failed: Operation not permitted)" in asked.stderr


@pytest.mark.subprocess
def test_local_launcher_needs_a_command():
    result = subprocess.run([sys.executable, os.path.join(REPO, "launch", "local.py"), "2"], capture_output=True,
                            text=True)
    assert result.returncode == 2 and "give the command" in result.stderr


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "8"}, None),  # the batch shell itself, not an srun step
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "1"}, None),
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "384"}, ("slurm", None, None, None, None)),
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "96", "CLIP_JAX_LOCAL_DEVICE_IDS": "0,1,2,3"},
     ("slurm", None, None, None, (0, 1, 2, 3))),
    ({"CLIP_JAX_COORDINATOR": "127.0.0.1:1234", "CLIP_JAX_NUM_PROCESSES": "2", "CLIP_JAX_PROCESS_ID": "1"},
     ("env", "127.0.0.1:1234", 2, 1, None)),
    ({"CLIP_JAX_COORDINATOR": "h:1", "CLIP_JAX_NUM_PROCESSES": "1", "CLIP_JAX_PROCESS_ID": "0"}, None),
])
def test_the_environment_decides_the_process_group(env, expected):
    group = distributed.process_group_from_env(env)
    got = None if group is None else (group.source, group.coordinator, group.num_processes, group.process_id,
                                       group.local_device_ids)
    assert got == expected


def test_timeouts_come_from_the_environment():
    group = distributed.process_group_from_env({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4",
                                                "CLIP_JAX_HEARTBEAT_TIMEOUT": "7", "CLIP_JAX_INIT_TIMEOUT": "9"})
    assert (group.heartbeat_timeout, group.init_timeout) == (7, 9)


@pytest.mark.parametrize("env, message", [
    ({"CLIP_JAX_COORDINATOR": "h:1"}, "set CLIP_JAX_NUM_PROCESSES and CLIP_JAX_PROCESS_ID"),
    ({"CLIP_JAX_COORDINATOR": "h:1", "CLIP_JAX_NUM_PROCESSES": "2", "CLIP_JAX_PROCESS_ID": "2"},
     "must be in 0..1"),
    ({"CLIP_JAX_COORDINATOR": "h:1", "CLIP_JAX_NUM_PROCESSES": "two", "CLIP_JAX_PROCESS_ID": "0"},
     "CLIP_JAX_NUM_PROCESSES='two' is not an integer"),
    ({"CLIP_JAX_HEARTBEAT_TIMEOUT": "0"}, "at least 1 second"),
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "CLIP_JAX_LOCAL_DEVICE_IDS": "gpu0"}, "give device numbers"),
])
def test_bad_process_settings_are_named(env, message):
    with pytest.raises(distributed.DistributedInitError, match=message):
        distributed.process_group_from_env(env)


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_rank_whose_peers_never_come_says_which_rank_failed(tmp_path):
    env = clean_env(CLIP_JAX_COORDINATOR="127.0.0.1:1", CLIP_JAX_NUM_PROCESSES="2", CLIP_JAX_PROCESS_ID="1",
                    CLIP_JAX_INIT_TIMEOUT="3", JAX_PLATFORMS="cpu")
    # Under the default init timeout (300 s) the run would outlast this limit: it gives up at the 3 s it is given.
    result = subprocess.run([sys.executable, "-m", "clip_jax.train", "--config", "configs/demo.py",
                             f"--config.logs={tmp_path}"], env=env, capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    # JAX aborts the process from C++ when its registration with the coordinator passes the deadline; the line
    # before names the rank.
    assert result.returncode == -signal.SIGABRT, result.stderr[-3000:]
    assert "rank 1 of 2 (env, coordinator 127.0.0.1:1) joining (gives up after 3 s" in result.stderr, \
        result.stderr[-3000:]
    assert "DEADLINE_EXCEEDED" in result.stderr and "CoordinationService/RegisterTask" in result.stderr, \
        result.stderr[-3000:]


@pytest.mark.subprocess
def test_a_joined_process_keeps_its_own_sigterm_handler():
    # The trainer remembers SLURM's SIGTERM in a Python handler installed before the process joins its group;
    # joining must leave it in place (JAX's preemption service would take SIGTERM over in C++ and swallow it).
    script = textwrap.dedent("""
        import os, signal, socket, time
        from clip_jax.runtime import processes
        got = []
        signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        processes.initialize(processes.ProcessGroup("env", f"127.0.0.1:{port}", 1, 0, None, 30, 30))
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 10
        while not got and time.time() < deadline:
            time.sleep(0.05)
        print("handled" if got else "not handled", flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", script], env=clean_env(JAX_PLATFORMS="cpu"), cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "handled", result.stderr[-3000:]
