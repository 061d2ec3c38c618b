"""Random kills change nothing: 2 processes x 2 devices, one rank SIGKILLed and the same command launched again,
end bit for bit as the same run left alone on disk: params, optimizer state, every process's data position and
every step's logged loss. On disk, two launches killed (process 0 while it holds a checkpoint whose every part is
written but not committed; process 1 at a moment of the training); on the local S3 server, one launch killed while
a save's arrays are being written (the step folder on the bucket half made, never committed). The driver is
tests/chaos_run.py; benchmarks/chaos.py makes 20 kills at random moments, on disk and on a bucket."""

import chaos_run
import local_s3
import numpy as np
import pytest
from trainer_run import tiny_config

RUN = dict(train_num_samples=512, save_every_steps=4, keep=3, resume="latest")  # 2 x 2 devices x 8: 16 steps
BUCKET = "clip-chaos"


@pytest.fixture(scope="module")
def alone(fashion_mnist_shards, tmp_path_factory):
    """(the shards, the timings of the run left alone on disk, its `final_state`)."""
    data = fashion_mnist_shards(512)
    root = tmp_path_factory.mktemp("alone")
    timings = chaos_run.run_alone(tiny_config(data, root / "logs", **RUN), str(root))
    expected = chaos_run.final_state(str(root / "logs" / "run"))
    assert expected["step"] == 16 and sorted(expected["losses"]) == list(range(1, 17))
    assert sorted(expected["data_position"]) == ["process_0-of-2.json", "process_1-of-2.json"]
    assert any("opt_state" in name for name in expected["state"]), sorted(expected["state"])
    return data, timings, expected


def chaos(config, workdir, kinds, seed, timings) -> dict:
    return chaos_run.kill_and_relaunch(config, str(workdir), kinds, np.random.default_rng(seed),
                                       startup_s=timings["first_step_s"], training_s=8 * timings["step_s"],
                                       total_steps=16, save_every=4)


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_run_killed_twice_and_relaunched_ends_bit_for_bit_as_the_run_left_alone(alone, tmp_path):
    data, timings, expected = alone
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
    assert chaos_run.differences(chaos_run.final_state(str(tmp_path / "logs" / "run")), expected) == []


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_run_on_a_bucket_killed_mid_save_and_relaunched_ends_bit_for_bit_as_the_run_left_alone(alone, tmp_path):
    """The multi-process agreement on a bucket: the ranks' data positions and shards go to s3://, the relaunch finds
    the newest committed step there and clears the half-written one."""
    data, timings, expected = alone
    with local_s3.moto_server() as endpoint, local_s3.bucket_on(endpoint, BUCKET) as s3:
        # seed 0: rank 1 killed while the third save (step 12) writes its arrays
        result = chaos(tiny_config(data, f"s3://{BUCKET}/chaos", **RUN), tmp_path, ["write"], 0, timings)
        (kill,) = result["kills"]
        assert result["problem"] is None and result["finished"], result
        assert (kill["rank"], kill["during_save"], kill["save_step"], kill["committed"]) == (1, True, 12, 8), kill
        assert kill["launch_status"] != 0 and kill["resumed_from"] == 8 and not kill["lost_checkpoint"], kill
        assert local_s3.committed_steps(s3, BUCKET, "chaos/run")[-1] == 16
        got = chaos_run.final_state(f"s3://{BUCKET}/chaos/run")
    assert chaos_run.differences(got, expected) == []
