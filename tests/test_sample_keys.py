"""Sample keys: batches carry the uint64 hashes of their samples' names only when asked (and are otherwise the
batches they always were), and the names follow the data (shard order, csv paths, synthetic batch numbers)."""

import hashlib
import tarfile

import numpy as np
import pytest
from test_data_pipeline import _index_of, _write_indexed_shards
from test_data_sources import _write_csv

from clip_jax import data
from clip_jax.data import transforms

MEAN_STD = dict(mean=(0.5,) * 3, std=(0.5,) * 3)


def _hash(name):
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")


def _dataset(source, global_batch_size=4, sample_keys=False, **cfg):
    config = data.TrainDataConfig(shards=source, **cfg)
    return data.build_train_dataset(config, global_batch_size=global_batch_size, image_size=8,
                                    sample_keys=sample_keys, **MEAN_STD)


def _batches(dataset, n):
    it = iter(dataset)
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("augment", [transforms.TrainAugment(), transforms.TrainAugment(re_prob=1.0)],
                         ids=["crop", "erasing"])
def test_batches_without_keys_are_unchanged_and_keys_add_only_keys(tmp_path, augment):
    pattern = _write_indexed_shards(tmp_path, 2, 10)
    cfg = dict(shuffle_window=5, seed=2, augment=augment)
    plain, keyed = _batches(_dataset(pattern, **cfg), 3), _batches(_dataset(pattern, sample_keys=True, **cfg), 3)
    for a, b in zip(plain, keyed, strict=True):
        assert set(a) == {"images", "tokens"} and set(b) == {"images", "tokens", "keys"}
        np.testing.assert_array_equal(a["images"], b["images"])
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        assert b["keys"].dtype == np.uint64 and b["keys"].shape == (4,)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_each_key_names_the_sample_in_its_row(tmp_path, workers):
    pattern = _write_indexed_shards(tmp_path, 2, 10)  # sample s * 10 + i: key f"{s:05d}{i:04d}", colour _color(index)
    index_of_hash = {_hash(f"{s:05d}.tar/{s:05d}{i:04d}"): s * 10 + i for s in range(2) for i in range(10)}
    it = data.TrainIterator(iter(_dataset(pattern, sample_keys=True, workers=workers, shuffle_window=4)))
    for _ in range(4):
        batch = next(it)
        assert [index_of_hash[k] for k in batch["keys"].tolist()] == [_index_of(x) for x in batch["images"]]
    it.close()


def _shard_names(path):
    """``"{file name}/{key}"`` of each sample of a webdataset shard, in file order (key: the member name up to its
    first dot)."""
    with tarfile.open(path) as tar:
        keys = [member.name.split(".", 1)[0] for member in tar.getmembers()]
    return [f"{path.name}/{key}" for key in dict.fromkeys(keys)]


def test_epoch_keys_follow_the_shard(tmp_path):
    pattern = _write_indexed_shards(tmp_path, 1, 12)
    names = _shard_names(tmp_path / "00000.tar")
    assert len(names) == 12
    ds = _dataset(pattern, sample_keys=True, resampled=False, shuffle_window=1, workers=0)
    batches = _batches(ds, 3)
    for t, batch in enumerate(batches):
        np.testing.assert_array_equal(batch["keys"], np.array([_hash(n) for n in names[4 * t:4 * t + 4]], np.uint64))


def test_csv_keys_are_the_image_paths_read(tmp_path):
    path = _write_csv(tmp_path, rows=4)
    batch = _batches(_dataset(path, dataset_type="csv", sample_keys=True, seed=3), 1)[0]
    images = sorted(str(p) for p in (tmp_path / "images").iterdir())
    assert sorted(batch["keys"].tolist()) == sorted(_hash(p) for p in images)


def test_synthetic_keys_name_process_batch_and_row():
    def dataset(keys):
        config = data.TrainDataConfig(shards="", dataset_type="synthetic", seed=5)
        return data.build_train_dataset(config, global_batch_size=6, image_size=4, context_length=8,
                                        process_index=1, process_count=2, sample_keys=keys, **MEAN_STD)

    plain, keyed = _batches(dataset(False), 3), _batches(dataset(True), 3)
    for n, (a, b) in enumerate(zip(plain, keyed, strict=True)):
        assert set(a) == {"images", "tokens"}
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        expected = [_hash(f"synthetic/1/{n}/{row}") for row in range(3)]
        np.testing.assert_array_equal(b["keys"], np.array(expected, np.uint64))
    resumed = iter(dataset(True))
    resumed.set_state({"batch": 2})
    np.testing.assert_array_equal(next(resumed)["keys"], keyed[2]["keys"])
