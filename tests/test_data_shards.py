"""Shard patterns: brace expansion, sources and weights, existence checks, and the shard draw order."""

import os

import braceexpand
import fsspec
import numpy as np
import pytest

from clip_jax.data import shards


@pytest.mark.parametrize(
    "pattern",
    [
        "/data/laion2B-en/{00000..00012}.tar",
        "s3://b/{a,b}/{000..003}-{x,y}.tar",
        "{0..10..3}",
        "{10..7}",
        "{01..10}",
        "{1..010}",
        "{-2..2}",
        "{a..e}",
        "d/{0..1}/{{x,y},z}",
        "lit{x}y{1,2}",
        "a{,b}c",
        "{a{b,c}}",
        "no-braces.tar",
    ],
)
def test_brace_expansion_matches_the_braceexpand_package(pattern):
    assert shards.expand_braces(pattern) == list(braceexpand.braceexpand(pattern))


def test_brace_expansion_zero_padding_and_order():
    assert shards.expand_braces("{00998..01001}.tar") == ["00998.tar", "00999.tar", "01000.tar", "01001.tar"]
    assert shards.expand_braces("{8..11}") == ["8", "9", "10", "11"]  # no padding without a leading zero
    assert shards.expand_braces("{0..1}{a,b}") == ["0a", "0b", "1a", "1b"]  # rightmost group varies fastest
    assert len(shards.expand_braces("/data/{00000..23295}.tar")) == 23296


@pytest.mark.parametrize("pattern", ["a{0..3.tar", "a}0..3{.tar", "{0..2}}"])
def test_unbalanced_braces_name_the_pattern(pattern):
    with pytest.raises(shards.ShardPatternError, match="unbalanced") as info:
        shards.expand_braces(pattern)
    assert repr(pattern) in str(info.value)


def _touch(folder, names):
    for name in names:
        path = os.path.join(folder, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"x")


def test_sources_and_per_shard_weights(tmp_path):
    _touch(tmp_path, [f"a/{i:03d}.tar" for i in range(4)] + [f"b/{i}.tar" for i in range(2)])
    pattern = f"{tmp_path}/a/{{000..003}}.tar :: {tmp_path}/b/{{0..1}}.tar"
    shard_list = shards.resolve_shards(pattern, "1::2.5")
    expected = [f"{tmp_path}/a/{i:03d}.tar" for i in range(4)] + [f"{tmp_path}/b/{i}.tar" for i in range(2)]
    assert shard_list.urls == tuple(expected)
    assert shard_list.weights == (1.0,) * 4 + (2.5,) * 2
    assert shards.resolve_shards(pattern, [1, 3]).weights[-1] == 3.0
    with pytest.raises(shards.ShardPatternError, match="3 weights"):
        shards.resolve_shards(pattern, "1::2::3")
    with pytest.raises(shards.ShardPatternError, match="numbers"):
        shards.resolve_shards(pattern, "1::x")
    with pytest.raises(shards.ShardPatternError, match="empty source"):
        shards.resolve_shards(f"{tmp_path}/a/000.tar::")


def test_missing_shards_dropped_and_empty_pattern_named(tmp_path):
    _touch(tmp_path, ["00000.tar", "00002.tar"])
    shard_list = shards.resolve_shards(f"{tmp_path}/{{00000..00003}}.tar")
    assert shard_list.urls == (f"{tmp_path}/00000.tar", f"{tmp_path}/00002.tar")
    missing = f"{tmp_path}/other/{{0..9}}.tar"
    with pytest.raises(shards.ShardPatternError, match="matches no file") as info:
        shards.resolve_shards(f"{tmp_path}/00000.tar::{missing}")
    assert repr(missing) in str(info.value)


def _loose_jpegs(folder, count):
    from PIL import Image

    folder.mkdir()
    for i in range(count):
        Image.new("RGB", (8, 8)).save(folder / f"{i}.jpg")
        (folder / f"{i}.txt").write_text("a black square")


@pytest.mark.parametrize("given", ["{folder}", "{folder}/", "{folder}/{{00000..00003}}.tar", "{folder}/*.tar"])
def test_an_empty_folder_or_loose_images_given_as_shards_say_what_is_there(tmp_path, given):
    (tmp_path / "empty").mkdir()
    with pytest.raises(shards.ShardPatternError) as empty:
        shards.resolve_shards(given.format(folder=tmp_path / "empty"))
    assert f"{tmp_path / 'empty'} is an empty folder" in str(empty.value) and "make_shards" in str(empty.value)
    _loose_jpegs(tmp_path / "photos", 3)
    with pytest.raises(shards.ShardPatternError) as loose:
        shards.resolve_shards(given.format(folder=tmp_path / "photos"))
    assert f"{tmp_path / 'photos'} holds 3 image files and no .tar shard" in str(loose.value)
    assert f"make_shards folder --images {tmp_path / 'photos'} --out" in str(loose.value)
    assert "none exists" not in str(empty.value) + str(loose.value)


def test_loose_images_named_by_a_brace_range_are_refused_by_their_first_bytes(tmp_path):
    from clip_jax import data

    _loose_jpegs(tmp_path / "photos", 3)
    cfg = data.TrainDataConfig(shards=f"{tmp_path}/photos/{{0..2}}.jpg")
    with pytest.raises(ValueError) as refused:
        data.resolve_train_shards(cfg)
    assert str(refused.value).startswith(f"shard {tmp_path}/photos/0.jpg is not a tar file (a JPEG image)")
    assert f"make_shards folder --images {tmp_path}/photos" in str(refused.value)


def test_glob_and_fsspec_urls(tmp_path):
    _touch(tmp_path, ["x/1.tar", "x/2.tar", "x/notes.txt"])
    assert shards.resolve_shards(f"{tmp_path}/x/*.tar").urls == (f"{tmp_path}/x/1.tar", f"{tmp_path}/x/2.tar")
    assert shards.resolve_shards(f"file://{tmp_path}/x/{{1..2}}.tar").urls[0] == f"file://{tmp_path}/x/1.tar"
    fs = fsspec.filesystem("memory")
    for i in (0, 1, 3):
        fs.pipe(f"/bucket/shards/{i:02d}.tar", b"x")
    urls = shards.resolve_shards("memory://bucket/shards/{00..03}.tar").urls
    assert urls == ("memory://bucket/shards/00.tar", "memory://bucket/shards/01.tar", "memory://bucket/shards/03.tar")
    with pytest.raises(shards.ShardPatternError, match="install"):
        shards.resolve_shards("nosuchscheme-xyz://bucket/{0..1}.tar")


def test_resampled_draws_follow_the_weights():
    # 3 shards of weight 1 and 2 of weight 3: expected frequencies 1/9 each and 3/9 each. Chi-square with 4 dof:
    # the 99.9% quantile is 18.5.
    weights = [1, 1, 1, 3, 3]
    order = shards.ShardOrder.create(weights, resampled=True, seed=7)
    draws = 18_000
    counts = np.bincount([order.shard(d) for d in range(draws)], minlength=5)
    expected = draws * np.asarray(weights) / sum(weights)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5, (counts, expected)


def test_resampled_streams_are_independent_and_reproducible():
    def stream(seed, process, worker):
        order = shards.ShardOrder.create([1.0] * 1000, resampled=True, seed=seed, process_index=process,
                                         process_count=2, worker_index=worker, worker_count=2)
        return [order.shard(d) for d in range(200)]

    assert stream(0, 0, 0) == stream(0, 0, 0)
    others = [stream(0, 0, 1), stream(0, 1, 0), stream(1, 0, 0)]
    for other in others:
        assert sum(a == b for a, b in zip(stream(0, 0, 0), other)) < 10  # 1000 shards: ~0.2 matches by chance


def test_epoch_mode_streams_are_disjoint_cover_every_shard_and_reshuffle():
    num_shards, processes, workers = 23, 2, 3
    epochs = {}
    for p in range(processes):
        for w in range(workers):
            order = shards.ShardOrder.create([1.0] * num_shards, resampled=False, seed=3, process_index=p,
                                             process_count=processes, worker_index=w, worker_count=workers)
            n = order.shards_per_epoch
            for epoch in range(2):
                epochs.setdefault(epoch, []).extend(order.shard(epoch * n + k) for k in range(n))
    for epoch in range(2):
        assert sorted(epochs[epoch]) == list(range(num_shards))  # each shard exactly once per epoch
    assert epochs[0] != epochs[1]


def test_epoch_mode_with_too_few_shards_is_a_clear_error():
    with pytest.raises(ValueError, match="3 shards cannot be split over 2 processes x 2 workers"):
        shards.ShardOrder.create([1.0] * 3, resampled=False, seed=0, process_index=1, process_count=2,
                                 worker_index=1, worker_count=2)
