"""Joining the processes of a multi-process run: from SLURM, or from `CLIP_JAX_*` variables (launch/local.py).

Every process calls `initialize_from_environment()` before anything touches the devices: the command modules do
(`clip_jax.training.command`, `clip_jax.evaluation.embed`), nothing a command calls joins. It returns False (and
does nothing) for a single-process run. What the processes agree on is told where it is asked for: a stop
(`clip_jax.runtime.stop_signals`), the clock that names a run (`time_of_process_0`). The coordination service's
heartbeat makes every surviving process exit with an error when a peer dies, within `CLIP_JAX_HEARTBEAT_TIMEOUT`
seconds, instead of waiting in a collective until the job's time limit. A process whose run fails ends through
`leave_run`, so that it does die: left to Python's exit, JAX's exit handler waits at a shutdown barrier for the
peers, which wait in a collective for it.

Variables (all optional under SLURM, which supplies the coordinator, the process count and the rank itself):
    CLIP_JAX_COORDINATOR        host:port of process 0's coordination service
    CLIP_JAX_NUM_PROCESSES      processes in the run
    CLIP_JAX_PROCESS_ID         this process's rank, 0 .. N-1
    CLIP_JAX_LOCAL_DEVICE_IDS   "0,1,2,3": the accelerators this process owns (one process per node under SLURM);
                                unset: JAX's default (one GPU per SLURM task, all devices otherwise)
    CLIP_JAX_HEARTBEAT_TIMEOUT  seconds without a peer's heartbeat before the run fails (default 100)
    CLIP_JAX_INIT_TIMEOUT       seconds to wait for every process to join (default 300)
"""

import dataclasses
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping

import jax
import numpy as np

from clip_jax.errors import RunFailed
from clip_jax.runtime import private_apis

COORDINATOR, NUM_PROCESSES, PROCESS_ID = "CLIP_JAX_COORDINATOR", "CLIP_JAX_NUM_PROCESSES", "CLIP_JAX_PROCESS_ID"
LOCAL_DEVICE_IDS = "CLIP_JAX_LOCAL_DEVICE_IDS"
HEARTBEAT_TIMEOUT, INIT_TIMEOUT = "CLIP_JAX_HEARTBEAT_TIMEOUT", "CLIP_JAX_INIT_TIMEOUT"
DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_INIT_TIMEOUT = 100, 300
_joined = False  # this process joined a multi-process run
_barriers = 0  # `meet_once_compiled` barriers so far: each barrier's name is new


class DistributedInitError(RunFailed):
    """The multi-process environment is set wrong, or the processes could not meet."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """How this process joins the run. `coordinator`, `num_processes`, `process_id` None: SLURM detects them."""

    source: str  # "env" or "slurm"
    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None
    heartbeat_timeout: int
    init_timeout: int

    def describe(self) -> str:
        rank = os.environ.get("SLURM_PROCID", "?") if self.process_id is None else self.process_id
        size = os.environ.get("SLURM_NTASKS", "?") if self.num_processes is None else self.num_processes
        where = self.coordinator or "the SLURM step's first node"
        return f"rank {rank} of {size} ({self.source}, coordinator {where})"


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    value = env.get(name, "")
    if value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedInitError(f"{name}={value!r} is not an integer") from None


def _device_ids(env: Mapping[str, str]) -> tuple[int, ...] | None:
    value = env.get(LOCAL_DEVICE_IDS, "").strip()
    if not value:
        return None
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise DistributedInitError(f"{LOCAL_DEVICE_IDS}={value!r}: give device numbers like '0,1,2,3'") from None


def process_group_from_env(env: Mapping[str, str] | None = None) -> ProcessGroup | None:
    """The process group the environment asks for, or None for a single-process run.

    `CLIP_JAX_COORDINATOR` wins over SLURM. SLURM counts only inside an `srun` step with more than one task
    (`SLURM_STEP_ID` set, `SLURM_NTASKS` > 1): a batch script's own shell is not a rank.
    """
    env = os.environ if env is None else env
    heartbeat = _int(env, HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT)
    init = _int(env, INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT)
    if heartbeat < 1 or init < 1:
        raise DistributedInitError(f"{HEARTBEAT_TIMEOUT} and {INIT_TIMEOUT} must be at least 1 second")
    devices = _device_ids(env)
    if env.get(COORDINATOR):
        num, rank = _int(env, NUM_PROCESSES), _int(env, PROCESS_ID)
        if num is None or rank is None:
            raise DistributedInitError(f"{COORDINATOR} is set: set {NUM_PROCESSES} and {PROCESS_ID} as well")
        if num < 1 or not 0 <= rank < num:
            raise DistributedInitError(f"{PROCESS_ID}={rank} must be in 0..{num - 1} ({NUM_PROCESSES}={num})")
        if num == 1:
            return None
        return ProcessGroup("env", env[COORDINATOR], num, rank, devices, heartbeat, init)
    if env.get("SLURM_STEP_ID") is not None and (_int(env, "SLURM_NTASKS", 1) or 1) > 1:
        return ProcessGroup("slurm", None, None, None, devices, heartbeat, init)
    return None


def initialize(group: ProcessGroup) -> None:
    """Joins `group`; CPU devices use gloo for cross-process collectives (GPUs use NCCL). SIGTERM stays with the
    handler the process has (JAX's preemption service, which would take it, is off).

    When joining fails, JAX either raises (caught here: DistributedInitError naming the rank and the cause) or
    aborts the process from C++ after `init_timeout`; the line printed beforehand then says which rank it was.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service would install a SIGTERM handler of its own in C++ as the process joins, replacing
    # the trainer's (clip_jax.runtime.stop_signals, installed before this call), which then never hears SLURM's
    # SIGTERM; the trainer has its own agreement on a stop (`StopSignal.agreed`) and needs no other.
    jax.config.update("jax_enable_preemption_service", False)
    print(f"clip_jax.runtime.processes: {group.describe()} joining (gives up after {group.init_timeout} s; a dead peer "
          f"fails the run after {group.heartbeat_timeout} s without heartbeat)", file=sys.stderr, flush=True)
    global _joined
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator, num_processes=group.num_processes,
            process_id=group.process_id, local_device_ids=group.local_device_ids,
            initialization_timeout=group.init_timeout, heartbeat_timeout_seconds=group.heartbeat_timeout)
    except Exception as e:  # jax raises RuntimeError / ValueError with the coordination service's text
        raise DistributedInitError(
            f"{group.describe()} failed to join the run: {e}. Check that every rank started, that the "
            f"coordinator's port is reachable, and raise {INIT_TIMEOUT} if starts are slow") from e
    _joined = True


def initialize_from_environment() -> bool:
    """Joins the multi-process run the environment describes; False when it describes none."""
    group = process_group_from_env()
    if group is None:
        return False
    initialize(group)
    return True


def meet_once_compiled(compile_step: Callable[[], object], moment: str) -> None:
    """CPU runs of several processes: `compile_step()`, then wait until every process has reached `moment` (at most
    `CLIP_JAX_INIT_TIMEOUT` seconds, and at least 15 minutes). Gloo gives the peers of a first collective 30 s to meet
    (not configurable), so a rank that set up more slowly than the others failed the run with `Gloo context
    initialization failed`; seen on a loaded machine: rank 1 compiled the step while rank 0 read it from the
    persistent cache, over a minute apart. The step is compiled twice (jit does not reuse an ahead-of-time compile;
    the persistent compilation cache, where enabled, serves the second). Alone or on GPUs (NCCL has no such
    deadline): nothing. A peer that dies meanwhile fails the run within the heartbeat timeout, as anywhere."""
    if jax.process_count() == 1 or jax.devices()[0].platform != "cpu":
        return
    compile_step()
    global _barriers
    _barriers += 1
    timeout = max(_int(os.environ, INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT), 900)
    private_apis.wait_at_barrier(f"clip_jax/{_barriers}/{moment}", timeout)


def time_of_process_0() -> int:
    """Process 0's clock in whole seconds, the same on every process (a run's name when it has none): a collective
    when the run has several processes."""
    if jax.process_count() == 1:
        return int(time.time())
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int64(time.time())))


def leave_run(status: int, bug: Exception | None = None) -> int:
    """How a process whose run failed ends (its error told already; `bug`: an error that is not the user's, whose
    traceback is still to be printed). Alone, it returns `status` for the caller to exit with (`bug` is raised
    again). A rank of a multi-process run prints the traceback and ends here at once with `status`, skipping
    Python's exit handlers: JAX's would wait at the shutdown barrier for peers that wait in a collective for this
    rank, and neither would end until a timeout. Its end closes its connections and stops its heartbeat, so the
    peers fail within the heartbeat timeout and a launcher sees the failure now."""
    if not _joined:
        if bug is not None:
            raise bug
        return status
    if bug is not None:
        traceback.print_exception(bug)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
