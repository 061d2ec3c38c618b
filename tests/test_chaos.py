"""Random kills change nothing: 2 processes x 2 devices, one rank SIGKILLed in each launch (during a checkpoint
save held before its commit, at a moment of the training, as a save's writes begin) and the same command launched
again each time, end bit for bit as the same run left alone: params, optimizer state, every process's data position
and every step's logged loss. The driver is tests/chaos_run.py; benchmarks/chaos.py makes 20 kills, also on a
bucket."""

import chaos_run
import numpy as np
import pytest
from trainer_run import tiny_config

RUN = dict(train_num_samples=512, save_every_steps=4, keep=3, resume="latest")  # 2 x 2 devices x 8: 16 steps


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_run_killed_three_times_and_relaunched_ends_bit_for_bit_as_the_run_left_alone(fashion_mnist_shards,
                                                                                         tmp_path):
    data = fashion_mnist_shards(512)
    alone = chaos_run.run_alone(tiny_config(data, tmp_path / "logs" / "alone", **RUN), str(tmp_path / "alone"))
    kinds = ["commit", "training", "write"]
    result = chaos_run.kill_and_relaunch(
        tiny_config(data, tmp_path / "logs" / "chaos", **RUN), str(tmp_path / "chaos"), kinds,
        np.random.default_rng(0), startup_s=alone["first_step_s"], training_s=8 * alone["step_s"], total_steps=16,
        save_every=4)
    kills = result["kills"]
    assert result["problem"] is None and result["finished"], result
    assert [k["kind"] for k in kills] == kinds and all(k["at_s"] is not None for k in kills), kills
    assert all(k["launch_status"] != 0 for k in kills), kills
    held = [k for k in kills if k["kind"] in chaos_run.SAVE_KINDS]
    assert all(k["during_save"] for k in held), held  # the killed rank's save had begun and not ended
    assert not any(k["lost_checkpoint"] for k in kills), kills
    assert result["launches"] == len(kinds) + 1

    got = chaos_run.final_state(str(tmp_path / "logs" / "chaos" / "run"))
    expected = chaos_run.final_state(str(tmp_path / "logs" / "alone" / "run"))
    assert got["step"] == 16 and sorted(expected["losses"]) == list(range(1, 17))
    assert sorted(expected["data_position"]) == ["process_0-of-2.json", "process_1-of-2.json"]
    assert any("opt_state" in name for name in expected["state"]), sorted(expected["state"])
    assert chaos_run.differences(got, expected) == []
