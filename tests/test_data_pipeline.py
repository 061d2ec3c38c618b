"""The training pipeline end to end: batches, pairing, exact resumption (with worker processes), per-process
split, Orbax checkpointing of the iterator state, skip counters."""

import io

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
import webdataset as wds
from PIL import Image

from clip_jax import data
from clip_jax.text.clip_tokenizer import tokenize

IMAGE_SIZE = 16
MEAN_STD = dict(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))


def _color(index):
    """A solid colour that encodes a sample index < 400 (channels 12 apart, robust to resampling)."""
    return (index % 20) * 12, (index // 20) * 12, 200


def _index_of(image):
    """Inverse of ``_color`` for a normalised (mean = std = 0.5) float image [S, S, 3]."""
    r, g, _ = ((image.mean(axis=(0, 1)) * 0.5 + 0.5) * 255).tolist()
    return int(round(r / 12)) + 20 * int(round(g / 12))


def _write_indexed_shards(folder, num_shards, per_shard):
    """Shards of PNG solid-colour images, caption "sample N", written with webdataset's TarWriter."""
    for s in range(num_shards):
        with wds.TarWriter(str(folder / f"{s:05d}.tar"), encoder=False) as sink:
            for i in range(per_shard):
                index = s * per_shard + i
                buffer = io.BytesIO()
                Image.new("RGB", (24, 20), _color(index)).save(buffer, "PNG")
                sink.write({"__key__": f"{s:05d}{i:04d}", "png": buffer.getvalue(), "txt": f"sample {index}".encode(),
                            "json": b"{}"})
    return f"{folder}/{{00000..{num_shards - 1:05d}}}.tar"


def _indices(batch):
    """Sample indices of a batch, checking that every image is paired with its own caption's tokens."""
    indices = [_index_of(image) for image in batch["images"]]
    np.testing.assert_array_equal(batch["tokens"], tokenize([f"sample {i}" for i in indices]))
    return indices


def _iterator(pattern, global_batch_size=8, process_index=0, process_count=1, **cfg):
    config = data.TrainDataConfig(shards=pattern, **cfg)
    return data.build_train_iterator(config, global_batch_size=global_batch_size, image_size=IMAGE_SIZE,
                                     process_index=process_index, process_count=process_count, **MEAN_STD)


def test_batches_have_the_documented_types_and_pairing(tmp_path):
    pattern = _write_indexed_shards(tmp_path, 3, 20)
    it = _iterator(pattern, global_batch_size=8, shuffle_window=16, seed=1)
    seen = []
    for _ in range(6):
        batch = next(it)
        assert batch["images"].shape == (8, IMAGE_SIZE, IMAGE_SIZE, 3) and batch["images"].dtype == np.float32
        assert batch["tokens"].shape == (8, 77) and batch["tokens"].dtype == np.int32
        assert -1.0 <= batch["images"].min() and batch["images"].max() <= 1.0
        seen += _indices(batch)
    assert set(seen) <= set(range(60)) and len(set(seen)) > 24  # resampled: some samples come twice


def _next_batches(it, n):
    return [next(it) for _ in range(n)]


def _assert_same(batches_a, batches_b):
    for a, b in zip(batches_a, batches_b, strict=True):
        np.testing.assert_array_equal(a["images"], b["images"])
        np.testing.assert_array_equal(a["tokens"], b["tokens"])


@pytest.mark.slow
@pytest.mark.parametrize("resampled,workers", [(True, 0), (False, 0), (True, 2), (False, 2)])
def test_resume_gives_the_batches_that_would_have_come(tmp_path, resampled, workers):
    pattern = _write_indexed_shards(tmp_path, 4, 15)
    kwargs = dict(resampled=resampled, workers=workers, shuffle_window=7, shards_in_flight=2, seed=3)
    it = _iterator(pattern, **kwargs)
    _next_batches(it, 5)
    state = it.get_state()
    expected = _next_batches(it, 4)
    it.close()
    resumed = _iterator(pattern, **kwargs)
    resumed.set_state(state)
    _assert_same(_next_batches(resumed, 4), expected)
    resumed.close()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_epoch_mode_processes_read_disjoint_samples_covering_the_data(tmp_path, workers):
    pattern = _write_indexed_shards(tmp_path, 8, 20)  # 160 samples; 2 processes x 2 workers x 2 shards
    per_process = []
    for process_index in range(2):
        it = _iterator(pattern, global_batch_size=20, process_index=process_index, process_count=2,
                       resampled=False, workers=workers, shuffle_window=10, seed=4)
        per_process.append([i for batch in _next_batches(it, 8) for i in _indices(batch)])
        it.close()
    assert all(len(set(indices)) == 80 for indices in per_process)  # one epoch: no sample twice
    assert not set(per_process[0]) & set(per_process[1])
    assert set(per_process[0]) | set(per_process[1]) == set(range(160))


def test_resampled_processes_draw_independent_streams(tmp_path):
    pattern = _write_indexed_shards(tmp_path, 4, 10)
    streams = [[i for b in _next_batches(_iterator(pattern, global_batch_size=16, process_index=p, process_count=2,
                                                   shuffle_window=8), 5) for i in _indices(b)] for p in range(2)]
    assert streams[0] != streams[1]


def test_orbax_saves_and_restores_the_iterator_next_to_the_model(tmp_path):
    (tmp_path / "shards").mkdir()
    pattern = _write_indexed_shards(tmp_path / "shards", 3, 12)
    it = _iterator(pattern, shuffle_window=5, seed=9)
    _next_batches(it, 3)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave({"step": np.asarray(3, np.int32)}),
                                                data_iter=grain.checkpoint.CheckpointSave(it)))
        manager.wait_until_finished()
    expected = _next_batches(it, 3)

    restored_it = _iterator(pattern, shuffle_window=5, seed=9)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        restored = manager.restore(3, args=ocp.args.Composite(
            state=ocp.args.StandardRestore({"step": np.asarray(0, np.int32)}),
            data_iter=grain.checkpoint.CheckpointRestore(restored_it)))
    assert int(restored["state"]["step"]) == 3
    _assert_same(_next_batches(restored_it, 3), expected)


def _write_shard_with_bad_samples(path):
    """4 good samples at the end, bad ones before them: one corrupt image, one caption-less, one json-only."""
    with wds.TarWriter(str(path), encoder=False) as sink:
        sink.write({"__key__": "000000000", "jpg": b"\xff\xd8 corrupt", "txt": b"broken"})
        sink.write({"__key__": "000000001", "png": b"", "json": b"{}"})
        sink.write({"__key__": "000000002", "json": b"{}"})
        for i in range(3, 7):
            buffer = io.BytesIO()
            Image.new("L", (20, 20), 100).save(buffer, "JPEG")
            sink.write({"__key__": f"{i:09d}", "jpg": buffer.getvalue(), "txt": f"grey {i}".encode()})


def test_skip_counters_are_reachable_for_metrics(tmp_path):
    _write_shard_with_bad_samples(tmp_path / "00000.tar")
    it = _iterator(str(tmp_path / "00000.tar"), global_batch_size=4, resampled=False, shuffle_window=1)
    batch = next(it)  # the shard's 4 good samples
    assert batch["images"].shape == (4, IMAGE_SIZE, IMAGE_SIZE, 3)
    assert it.skipped_samples() == {"corrupt_image": 1, "no_caption": 1, "json_only": 1}
    next(it)  # the second pass over the shard skips them again
    assert it.skipped_samples() == {"corrupt_image": 2, "no_caption": 2, "json_only": 2}


@pytest.mark.slow
def test_skip_counters_are_summed_over_worker_processes(tmp_path):
    for s in range(2):
        _write_shard_with_bad_samples(tmp_path / f"{s:05d}.tar")
    it = _iterator(f"{tmp_path}/{{00000..00001}}.tar", global_batch_size=4, resampled=False, shuffle_window=1,
                   workers=2)
    next(it), next(it)  # one batch from each worker, each after one pass over its shard
    assert it.skipped_samples() == {"corrupt_image": 2, "no_caption": 2, "json_only": 2}
    it.close()


def test_configuration_errors_are_clear(tmp_path):
    pattern = _write_indexed_shards(tmp_path, 3, 4)
    with pytest.raises(ValueError, match="not divisible by 2 processes"):
        _iterator(pattern, global_batch_size=7, process_count=2)
    with pytest.raises(ValueError, match="at least one shard per process x worker"):
        _iterator(pattern, resampled=False, workers=2, process_count=2, global_batch_size=8)
    with pytest.raises(ValueError, match="resampled mode"):
        _iterator(pattern, resampled=False, weights="2")
    with pytest.raises(data.ShardPatternError, match="matches no file"):
        _iterator(f"{tmp_path}/missing-{{0..3}}.tar")


def test_steps_per_epoch(tmp_path):
    pattern = _write_indexed_shards(tmp_path, 2, 4)
    # OpenCLIP's count for the LAION-2B recipe: 200M samples, batch 86,016, 6 workers -> 388 batches per worker.
    cfg = data.TrainDataConfig(shards=pattern, train_num_samples=200_000_000, workers=6)
    assert data.steps_per_epoch(cfg, 86_016) == 2328
    assert data.steps_per_epoch(data.TrainDataConfig(shards=pattern, train_num_samples=1000), 64) == 16
    with pytest.raises(ValueError, match="set train_num_samples"):
        data.steps_per_epoch(data.TrainDataConfig(shards=pattern), 64)


def test_the_data_config_comes_from_the_run_config():
    from clip_jax.run_config import default_config

    config = default_config()
    config.train_data, config.train_data_upsampling_factors = "/a/{0..9}.tar::/b/{0..9}.tar", "1::2"
    config.train_num_samples, config.workers, config.seed = 5000, 3, 7
    cfg = data.TrainDataConfig.from_run_config(config)
    assert cfg == data.TrainDataConfig(shards="/a/{0..9}.tar::/b/{0..9}.tar", weights="1::2", resampled=True,
                                       train_num_samples=5000, seed=7, workers=3, shuffle_window=1000)
    assert data.TrainDataConfig.from_run_config(config, seed=11).seed == 11
    config.train_data_upsampling_factors, config.train_num_samples, config.make_train_data = "", 0, "fashion-mnist"
    cfg = data.TrainDataConfig.from_run_config(config)
    assert (cfg.weights, cfg.train_num_samples, cfg.make_from) == (None, None, "fashion-mnist")


def test_one_resolved_shard_list_feeds_the_epoch_length_and_the_pipeline(tmp_path):
    pattern = _write_indexed_shards(tmp_path, 3, 4)
    for s in range(3):
        (tmp_path / f"{s:05d}_stats.json").write_text('{"successes": 4}')
    cfg = data.TrainDataConfig(shards=pattern, resampled=False, shuffle_window=1)
    shards = data.resolve_train_shards(cfg)
    assert data.steps_per_epoch(cfg, 4, shards) == 3
    # Given the list, neither resolves the pattern again: a pattern that no longer matches does not matter.
    moved = data.TrainDataConfig(shards=f"{tmp_path}/gone-{{0..2}}.tar", resampled=False, shuffle_window=1)
    first = data.ShardList(shards.urls[:1], shards.weights[:1], shards.sources[:1])
    assert data.steps_per_epoch(moved, 4, first) == 1
    it = data.build_train_iterator(moved, shard_list=shards, global_batch_size=4, image_size=IMAGE_SIZE, **MEAN_STD)
    assert sorted(i for _ in range(3) for i in _indices(next(it))) == list(range(12))


def test_shard_statistics_that_cannot_be_read_are_named(tmp_path):
    pattern = _write_indexed_shards(tmp_path, 2, 4)
    shards = data.resolve_shards(pattern)
    (tmp_path / "00000_stats.json").write_text('{"successes": 4}')
    assert data.count_samples(shards) is None  # 00001 has none: the epoch size is unknown, not wrong
    for text, problem in [('{"successes": 4', "Expecting"), ('{"count": 4}', "no 'successes' field"),
                          ('{"successes": "four"}', "not a sample count")]:
        (tmp_path / "00001_stats.json").write_text(text)
        with pytest.raises(ValueError, match=f"00001_stats.json: .*{problem}.*set train_num_samples"):
            data.count_samples(shards)
