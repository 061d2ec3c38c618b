"""Where a resumed run's data begins: data streams read on from their saved positions on any process count that owns
them whole, the per-process layout of older checkpoints on its own layout only, and one line for everything else."""

import json

import ml_collections
import pytest

from clip_jax.runtime.checkpoints import DATA_ITER, CheckpointMeta, read_stream_positions
from clip_jax.training import data_resume


def _config(**fields):
    return ml_collections.ConfigDict({"seed": 5, "workers": 0, "resume_data": "exact", "dataset_resampled": True,
                                      "data_streams": 0, **fields})


def _plan(config, processes, devices, *, streams=4, global_batch=32, saved_processes=2, **meta):
    saved = CheckpointMeta.from_json({"step": 8, "data_streams": streams, "data_seed": 11, "process_count":
                                      saved_processes, "data_workers": 0, **meta})
    return data_resume.data_resume_plan(config, saved, saved_processes, where="CKPT", step=8,
                                        process_count=processes, device_count=devices, global_batch=global_batch,
                                        checkpoints="/ckpts")


@pytest.mark.parametrize("processes,devices", [(1, 4), (2, 4), (4, 4), (4, 8), (1, 1)])
def test_streams_read_on_on_every_process_count_that_owns_them_whole(processes, devices):
    plan = _plan(_config(), processes, devices)
    assert plan == data_resume.DataResume(False, 11, streams=4, positions=("/ckpts", 8, 2))


def test_a_process_count_that_cannot_own_the_streams_is_refused_naming_those_that_can():
    with pytest.raises(ValueError) as refused:
        _plan(_config(), 3, 3, global_batch=48)
    message = str(refused.value)
    assert "CKPT reads 4 data streams" in message and "3 processes cannot share them" in message
    assert "relaunch on 2 or 4 processes" in message and "--config.resume_data=allow_reseed" in message
    with pytest.raises(ValueError, match="8 processes cannot share them; relaunch on 4 processes"):
        _plan(_config(), 8, 8)


def test_devices_that_cannot_split_the_global_batch_are_refused():
    with pytest.raises(ValueError, match=r"2 processes of 3 devices each \(6 devices\) cannot split them"):
        _plan(_config(), 2, 6)


def test_allow_reseed_reads_new_streams_with_the_seed_of_the_step():
    plan = _plan(_config(resume_data="allow_reseed"), 3, 3, global_batch=48)
    assert (plan.restore, plan.positions, plan.streams) == (False, None, data_resume.CHOOSE)
    assert plan.seed == data_resume.reseeded_data_seed(5, 8)
    assert "data position not restored: checkpoint CKPT was saved by 2 processes x 0 data workers" in plan.note
    assert "its 4 data streams cannot be owned whole by 3 processes" in plan.note


def test_the_streams_belong_to_the_run():
    with pytest.raises(ValueError, match="data_streams=8, but checkpoint CKPT reads 4 data streams"):
        _plan(_config(data_streams=8), 2, 2)
    assert _plan(_config(data_streams=4), 2, 2).streams == 4
    with pytest.raises(ValueError, match="global batch 30 does not divide over the 4 data streams of checkpoint CKPT"):
        _plan(_config(), 2, 2, global_batch=30)


def test_a_checkpoint_of_the_per_process_layout_keeps_its_rules():
    older = CheckpointMeta.from_json({"step": 8, "process_count": 2, "data_workers": 0, "data_seed": 11})
    plan = lambda config, processes: data_resume.data_resume_plan(  # noqa: E731
        config, older, 2, where="CKPT", step=8, process_count=processes, device_count=processes, global_batch=32)
    assert plan(_config(), 2) == data_resume.DataResume(True, 11)  # Grain's own position, the layout it had
    with pytest.raises(ValueError, match="saved by 2 processes x 0 data workers, this run has 1 process x 0"):
        plan(_config(), 1)
    reseeded = plan(_config(resume_data="allow_reseed"), 1)
    assert (reseeded.restore, reseeded.streams) == (False, data_resume.CHOOSE)  # from here on, streams


def test_a_fresh_run_chooses_its_streams_unless_the_config_names_them():
    assert data_resume.fresh_data(_config()) == data_resume.DataResume(False, 5, streams=data_resume.CHOOSE)
    assert data_resume.fresh_data(_config(data_streams=6)).streams == 6


def _write_positions(step_dir, streams, processes):
    (step_dir / DATA_ITER).mkdir(parents=True)
    per = streams // processes
    for p in range(processes):
        owned = range(p * per, (p + 1) * per)
        state = {"data_streams": streams, "streams": {str(s): {"reader": s * 10} for s in owned}}
        (step_dir / DATA_ITER / f"process_{p}-of-{processes}.json").write_text(json.dumps(state))


def test_stream_positions_are_read_by_stream_whatever_process_saved_them(tmp_path):
    _write_positions(tmp_path / "8", 8, 2)
    read = lambda streams: read_stream_positions(str(tmp_path), 8, streams, data_streams=8,  # noqa: E731
                                                 saved_processes=2)
    assert read(range(0, 8)) == {s: {"reader": s * 10} for s in range(8)}  # one process reads both files
    assert read(range(2, 4)) == {2: {"reader": 20}, 3: {"reader": 30}}  # process 1 of 4
    assert read(range(6, 8)) == {6: {"reader": 60}, 7: {"reader": 70}}  # process 3 of 4
    (tmp_path / "8" / DATA_ITER / "process_1-of-2.json").unlink()
    with pytest.raises(ValueError, match=r"lacks data_iter/process_1-of-2.json, the position of data stream 4"):
        read(range(4, 8))
    with pytest.raises(ValueError, match="holds no position for data stream 5 of 16"):
        read_stream_positions(str(tmp_path), 8, range(5, 6), data_streams=16, saved_processes=2)
