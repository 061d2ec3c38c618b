"""Data streams: a run's global batches are the same samples whatever the processes and data workers that read them,
a position saved on one layout continues on another, and one stream per process without workers is the per-process
pipeline's order, bit for bit."""

import json

import grain
import numpy as np
import pytest

from clip_jax import data
from clip_jax.data import stream_pipeline
from clip_jax.errors import RunFailed
from test_data_pipeline import IMAGE_SIZE, MEAN_STD, _indices, _write_indexed_shards


def _stream_iterators(pattern, processes, workers, streams=4, global_batch_size=8, start=None, **cfg):
    config = data.TrainDataConfig(shards=pattern, streams=streams, workers=workers, **cfg)
    return [data.build_train_iterator(config, global_batch_size=global_batch_size, image_size=IMAGE_SIZE,
                                      process_index=p, process_count=processes, start=start, **MEAN_STD)
            for p in range(processes)]


def _global_batches(iterators, steps):
    """The steps' global batches: the processes' rows in process order (as `make_global_batch` joins them), with
    their sample keys."""
    out = []
    for _ in range(steps):
        parts = [next(it) for it in iterators]
        keys = np.concatenate([it.last_keys for it in iterators])
        out.append({"images": np.concatenate([p["images"] for p in parts]),
                    "tokens": np.concatenate([p["tokens"] for p in parts]), "keys": keys})
    return out


def _close(iterators):
    for it in iterators:
        it.close()


def _assert_same(a_batches, b_batches):
    for a, b in zip(a_batches, b_batches, strict=True):
        for key in ("images", "tokens", "keys"):
            np.testing.assert_array_equal(a[key], b[key])


def _merged_positions(iterators):
    """Every stream's saved state, from the processes' iterator states (what their checkpoint files hold)."""
    merged = {}
    for it in iterators:
        merged.update({int(s): state for s, state in it.get_state()["streams"].items()})
    return merged


CASES = dict(shuffle_window=5, shards_in_flight=2, seed=7)


@pytest.mark.parametrize("resampled", [True, False])
@pytest.mark.parametrize("processes", [1, 2])
def test_one_stream_per_process_without_workers_is_the_per_process_pipeline(tmp_path, resampled, processes):
    pattern = _write_indexed_shards(tmp_path, 4, 12)
    legacy = [data.build_train_iterator(data.TrainDataConfig(shards=pattern, resampled=resampled, **CASES),
                                        global_batch_size=8, image_size=IMAGE_SIZE, process_index=p,
                                        process_count=processes, **MEAN_STD) for p in range(processes)]
    streams = _stream_iterators(pattern, processes, 0, streams=processes, resampled=resampled, **CASES)
    for _ in range(5):
        for old, new in zip(legacy, streams):
            a, b = next(old), next(new)
            assert set(a) == set(b) == {"images", "tokens"}
            np.testing.assert_array_equal(a["images"], b["images"])
            np.testing.assert_array_equal(a["tokens"], b["tokens"])
    _close(legacy + streams)


@pytest.mark.parametrize("resampled", [True, False])
def test_the_global_batches_do_not_depend_on_the_process_count(tmp_path, resampled):
    pattern = _write_indexed_shards(tmp_path, 4, 12)
    runs = {}
    for processes in (1, 2, 4):
        iterators = _stream_iterators(pattern, processes, 0, resampled=resampled, **CASES)
        runs[processes] = _global_batches(iterators, 6)
        _close(iterators)
    _assert_same(runs[2], runs[1])
    _assert_same(runs[4], runs[1])
    keys, indices = runs[1][0]["keys"], _indices(runs[1][0])
    assert len(set(keys.tolist())) == len(set(indices))  # a key per sample
    if not resampled:  # one epoch's first samples: none twice
        assert len(set(indices)) == 8


@pytest.mark.slow
def test_workers_share_the_streams_and_read_the_same_batches(tmp_path):
    pattern = _write_indexed_shards(tmp_path, 4, 12)
    alone = _stream_iterators(pattern, 1, 0, **CASES)
    expected = _global_batches(alone, 5)
    _close(alone)
    for processes, workers in ((1, 3), (2, 2)):  # 3 workers over 4 streams: chunks of 2, 1, 1
        iterators = _stream_iterators(pattern, processes, workers, **CASES)
        _assert_same(_global_batches(iterators, 5), expected)
        _close(iterators)


def _position_and_what_follows(pattern, resampled):
    """A 2-process run's stream positions after 3 steps, and its next 4 global batches."""
    run = _stream_iterators(pattern, 2, 0, resampled=resampled, **CASES)
    _global_batches(run, 3)
    positions = _merged_positions(run)
    expected = _global_batches(run, 4)
    _close(run)
    assert sorted(positions) == [0, 1, 2, 3]
    return positions, expected


@pytest.mark.parametrize("resampled", [True, False])
def test_a_position_saved_on_one_layout_continues_on_another(tmp_path, resampled):
    pattern = _write_indexed_shards(tmp_path, 4, 12)
    positions, expected = _position_and_what_follows(pattern, resampled)
    for processes in (1, 4):
        resumed = _stream_iterators(pattern, processes, 0, resampled=resampled, start=positions, **CASES)
        _assert_same(_global_batches(resumed, 4), expected)
        _close(resumed)


@pytest.mark.slow
def test_a_position_saved_without_workers_continues_with_them(tmp_path):
    pattern = _write_indexed_shards(tmp_path, 4, 12)
    positions, expected = _position_and_what_follows(pattern, False)
    resumed = _stream_iterators(pattern, 1, 2, resampled=False, start=positions, **CASES)
    _assert_same(_global_batches(resumed, 4), expected)
    _close(resumed)


def test_epoch_mode_streams_read_every_sample_once_per_epoch(tmp_path):
    pattern = _write_indexed_shards(tmp_path, 8, 10)  # 80 samples over 4 streams of 2 shards: 10 steps of 8
    iterators = _stream_iterators(pattern, 2, 0, resampled=False, **CASES)
    seen = [i for batch in _global_batches(iterators, 10) for i in _indices(batch)]
    _close(iterators)
    assert sorted(seen) == list(range(80))


def test_skip_counters_travel_with_their_streams(tmp_path):
    pattern = _write_indexed_shards(tmp_path, 4, 12)
    run = _stream_iterators(pattern, 2, 0, **CASES)
    _global_batches(run, 2)
    positions = _merged_positions(run)
    positions[3]["parent"]["skipped"] = {"corrupt_image": 2}  # as if stream 3 had met two bad images
    positions[0]["parent"]["skipped"] = {"corrupt_image": 1}
    _close(run)
    [alone] = _stream_iterators(pattern, 1, 0, start=positions, **CASES)
    assert alone.skipped_samples() == {"corrupt_image": 3}
    alone.close()


def test_parts_that_do_not_tile_the_process_streams_stop_the_run():
    class Parent(grain.DatasetIterator):  # the workers' parts, round-robin
        def __init__(self, chunks):
            super().__init__()
            self.chunks, self.i = chunks, 0

        def get_state(self):
            return {}

        def set_state(self, state):
            pass

        def __next__(self):
            chunk = self.chunks[self.i % len(self.chunks)]
            self.i += 1
            return {"images": np.full((len(chunk), 1), chunk[0]), stream_pipeline.POSITIONS: np.frombuffer(
                json.dumps({str(s): {"n": self.i} for s in chunk}).encode(), np.uint8)}

    good = stream_pipeline.StreamTrainIterator(Parent([[4, 5], [6], [7]]), streams=8, block=range(4, 8), parts=3,
                                               start=None)
    assert next(good)["images"][:, 0].tolist() == [4, 4, 6, 7]
    swapped = stream_pipeline.StreamTrainIterator(Parent([[6], [4, 5], [7]]), streams=8, block=range(4, 8), parts=3,
                                                  start=None)
    with pytest.raises(RunFailed, match=r"streams \[6, 4, 5, 7\], not this process's \[4, 5, 6, 7\]"):
        next(swapped)
