"""Random kills of a multi-process training run: the driver of benchmarks/chaos.py and tests/test_chaos.py.

The run: launch/local.py starting the trainer (tests/train_config.py), by default as 2 processes x 2 CPU devices.
`kill_and_relaunch` starts it, SIGKILLs one rank (drawn at random) at a moment of the kind planned for that launch,
waits for the launch to end, and starts the same command again, until a launch with no kill left to make finishes.
The kinds: `startup` (a random moment before the first step), `training` (a random moment after it), and two phases
of a checkpoint save that tests/train_config.py's seam holds while the kill is made (`write`: its writes begun,
nothing committed; `commit`: every part written, the commit not made). Each launch records its saves (the seam's
save log), so every kill says whether the killed rank had a save in flight. With a topology plan
(tests/topology_plan.py) each launch runs on the topology of the step it resumes from, and `run_chain` makes the
kill-free run that changed topology at the same steps. tests/finished_run.py reads what a finished run left, for
the bit for bit comparison with the run left alone."""

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
from topology_plan import PlannedMove, Topology, committed_step, next_move, topology_at
from xla_flags import FAST_COMPILE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCESSES, DEVICES = 2, 2
SAVE_KINDS = tuple(train_config.SAVE_PHASES)  # ("write", "commit")
KINDS = ("startup", "training") + SAVE_KINDS
STEP_LINE = re.compile(r"^step (\d+)/(\d+) ", re.M)
RESUMED_LINE = re.compile(r"^resumed \S+/(\d+) \(", re.M)
FRESH_LINE = re.compile(r"^no checkpoint in \S+ yet: starting fresh$", re.M)


class Launch:
    """launch/local.py running the trainer, rank 0's output read as it comes (rank 1's: LOG_DIR/rank-1.log)."""

    def __init__(self, config, log_dir: str, env: dict | None = None, heartbeat: int = 10,
                 topology: Topology = (PROCESSES, DEVICES)):
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


def run_alone(config, workdir: str, *, timeout: float = 600, topology: Topology = (PROCESSES, DEVICES),
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
                      say=print, topologies: list[tuple[int, Topology]] | None = None,
                      start: str | None = None) -> dict:
    """Runs `config` to its end, killing one rank of launch i at a moment of kind `kinds[i]` and relaunching.
    A `startup` kill comes at a moment uniform in [0.5 s, the shortest time to a first step seen so far (at first
    `startup_s`)] after the launch starts (at its first step at the latest); a `training` kill uniform in [0,
    `training_s`] s after the launch logged its first step (at the run's last step at the latest); `write` and
    `commit` kills while the seam holds the launch's first, second or third save (drawn among those it will make).

    `topologies` ([(from step, (processes, devices))], the first from 0; default: 2 x 2 throughout): each launch
    runs on the topology of the step it resumes from, the newest committed checkpoint on disk (0: none); a launch
    that commits a checkpoint at or past the plan's next change is ended (`PlannedMove`) and the run launched again
    on the next topology. The kills are dealt to the plan's topologies in order, in equal shares: a launch makes the
    first kill not made yet of its topology's share or an earlier one's (one the plan ends before its kill leaves
    the kill to the next launch; one with no kill left runs until the plan ends it or the run is done). `start`:
    another run's checkpoint (`.../checkpoints/STEP`) the run begins from: launches before the run has a committed
    checkpoint of its own resume from it, the others as `config` says (resume=latest).

    Returns {"kills": [Kill as dict], "launches": n, "per_launch": [{"launch", "topology", "from_step",
    "resumed_from", "moved"}], "changes": [(step, topology)] (the first launch's, then each launch's on another
    topology than the one before: the steps where the run changed topology), "finished": bool, "problem": str or
    None}."""
    from clip_jax.runtime import storage

    checkpoints = storage.join(config.logs, config.name, "checkpoints")
    plan = topologies or [(0, (PROCESSES, DEVICES))]
    kills: list[Kill] = []
    waiting: list[Kill] = []  # kills whose run no launch has taken over yet (a relaunch killed before it said where)
    shares = [list(kinds[len(kinds) * i // len(plan):len(kinds) * (i + 1) // len(plan)]) for i in range(len(plan))]
    per_launch, moves = [], 0
    problem, finished, number = None, False, 0
    while not finished and problem is None and number < len(kinds) + 3 + moves:
        number += 1
        own = committed_step(checkpoints)
        step = own if own is not None else int(storage.basename(start)) if start else 0
        queued = next((share for share in shares[:sum(s <= step for s, _ in plan)] if share), [])
        kind = queued[0] if queued else None
        (processes, devices), move = topology_at(plan, step), PlannedMove(checkpoints, next_move(plan, step))
        launch_config = config if own is not None or not start else _resuming(config, start)
        log_dir = os.path.join(workdir, f"launch-{number}")
        save_log, pause = os.path.join(log_dir, "saves.jsonl"), os.path.join(log_dir, "pause")
        env, moment, kill = {train_config.SAVE_LOG: save_log}, None, None
        if kind in SAVE_KINDS:
            saves = -(-((move.step or total_steps) - step) // save_every)  # its saves: the final one too
            nth = int(rng.integers(1, max(1, min(saves, 3)) + 1))
            env.update({train_config.PAUSE_AT: kind, train_config.PAUSE_FILE: pause, train_config.PAUSE_NTH: str(nth)})
            kill = Kill(number, kind, f"save {nth} of the launch")
        elif kind == "startup":
            moment = float(rng.uniform(0.5, startup_s))
            kill = Kill(number, kind, f"{moment:.1f} s after the start")
        elif kind == "training":
            moment = float(rng.uniform(0, training_s))
            kill = Kill(number, kind, f"{moment:.1f} s after step 1")
        rank, hold = int(rng.integers(0, processes)), float(rng.uniform(0, 0.3))
        launch, killed_at = Launch(launch_config, log_dir, env, topology=(processes, devices)), None
        try:
            if kill is not None:
                killed_at = _kill_when_due(launch, kill, rank, pause, moment, hold, total_steps, processes, move)
            status = _wait_releasing(launch, pause, launch_timeout, move if killed_at is None else None)
            if status is None:
                problem = f"launch {number} did not end within {launch_timeout:.0f} s of its start"
        finally:
            if launch.running():
                launch.kill_all()
            _release(pause)
            launch.save_output()
        per_launch.append({"launch": number, "topology": [processes, devices], "from_step": step,
                           "resumed_from": launch.resumed_from(), "moved": move.made})
        if launch.first_step_s() is not None:
            startup_s = min(startup_s, launch.first_step_s())
        if launch.resumed_from() is not None:  # where this launch took over from the kills before it
            for previous in waiting:
                previous.resumed_from = launch.resumed_from()
                previous.steps_replayed = max(0, (previous.last_step or 0) - previous.resumed_from)
                previous.lost_checkpoint = previous.committed is not None and previous.resumed_from < previous.committed
                say(json.dumps(dataclasses.asdict(previous)))
            waiting.clear()
        if move.made and killed_at is None:  # the plan moved the run before any kill: the kill is still to make
            moves += 1
            say(f"launch {number} on {processes} x {devices} ended: step {move.step} committed, the plan moves on")
            continue
        if queued:
            queued.pop(0)
        if kill is not None and killed_at is not None:
            _account(kill, launch, read_save_log(save_log), rank, killed_at, status)
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
    changes = []
    for record in per_launch:
        if not changes or record["topology"] != changes[-1][1]:
            changes.append((record["from_step"], record["topology"]))
    return {"kills": [dataclasses.asdict(k) for k in kills], "launches": number, "per_launch": per_launch,
            "changes": changes, "finished": finished, "problem": problem}


def _resuming(config, checkpoint: str):
    resumed = config.copy_and_resolve_references()
    resumed.resume = checkpoint
    return resumed


def _account(kill: Kill, launch: Launch, events: list[dict], rank: int, killed_at: float, status: int | None) -> None:
    """Fills in what the save log and rank 0's output tell of a kill made at `killed_at` (time.time())."""
    kill.save_step = save_in_flight(events, rank, killed_at)
    kill.during_save = kill.save_step is not None
    committed = [c for c in (newest_committed(events, killed_at), launch.resumed_from()) if c]
    kill.committed = max(committed, default=None)
    kill.launch_status, kill.ended_after_s = status, launch.elapsed() - kill.at_s
    logged = launch.last_step()  # none logged: where it started, if it said
    kill.last_step = logged if logged is not None else launch.resumed_from()


def run_chain(config, workdir: str, first_run: str, changes: list[tuple[int, Topology]],
              total_steps: int) -> list[tuple[int, str]]:
    """The kill-free reference of a run whose topology changed at `changes` ([(step, topology)], the first at 0):
    `first_run` is the run directory of `config` left alone on the first topology, and each later change one
    launch on its topology resuming the previous leg's checkpoint at its step under a run name of its own (`leg-2`,
    ...), to the end. The legs keep the checkpoints the next one resumes (`config.keep`: every save). Returns
    [(the step each leg started from, its run directory)]."""
    from clip_jax.runtime import storage

    legs = [(0, first_run)]
    for number, (step, topology) in enumerate(changes[1:], 2):
        if step >= total_steps:  # nothing left to train
            break
        leg = _resuming(config, storage.join(legs[-1][1], "checkpoints", str(step)))
        leg.name = f"leg-{number}"
        run_alone(leg, workdir, topology=tuple(topology), name=leg.name)
        legs.append((step, storage.join(config.logs, leg.name)))
    return legs


def _kill_when_due(launch: Launch, kill: Kill, rank: int, pause: str, moment: float | None, hold: float,
                   total_steps: int, processes: int, move: PlannedMove) -> float | None:
    """SIGKILLs `rank` (of `processes`) when `kill` is due: `startup` `moment` s after the start, at the first step
    at the latest; `training` `moment` s after the first step, at the run's last step at the latest; `write` and
    `commit` `hold` s after the seam held a save. Fills kill.at_s and kill.rank and returns the kill's time.time(),
    or None when the launch ended first (or `move` ended it)."""
    while launch.running():
        if move.due():
            move.make(launch)
            return None
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
    while launch.running() and len(pids) < processes:  # a moment before the launcher started every rank
        time.sleep(0.01)
        pids = launch.rank_pids()
    if not launch.running() or len(pids) < processes:
        return None
    os.kill(pids[rank], signal.SIGKILL)
    kill.at_s, kill.rank = launch.elapsed(), rank
    return time.time()


def _wait_releasing(launch: Launch, pause: str, timeout: float, move: PlannedMove | None = None) -> int | None:
    """The launcher's exit status, removing the seam's pause files meanwhile (a held save goes on) and ending the
    launch when `move` is due; None when it still runs `timeout` s after its start."""
    while launch.running() and launch.elapsed() < timeout:
        if move is not None and move.due():
            move.make(launch)
        _release(pause)
        time.sleep(0.05)
    return launch.wait(timeout=1)


def _release(pause: str) -> None:
    for path in glob.glob(pause + "-rank*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
