"""Random kills of a multi-process training run: the driver of benchmarks/chaos.py and tests/test_chaos.py.

The run: launch/local.py starting the trainer (tests/train_config.py) as 2 processes x 2 CPU devices. `kill_and_
relaunch` starts it, SIGKILLs one rank (drawn at random) at a moment of the kind planned for that launch, waits for
the launch to end, and starts the same command again, until a launch with no kill left to make finishes. The kinds:
`startup` (a random moment before the first step), `training` (a random moment after it), and two phases of a
checkpoint save that tests/train_config.py's seam holds while the kill is made (`write`: its writes begun, nothing
committed; `commit`: every part written, the commit not made). Each launch records its saves (the seam's save log),
so every kill says whether the killed rank had a save in flight. `final_state` reads what a finished run left, for
the bit for bit comparison with the same run left alone (`differences`)."""

import dataclasses
import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import train_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCESSES, DEVICES = 2, 2
SAVE_KINDS = tuple(train_config.SAVE_PHASES)  # ("write", "commit")
KINDS = ("startup", "training") + SAVE_KINDS
STEP_LINE = re.compile(r"^step (\d+)/(\d+) ", re.M)
RESUMED_LINE = re.compile(r"^resumed \S+/(\d+) \(", re.M)
FRESH_LINE = re.compile(r"^no checkpoint in \S+ yet: starting fresh$", re.M)
from xla_flags import FAST_COMPILE


class Launch:
    """launch/local.py running the trainer, rank 0's output read as it comes (rank 1's: LOG_DIR/rank-1.log)."""

    def __init__(self, config, log_dir: str, env: dict | None = None, heartbeat: int = 10,
                 topology: tuple[int, int] = (PROCESSES, DEVICES)):
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        environment = {**os.environ, "CLIP_JAX_TEST_CONFIG": config.to_json(), "CLIP_JAX_INIT_TIMEOUT": "60",
                       **(env or {})}
        environment["XLA_FLAGS"] = FAST_COMPILE  # the launcher adds each rank's devices
        # --loopback-mtu 0: the ranks are the launcher's children (rank_pids), in this process's network, where the
        # local S3 server is (with its private loopback where it has one, tests/private_loopback.py)
        processes, devices = topology
        command = [sys.executable, os.path.join(REPO, "launch", "local.py"), str(processes), "--loopback-mtu", "0",
                   "--devices-per-process", str(devices), "--heartbeat-timeout", str(heartbeat), "--log-dir", log_dir,
                   "--", sys.executable, "-u", "-m", "clip_jax.train", f"--config={REPO}/tests/train_config.py"]
        self.t0 = time.perf_counter()
        self.process = subprocess.Popen(command, env=environment, cwd=REPO, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []  # (seconds since the start, line)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.perf_counter() - self.t0, line))

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def running(self) -> bool:
        return self.process.poll() is None

    def rank_pids(self) -> list[int]:
        try:
            with open(f"/proc/{self.process.pid}/task/{self.process.pid}/children") as f:
                return [int(pid) for pid in f.read().split()]
        except FileNotFoundError:
            return []

    def wait(self, timeout: float) -> int | None:
        """The launcher's exit status, or None when it is still running after `timeout` seconds."""
        try:
            status = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(timeout=10)
        return status

    def kill_all(self) -> None:
        """SIGKILL for the ranks and the launcher (a launch that hangs, or a driver that failed midway)."""
        for pid in self.rank_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.running():
            self.process.kill()
        self.process.wait()
        self._reader.join(timeout=10)

    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def first_step_s(self) -> float | None:
        return next((t for t, line in self.lines if STEP_LINE.match(line)), None)

    def last_step(self) -> int | None:
        steps = [int(m.group(1)) for m in STEP_LINE.finditer(self.output())]
        return max(steps) if steps else None

    def resumed_from(self) -> int | None:
        """The step this launch resumed from: 0 when it started afresh, None when it ended before it said."""
        text = self.output()
        found = RESUMED_LINE.search(text)
        return int(found.group(1)) if found else 0 if FRESH_LINE.search(text) else None

    def save_output(self) -> None:
        """LOG_DIR/rank-0.out: rank 0's lines, each after the seconds since the start at which it came."""
        with open(os.path.join(self.log_dir, "rank-0.out"), "w") as f:
            f.write("".join(f"{t:7.2f} {line}" for t, line in self.lines))


def read_save_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def save_in_flight(events: list[dict], rank: int, at: float) -> int | None:
    """The step whose save `rank` had begun and not ended at time `at` (time.time()), if any."""
    flight = []  # a "skipped" takes back its "begin" (the step had been saved); an "end" or "failed" its own step's
    for e in sorted((e for e in events if e["rank"] == rank and e["t"] <= at), key=lambda e: e["t"]):
        if e["event"] == "begin":
            flight.append(e["step"])
        elif e["step"] in flight:
            flight.remove(e["step"])
    return flight[-1] if flight else None


def newest_committed(events: list[dict], at: float) -> int | None:
    """The newest step whose save had ended on process 0 (after its commit) by time `at`."""
    ended = [e["step"] for e in events if e["rank"] == 0 and e["event"] == "end" and e["t"] <= at]
    return max(ended, default=None)


@dataclasses.dataclass
class Kill:
    launch: int
    kind: str  # startup | training | write | commit
    planned: str  # the moment asked for: seconds after the start or after the first step, or a save
    at_s: float | None = None  # seconds after the launch started; None: the launch ended before the kill
    rank: int | None = None
    during_save: bool = False
    save_step: int | None = None  # the step of the save in flight on the killed rank
    launch_status: int | None = None
    ended_after_s: float | None = None  # from the kill to the launcher's exit
    last_step: int | None = None  # the newest step rank 0 logged in the killed launch, else the one it resumed from
    committed: int | None = None  # the newest checkpoint known complete at the kill (saved, or resumed from)
    resumed_from: int | None = None  # the step the run went on from: that of the next launch that said (0: afresh)
    steps_replayed: int | None = None  # last_step - resumed_from (a launch killed before it said or logged: 0)
    lost_checkpoint: bool = False  # the next launch resumed from an older step than one committed before the kill


def run_alone(config, workdir: str, *, timeout: float = 600, topology: tuple[int, int] = (PROCESSES, DEVICES),
              name: str = "alone") -> dict:
    """The run left alone: (seconds to the first step, seconds per step, wall seconds) of its single launch on
    `topology` (processes, devices each)."""
    launch = Launch(config, os.path.join(workdir, name), topology=topology)
    status = launch.wait(timeout)
    if status is None:
        launch.kill_all()
    launch.save_output()
    if status != 0:
        raise RuntimeError(f"the run {name} ended with status {status}: {launch.output()[-3000:]}")
    steps = [(t, int(m.group(1))) for t, line in launch.lines for m in [STEP_LINE.match(line)] if m]
    (t_first, first), (t_last, last) = steps[0], steps[-1]
    return {"first_step_s": t_first, "step_s": (t_last - t_first) / max(1, last - first), "wall_s": launch.elapsed()}


def kill_and_relaunch(config, workdir: str, kinds: list[str], rng: np.random.Generator, *, startup_s: float,
                      training_s: float, total_steps: int, save_every: int, launch_timeout: float = 300,
                      say=print) -> dict:
    """Runs `config` to its end, killing one rank of launch i at a moment of kind `kinds[i]` and relaunching.
    A `startup` kill comes at a moment uniform in [0.5 s, the shortest time to a first step seen so far (at first
    `startup_s`)] after the launch starts (at its first step at the latest); a `training` kill uniform in [0,
    `training_s`] s after the launch logged its first step (at the run's last step at the latest); `write` and `commit` kills while the seam holds the launch's first, second or third save
    (drawn among those it will make). Returns {"kills": [Kill as dict], "launches": n, "finished": bool,
    "problem": str or None}."""
    from clip_jax.runtime import storage

    checkpoints = storage.join(config.logs, config.name, "checkpoints")
    kills: list[Kill] = []
    waiting: list[Kill] = []  # kills whose run no launch has taken over yet (a relaunch killed before it said where)
    problem, finished, number = None, False, 0
    while not finished and problem is None and number < len(kinds) + 3:
        number += 1
        kind = kinds[number - 1] if number <= len(kinds) else None
        log_dir = os.path.join(workdir, f"launch-{number}")
        save_log, pause = os.path.join(log_dir, "saves.jsonl"), os.path.join(log_dir, "pause")
        env, moment, kill = {train_config.SAVE_LOG: save_log}, None, None
        if kind in SAVE_KINDS:
            nth = int(rng.integers(1, max(1, min(saves_left(checkpoints, total_steps, save_every), 3)) + 1))
            env.update({train_config.PAUSE_AT: kind, train_config.PAUSE_FILE: pause, train_config.PAUSE_NTH: str(nth)})
            kill = Kill(number, kind, f"save {nth} of the launch")
        elif kind == "startup":
            moment = float(rng.uniform(0.5, startup_s))
            kill = Kill(number, kind, f"{moment:.1f} s after the start")
        elif kind == "training":
            moment = float(rng.uniform(0, training_s))
            kill = Kill(number, kind, f"{moment:.1f} s after step 1")
        rank, hold = int(rng.integers(0, PROCESSES)), float(rng.uniform(0, 0.3))
        launch = Launch(config, log_dir, env)
        try:
            killed_at = _kill_when_due(launch, kill, rank, pause, moment, hold, total_steps) if kill is not None else None
            status = _wait_releasing(launch, pause, launch_timeout)
            if status is None:
                problem = f"launch {number} did not end within {launch_timeout:.0f} s of its start"
        finally:
            if launch.running():
                launch.kill_all()
            _release(pause)
            launch.save_output()
        if launch.first_step_s() is not None:
            startup_s = min(startup_s, launch.first_step_s())
        if launch.resumed_from() is not None:  # where this launch took over from the kills before it
            for previous in waiting:
                previous.resumed_from = launch.resumed_from()
                previous.steps_replayed = max(0, (previous.last_step or 0) - previous.resumed_from)
                previous.lost_checkpoint = previous.committed is not None and previous.resumed_from < previous.committed
                say(json.dumps(dataclasses.asdict(previous)))
            waiting.clear()
        if kill is not None and killed_at is not None:
            events = read_save_log(save_log)
            kill.save_step = save_in_flight(events, rank, killed_at)
            kill.during_save = kill.save_step is not None
            committed = [c for c in (newest_committed(events, killed_at), launch.resumed_from()) if c]
            kill.committed = max(committed, default=None)
            kill.launch_status, kill.ended_after_s = status, launch.elapsed() - kill.at_s
            logged = launch.last_step()  # none logged: where it started, if it said
            kill.last_step = logged if logged is not None else launch.resumed_from()
        if kill is not None:
            kills.append(kill)
            if kill.at_s is not None:
                waiting.append(kill)
        if kill is None or kill.at_s is None:  # nobody was killed: the launch must have finished the run
            finished = status == 0
            if kill is not None:
                say(json.dumps(dataclasses.asdict(kill)))
            if not finished and problem is None:
                problem = f"launch {number} (no kill) ended with status {status}: {launch.output()[-2000:]}"
        elif status == 0:
            problem = f"launch {number} exited 0 although rank {rank} was killed"
    return {"kills": [dataclasses.asdict(k) for k in kills], "launches": number, "finished": finished,
            "problem": problem}


def saves_left(checkpoints_dir: str, total_steps: int, save_every: int) -> int:
    """Saves a launch starting now will make: from the newest complete checkpoint to the end (the final one too)."""
    from clip_jax.runtime import storage
    from clip_jax.runtime.checkpoints import latest_complete_step

    done = latest_complete_step(checkpoints_dir) if storage.exists(checkpoints_dir) else None
    return -(-(total_steps - (done or 0)) // save_every)


def _kill_when_due(launch: Launch, kill: Kill, rank: int, pause: str, moment: float | None, hold: float,
                   total_steps: int) -> float | None:
    """SIGKILLs `rank` when `kill` is due: `startup` `moment` s after the start, at the first step at the latest;
    `training` `moment` s after the first step, at the run's last step at the latest; `write` and `commit` `hold` s
    after the seam held a save. Fills kill.at_s and kill.rank and returns the kill's time.time(), or None when the
    launch ended first."""
    while launch.running():
        first_step = launch.first_step_s()
        if kill.kind == "startup" and (launch.elapsed() >= moment or first_step is not None):
            break
        if kill.kind == "training" and first_step is not None and (
                launch.elapsed() >= first_step + moment or launch.last_step() == total_steps):
            break
        if kill.kind in SAVE_KINDS and glob.glob(pause + "-rank*"):
            time.sleep(hold)
            break
        time.sleep(0.02)
    pids = launch.rank_pids()
    while launch.running() and len(pids) < PROCESSES:  # a moment before the launcher started both ranks
        time.sleep(0.01)
        pids = launch.rank_pids()
    if not launch.running() or len(pids) < PROCESSES:
        return None
    os.kill(pids[rank], signal.SIGKILL)
    kill.at_s, kill.rank = launch.elapsed(), rank
    return time.time()


def _wait_releasing(launch: Launch, pause: str, timeout: float) -> int | None:
    """The launcher's exit status, removing the seam's pause files meanwhile (a held save goes on); None when it
    still runs `timeout` s after its start."""
    while launch.running() and launch.elapsed() < timeout:
        _release(pause)
        time.sleep(0.05)
    return launch.wait(timeout=1)


def _release(pause: str) -> None:
    for path in glob.glob(pause + "-rank*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def final_state(run_dir: str) -> dict:
    """What a finished run left: {"step", "state": {leaf name: array} of its newest complete checkpoint (params,
    optimizer state, step), "data_position": {file name: text} of each process, "losses": {step: loss} and
    "digests": {step: sample_digest}, from the last record of each step in metrics.jsonl}. Read with Orbax and the storage layer straight, not the trainer."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    from clip_jax.runtime import storage
    from clip_jax.runtime.checkpoints import latest_complete_step

    checkpoints = storage.join(run_dir, "checkpoints")
    storage.prepare_for_orbax(checkpoints)
    step = latest_complete_step(checkpoints)
    state_dir = storage.join(checkpoints, str(step), "state")
    tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(state_dir)).tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    state = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    leaves = {jax.tree_util.keystr(path): np.asarray(leaf)
              for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
    data_dir = storage.join(checkpoints, str(step), "data_iter")
    position = {name: storage.read_text(storage.join(data_dir, name)) for name in storage.listdir(data_dir)
                if name != storage.COMMIT_FILE}
    losses, digests = {}, {}
    for line in storage.read_text(storage.join(run_dir, "metrics.jsonl")).splitlines():
        record = json.loads(line)
        if "loss" in record:
            losses[record["step"]] = record["loss"]
        if "sample_digest" in record:
            digests[record["step"]] = record["sample_digest"]
    return {"step": step, "state": leaves, "data_position": position, "losses": losses, "digests": digests}


def differences(got: dict, expected: dict) -> list[str]:
    """What differs between two `final_state`s, bit for bit (empty: identical)."""
    found = []
    if got["step"] != expected["step"]:
        found.append(f"final step {got['step']} != {expected['step']}")
    if got["state"].keys() != expected["state"].keys():
        found.append(f"state leaves differ: {sorted(got['state'].keys() ^ expected['state'].keys())}")
    for name in sorted(got["state"].keys() & expected["state"].keys()):
        a, b = got["state"][name], expected["state"][name]
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            found.append(f"state {name} differs")
    if got["data_position"] != expected["data_position"]:
        found.append(f"data position differs: {got['data_position']} != {expected['data_position']}")
    if got["losses"] != expected["losses"]:
        steps = sorted(s for s in got["losses"].keys() | expected["losses"].keys()
                       if got["losses"].get(s) != expected["losses"].get(s))
        found.append(f"logged losses differ at steps {steps}")
    if got["digests"] != expected["digests"]:
        steps = sorted(s for s in got["digests"].keys() | expected["digests"].keys()
                       if got["digests"].get(s) != expected["digests"].get(s))
        found.append(f"the steps' sample digests differ at steps {steps}")
    return found
