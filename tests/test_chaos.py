"""Random kills change nothing: 2 processes x 2 devices, one rank SIGKILLed and the same command launched again,
end bit for bit as the same run left alone on disk: params, optimizer state, every process's data position and
every step's logged loss. On disk, two launches killed (process 0 while it holds a checkpoint whose every part is
written but not committed; process 1 at a moment of the training); on the local S3 server, one launch killed while
a save's arrays are being written (the step folder on the bucket half made, never committed). The driver is
tests/chaos_run.py; benchmarks/chaos.py makes 20 kills at random moments, on disk and on a bucket.

Another topology changes nothing either: the run stopped at step 8 and resumed as 1 process x 4 devices (its data
streams shared by 2 data workers), as 1 x 2 (with gradient accumulation) and as 4 x 1 reads the same samples at every
step and logs the same losses, to float32's reduction order. Kills there change nothing: the run moved to 1 x 4 at
step 8 and its process killed as it commits checkpoint 16, launched again on 1 x 4, ends bit for bit as the move
left alone."""

import chaos_run
import finished_run
import local_s3
import numpy as np
import pytest
from trainer_run import tiny_config

# 2 x 2 devices x 8: 16 steps, half an epoch of 4 shards read as 4 data streams
RUN = dict(train_num_samples=512, save_every_steps=4, keep=3, resume="latest", data_streams=4)
BUCKET = "clip-chaos"


@pytest.fixture(scope="module")
def alone(fashion_mnist_shards, tmp_path_factory):
    """(the shards, the timings of the run left alone on disk, its `final_state`, its run directory)."""
    data = fashion_mnist_shards(1024)
    root = tmp_path_factory.mktemp("alone")
    timings = chaos_run.run_alone(tiny_config(data, root / "logs", **RUN), str(root))
    expected = finished_run.final_state(str(root / "logs" / "run"))
    assert expected["step"] == 16 and sorted(expected["losses"]) == list(range(1, 17))
    assert sorted(expected["data_position"]) == ["process_0-of-2.json", "process_1-of-2.json"]
    assert any("opt_state" in name for name in expected["state"]), sorted(expected["state"])
    assert sorted(expected["digests"]) == list(range(1, 17))
    return data, timings, expected, root / "logs" / "run"


def chaos(config, workdir, kinds, seed, timings, **plan) -> dict:
    return chaos_run.kill_and_relaunch(config, str(workdir), kinds, np.random.default_rng(seed),
                                       startup_s=timings["first_step_s"], training_s=8 * timings["step_s"],
                                       total_steps=16, save_every=4, **plan)


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_run_killed_twice_and_relaunched_ends_bit_for_bit_as_the_run_left_alone(alone, tmp_path):
    data, timings, expected, _ = alone
    kinds = ["commit", "training"]  # seed 3: the third save's commit on rank 0, then rank 1 mid-training
    result = chaos(tiny_config(data, tmp_path / "logs", **RUN), tmp_path / "chaos", kinds, 3, timings)
    kills = result["kills"]
    assert result["problem"] is None and result["finished"], result
    assert [(k["kind"], k["rank"]) for k in kills] == [("commit", 0), ("training", 1)], kills
    assert all(k["at_s"] is not None and k["launch_status"] != 0 for k in kills), kills
    held = kills[0]
    assert (held["during_save"], held["save_step"], held["committed"]) == (True, 12, 8), held
    assert held["resumed_from"] == 8  # checkpoint 12 was written but never committed: not resumed from
    assert not any(k["lost_checkpoint"] for k in kills), kills
    assert result["launches"] == len(kinds) + 1
    assert finished_run.differences(finished_run.final_state(str(tmp_path / "logs" / "run")), expected) == []


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_run_on_a_bucket_killed_mid_save_and_relaunched_ends_bit_for_bit_as_the_run_left_alone(alone, tmp_path):
    """The multi-process agreement on a bucket: the ranks' data positions and shards go to s3://, the relaunch finds
    the newest committed step there and clears the half-written one."""
    data, timings, expected, _ = alone
    with local_s3.moto_server() as endpoint, local_s3.bucket_on(endpoint, BUCKET) as s3:
        # seed 0: rank 1 killed while the third save (step 12) writes its arrays
        result = chaos(tiny_config(data, f"s3://{BUCKET}/chaos", **RUN), tmp_path, ["write"], 0, timings)
        (kill,) = result["kills"]
        assert result["problem"] is None and result["finished"], result
        assert (kill["rank"], kill["during_save"], kill["save_step"], kill["committed"]) == (1, True, 12, 8), kill
        assert kill["launch_status"] != 0 and kill["resumed_from"] == 8 and not kill["lost_checkpoint"], kill
        assert local_s3.committed_steps(s3, BUCKET, "chaos/run")[-1] == 16
        got = finished_run.final_state(f"s3://{BUCKET}/chaos/run")
    assert finished_run.differences(got, expected) == []


TOPOLOGIES = {"1x4": ((1, 4), dict(workers=2)), "1x2": ((1, 2), dict(accum_freq=2)), "4x1": ((4, 1), {})}


def moved_config(data, logs, topology: str, **settings):
    return tiny_config(data, logs, **{**RUN, **TOPOLOGIES[topology][1], "name": "moved", **settings})


@pytest.fixture(scope="module")
def moved(alone, tmp_path_factory):
    """The run left alone resumed from its checkpoint 8 on another topology of TOPOLOGIES, kill-free, under another
    run name: topology -> its `final_state`, each made once (the 1 x 4 one serves two tests)."""
    data, _, _, run_dir = alone
    made = {}

    def resumed(topology: str) -> dict:
        if topology not in made:
            root = tmp_path_factory.mktemp(f"moved-{topology}")
            config = moved_config(data, root / "logs", topology, resume=str(run_dir / "checkpoints" / "8"))
            chaos_run.run_alone(config, str(root), topology=TOPOLOGIES[topology][0], name=topology)
            made[topology] = finished_run.final_state(str(root / "logs" / "moved"))
        return made[topology]

    return resumed


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_a_run_resumed_on_another_topology_reads_the_same_samples_and_logs_the_same_losses(alone, moved, topology):
    _, _, expected, _ = alone
    got = moved(topology)
    assert got["step"] == 16 and sorted(got["losses"]) == list(range(9, 17))
    assert got["digests"] == {s: expected["digests"][s] for s in range(9, 17)}  # the same samples, step by step
    shifted = np.array([got["losses"][s] for s in range(9, 17)])
    left = np.array([expected["losses"][s] for s in range(9, 17)])
    print(f"{topology}: largest relative loss difference from the 2 x 2 run, steps 9-16: "
          f"{np.max(np.abs(shifted / left - 1)):.2e}")
    np.testing.assert_allclose(shifted, left, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_run_moved_to_1x4_and_killed_there_ends_bit_for_bit_as_the_move_without_the_kill(alone, moved, tmp_path):
    """The 2 x 2 run's checkpoint 8 continued as 1 x 4 (resume=latest once the run has a checkpoint of its own),
    its one process SIGKILLed while it holds the commit of its final checkpoint, 16, and launched again on 1 x 4."""
    data, timings, _, run_dir = alone
    config = moved_config(data, tmp_path / "logs", "1x4")
    # seed 0: the launch's second save (16) held before its commit
    result = chaos(config, tmp_path / "chaos", ["commit"], 0, timings, topologies=[(0, (1, 4))],
                   start=str(run_dir / "checkpoints" / "8"))
    (kill,) = result["kills"]
    assert result["problem"] is None and result["finished"], result
    assert (kill["rank"], kill["during_save"], kill["save_step"], kill["committed"]) == (0, True, 16, 12), kill
    assert kill["launch_status"] != 0 and kill["resumed_from"] == 12 and not kill["lost_checkpoint"], kill
    assert [(r["topology"], r["from_step"], r["resumed_from"]) for r in result["per_launch"]] == [
        ([1, 4], 8, 8), ([1, 4], 12, 12)], result["per_launch"]
    got = finished_run.final_state(str(tmp_path / "logs" / "moved"))
    assert finished_run.differences(got, moved("1x4")) == []
