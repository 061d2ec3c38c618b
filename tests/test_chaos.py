"""Random kills change nothing: 2 processes x 2 devices, one rank SIGKILLed in each of two launches (process 0 while
it holds a checkpoint whose every part is written but not committed; process 1 at a moment of the training) and the
same command launched again each time, end bit for bit as the same run left alone: params, optimizer state, every
process's data position and every step's logged loss. The driver is tests/chaos_run.py; benchmarks/chaos.py makes
20 kills at random moments, also on a bucket."""

import chaos_run
import numpy as np
import pytest
from trainer_run import tiny_config

RUN = dict(train_num_samples=512, save_every_steps=4, keep=3, resume="latest")  # 2 x 2 devices x 8: 16 steps


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_run_killed_twice_and_relaunched_ends_bit_for_bit_as_the_run_left_alone(fashion_mnist_shards, tmp_path):
    data = fashion_mnist_shards(512)
    alone = chaos_run.run_alone(tiny_config(data, tmp_path / "logs" / "alone", **RUN), str(tmp_path / "alone"))
    kinds = ["commit", "training"]
    result = chaos_run.kill_and_relaunch(  # seed 3: the third save's commit on rank 0, then rank 1 mid-training
        tiny_config(data, tmp_path / "logs" / "chaos", **RUN), str(tmp_path / "chaos"), kinds,
        np.random.default_rng(3), startup_s=alone["first_step_s"], training_s=8 * alone["step_s"], total_steps=16,
        save_every=4)
    kills = result["kills"]
    assert result["problem"] is None and result["finished"], result
    assert [(k["kind"], k["rank"]) for k in kills] == [("commit", 0), ("training", 1)], kills
    assert all(k["at_s"] is not None and k["launch_status"] != 0 for k in kills), kills
    held = kills[0]
    assert (held["during_save"], held["save_step"], held["committed"]) == (True, 12, 8), held
    assert held["resumed_from"] == 8  # checkpoint 12 was written but never committed: not resumed from
    assert not any(k["lost_checkpoint"] for k in kills), kills
    assert result["launches"] == len(kinds) + 1

    got = chaos_run.final_state(str(tmp_path / "logs" / "chaos" / "run"))
    expected = chaos_run.final_state(str(tmp_path / "logs" / "alone" / "run"))
    assert got["step"] == 16 and sorted(expected["losses"]) == list(range(1, 17))
    assert sorted(expected["data_position"]) == ["process_0-of-2.json", "process_1-of-2.json"]
    assert any("opt_state" in name for name in expected["state"]), sorted(expected["state"])
    assert chaos_run.differences(got, expected) == []
