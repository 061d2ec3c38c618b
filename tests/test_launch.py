"""Launch scripts: syntax, what each rank would run (SLURM dry run under fake job variables, local launcher),
how a process finds its group, and a rank that cannot join naming itself."""

import glob
import os
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
