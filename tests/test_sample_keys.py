"""Sample keys: batches carry the uint64 hashes of their samples' names only when asked (and are otherwise the
batches they always were), the names follow the data (shard order, csv paths, synthetic batch numbers), and a
global batch's digest is the documented formula, recomputed here from the shard alone, on one process and two."""

import hashlib
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from test_data_pipeline import _index_of, _write_indexed_shards
from test_data_sources import _write_csv

from clip_jax import data
from clip_jax.data import transforms
from clip_jax.training import sample_digest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "launch"))
import local as local_launch  # noqa: E402

MEAN_STD = dict(mean=(0.5,) * 3, std=(0.5,) * 3)


def _hash(name):
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")


def _formula(values):
    """sha256 over the values sorted ascending, each 8 little-endian bytes; 16 hex characters."""
    packed = b"".join(v.to_bytes(8, "little") for v in sorted(values))
    return hashlib.sha256(packed).hexdigest()[:16]


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


def test_epoch_keys_follow_the_shard_and_digest_as_documented(tmp_path):
    pattern = _write_indexed_shards(tmp_path, 1, 12)
    names = _shard_names(tmp_path / "00000.tar")
    assert len(names) == 12
    ds = _dataset(pattern, sample_keys=True, resampled=False, shuffle_window=1, workers=0)
    batches = _batches(ds, 3)
    for t, batch in enumerate(batches):
        np.testing.assert_array_equal(batch["keys"], np.array([_hash(n) for n in names[4 * t:4 * t + 4]], np.uint64))
    keys = np.concatenate([batches[0]["keys"], batches[1]["keys"]])
    assert sample_digest.digest(keys) == _formula(_hash(n) for n in names[:8])
    assert sample_digest.digest(keys[::-1]) == sample_digest.digest(keys)
    assert sample_digest.digest(keys[:7]) != sample_digest.digest(keys)


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


def test_global_digest_on_one_process_is_the_digest_and_keeps_all_64_bits():
    values = [2**64 - 1, 2**63, 2**63 + 2**32 + 7, 1, 2**32]
    keys = np.array(values, np.uint64)
    assert sample_digest.global_digest(keys) == sample_digest.digest(keys) == _formula(values)
    flipped = keys ^ np.uint64(2**63)  # the same low words: a lost top bit would not change the digest
    assert sample_digest.global_digest(flipped) == _formula(v ^ 2**63 for v in values) != _formula(values)


RANK_DIGEST = """
import sys
import numpy as np
from clip_jax.runtime import processes
from clip_jax.training import sample_digest
processes.initialize_from_environment()
print(sample_digest.global_digest(np.array([int(k) for k in sys.argv[1:]], np.uint64)))
"""


@pytest.mark.slow
def test_global_digest_of_two_processes_is_the_digest_of_all_their_keys():
    local_keys = [[2**64 - 1, 3, 2**63], [2**63 + 1, 3, 2**40]]  # a key read by both counts twice
    port = local_launch.free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_DIGEST, *map(str, keys)], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=local_launch.rank_env(os.environ, rank, 2, port, 1, 60))
             for rank, keys in enumerate(local_keys)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    expected = _formula(local_keys[0] + local_keys[1])
    assert [out.split()[-1] for out, _ in outputs] == [expected, expected]  # after gloo's own lines
