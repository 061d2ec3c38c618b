"""Reading tar shards written by independent writers; bad data skipped and counted; exact raw-stream resumption."""

import collections
import io
import json
import os
import tarfile

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from clip_jax.data import pipeline, shards, skips, tar_dataset, tar_format, webdataset


def _jpeg(rng, size=(20, 16), mode="RGB"):
    pixels = rng.integers(0, 256, (size[1], size[0], 3 if mode == "RGB" else 1), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.squeeze(-1) if mode == "L" else pixels, mode).save(buffer, "JPEG")
    return buffer.getvalue()


def _png(color):
    buffer = io.BytesIO()
    Image.new("RGB", (12, 10), color).save(buffer, "PNG")
    return buffer.getvalue()


def _write_tarwriter(path, samples):
    """webdataset's own writer (pax headers: it stores float mtimes)."""
    with wds.TarWriter(path, encoder=False) as sink:
        for key, files in samples:
            sink.write({"__key__": key, **files})


def _write_tarfile(path, members, fmt=tarfile.GNU_FORMAT):
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_tarwriter_shard_read_back_completely_and_paired(tmp_path):
    rng = np.random.default_rng(0)
    written = {}
    samples = []
    for i in range(57):
        key = f"{i * 3:09d}"  # keys with gaps, as img2dataset leaves them
        ext = ("jpg", "png", "jpeg", "webp")[i % 4] if i % 4 != 3 else "jpg"
        image = _jpeg(rng, mode="L" if i % 5 == 0 else "RGB")
        caption = f"caption {i} – ünïcode"
        meta = json.dumps({"key": key, "caption": caption}).encode()
        samples.append((key, {ext: image, "txt": caption.encode(), "json": meta}))
        written[key] = (image, caption)
    path = str(tmp_path / "00000.tar")
    _write_tarwriter(path, samples)
    skipped = collections.Counter()
    read = {s.key: (s.image, s.caption) for s in webdataset.iter_shard(path, skipped)}
    assert read == written
    assert not skipped


def test_gnu_long_names_pax_and_directories(tmp_path):
    long_dir = "d" * 120
    members = [
        (f"{long_dir}/000000001.jpg", b"img1"), (f"{long_dir}/000000001.txt", b"one"),
        ("sub/000000002.png", b"img2"), ("sub/000000002.txt", "twö".encode()),
    ]
    path = str(tmp_path / "gnu.tar")
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("sub")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    pax_path = str(tmp_path / "pax.tar")
    _write_tarfile(pax_path, [(f"{'p' * 150}/k.jpg", b"img3"), (f"{'p' * 150}/k.txt", "pax ✓".encode())],
                   fmt=tarfile.PAX_FORMAT)
    got = [(s.key, s.image, s.caption) for p in (path, pax_path) for s in webdataset.iter_shard(p)]
    assert got == [(f"{long_dir}/000000001", b"img1", "one"), ("sub/000000002", b"img2", "twö"),
                   (f"{'p' * 150}/k", b"img3", "pax ✓")]


def test_member_offsets_allow_resuming_mid_shard(tmp_path):
    path = str(tmp_path / "s.tar")
    _write_tarwriter(path, [(f"{i:09d}", {"jpg": bytes([i]) * (i * 100 + 1), "txt": b"c%d" % i}) for i in range(9)])
    with open(path, "rb") as f:
        groups = list(tar_format.iter_groups(tar_format.iter_members(f)))
    resume_at = groups[4].offset
    with open(path, "rb") as f:
        f.seek(resume_at)
        rest = list(tar_format.iter_groups(tar_format.iter_members(f, resume_at)))
    assert [g.key for g in rest] == [g.key for g in groups[4:]]
    assert [g.end for g in groups[:-1]] == [g.offset for g in groups[1:]]


def _bad_kind_members(kind, rng):
    """Members of one bad sample of the given kind (key 000000001)."""
    k = "000000001"
    return {
        "json_only": [(f"{k}.json", b'{"status": "success"}')],
        "no_image": [(f"{k}.txt", b"caption without image"), (f"{k}.json", b"{}")],
        "no_caption": [(f"{k}.jpg", _jpeg(rng)), (f"{k}.json", b"{}")],
        "empty_caption": [(f"{k}.jpg", _jpeg(rng)), (f"{k}.txt", b"  \n ")],
        "bad_caption": [(f"{k}.jpg", _jpeg(rng)), (f"{k}.txt", b"\xff\xfe bad utf-8")],
        "empty_image": [(f"{k}.jpg", b""), (f"{k}.txt", b"empty image")],
    }[kind]


@pytest.mark.parametrize("kind", ["json_only", "no_image", "no_caption", "empty_caption", "bad_caption",
                                  "empty_image"])
def test_each_bad_sample_kind_is_skipped_and_counted_once(tmp_path, kind):
    rng = np.random.default_rng(1)
    good = lambda k: [(f"{k}.jpg", _jpeg(rng)), (f"{k}.txt", f"good {k}".encode())]  # noqa: E731
    path = str(tmp_path / "00000.tar")
    _write_tarfile(path, good("000000000") + _bad_kind_members(kind, rng) + good("000000002"))
    skipped = collections.Counter()
    assert [s.key for s in webdataset.iter_shard(path, skipped)] == ["000000000", "000000002"]
    assert skipped == {kind: 1}
    # The training stream (one shard, read in epochs) counts it once per pass over the shard.
    it = iter(tar_dataset.TarShardDataset(shards.resolve_shards(path), resampled=False, shuffle_window=1))
    assert [next(it).key for _ in range(4)] == ["000000000", "000000002"] * 2
    assert it.get_state()["skipped"] == {kind: 2}


def _truncated(path, good_samples, cut_into_member):
    rng = np.random.default_rng(2)
    members = []
    for i in range(good_samples + 1):
        members += [(f"{i:09d}.jpg", _jpeg(rng, (40, 40))), (f"{i:09d}.txt", f"caption {i}".encode())]
    _write_tarfile(path, members)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "rb") as f:
        offsets = [m.offset for m in tar_format.iter_members(f)]
    cut = offsets[2 * good_samples] + cut_into_member  # inside the last sample's image
    with open(path, "wb") as f:
        f.write(data[:cut])


@pytest.mark.parametrize("cut_into_member", [700, 100, 0])  # inside the data, inside the header, at a boundary
def test_truncated_shard_keeps_complete_samples_and_is_counted(tmp_path, cut_into_member):
    path = str(tmp_path / "t.tar")
    _truncated(path, 3, cut_into_member)
    skipped = collections.Counter()
    assert [s.caption for s in webdataset.iter_shard(path, skipped)] == ["caption 0", "caption 1", "caption 2"]
    assert skipped == {"truncated_shard": 1}


def test_corrupt_header_stops_the_shard_and_is_counted(tmp_path):
    path = str(tmp_path / "c.tar")
    rng = np.random.default_rng(3)
    _write_tarfile(path, [(f"{i:09d}.{e}", _jpeg(rng) if e == "jpg" else b"cap") for i in range(3)
                          for e in ("jpg", "txt")])
    with open(path, "rb") as f:
        offsets = [m.offset for m in tar_format.iter_members(f)]
    data = bytearray(open(path, "rb").read())
    data[offsets[4] + 10 : offsets[4] + 20] = b"\x00garbage!!"
    open(path, "wb").write(bytes(data))
    skipped = collections.Counter()
    assert len(list(webdataset.iter_shard(path, skipped))) == 2
    assert skipped == {"corrupt_shard": 1}


def test_unreadable_shard_is_logged_and_skipped(tmp_path, caplog):
    good = str(tmp_path / "good.tar")
    _write_tarwriter(good, [(f"{i:09d}", {"jpg": b"x", "txt": b"y"}) for i in range(5)])
    missing = str(tmp_path / "gone.tar")
    os.mkdir(tmp_path / "dir.tar")  # opening a folder fails
    skipped = collections.Counter()
    assert list(webdataset.iter_shard(missing, skipped)) == []
    assert skipped == {"unreadable_shard": 1}
    shard_list = shards.ShardList((good, missing, str(tmp_path / "dir.tar")), (1.0,) * 3, ("p",) * 3)
    it = iter(tar_dataset.TarShardDataset(shard_list, resampled=True, shuffle_window=4, seed=5))
    assert len({next(it).key for _ in range(40)}) == 5  # training goes on with the readable shard
    assert it.get_state()["skipped"]["unreadable_shard"] >= 1
    assert "unreadable shard" in caplog.text


def test_only_bad_shards_is_a_clear_error(tmp_path):
    shard_list = shards.ShardList((str(tmp_path / "gone.tar"),), (1.0,), ("p",))
    it = iter(tar_dataset.TarShardDataset(shard_list, resampled=True, shuffle_window=1))
    with pytest.raises(RuntimeError, match="gave no usable sample.*unreadable_shard"):
        next(it)


def test_corrupt_images_are_counted_by_the_decoding_stage(tmp_path):
    rng = np.random.default_rng(4)
    path = str(tmp_path / "00000.tar")
    _write_tarwriter(path, [
        ("000000000", {"jpg": _jpeg(rng), "txt": b"good"}),
        ("000000001", {"jpg": b"\xff\xd8\xff\xe0 not really a jpeg", "txt": b"corrupt"}),
        ("000000002", {"png": _jpeg(rng)[:60], "txt": b"cut png"}),
        ("000000003", {"jpg": _jpeg(rng, mode="L"), "txt": b"grey"}),
    ])
    raw = tar_dataset.TarShardDataset(shards.resolve_shards(path), resampled=False, shuffle_window=1)
    it = iter(pipeline.DecodedDataset(raw, image_size=8, train=True))
    first, second = next(it), next(it)
    assert (first["caption"], second["caption"]) == ("good", "grey")
    assert second["image"].shape == (8, 8, 3) and second["image"].dtype == np.uint8
    assert skips.skip_counts(it) == {"corrupt_image": 2}


def _stream_shards(tmp_path, num_shards=5, per_shard=23):
    paths = []
    for s in range(num_shards):
        path = str(tmp_path / f"{s:05d}.tar")
        _write_tarwriter(path, [(f"{s:05d}{i:04d}", {"jpg": b"i", "txt": f"{s}-{i}".encode()})
                                for i in range(per_shard)])
        paths.append(path)
    return shards.resolve_shards(f"{tmp_path}/{{00000..{num_shards - 1:05d}}}.tar")


@pytest.mark.parametrize("resampled", [True, False])
def test_raw_stream_resumes_exactly_from_any_position(tmp_path, resampled):
    shard_list = _stream_shards(tmp_path)
    ds = tar_dataset.TarShardDataset(shard_list, resampled=resampled, seed=11, shuffle_window=10, shards_in_flight=3)
    it = iter(ds)
    reference = [next(it).key for _ in range(150)]
    for stop in (0, 1, 9, 10, 11, 57, 100):
        it = iter(ds)
        for _ in range(stop):
            next(it)
        state = json.loads(json.dumps(it.get_state()))  # the state is JSON, as Orbax stores it
        resumed = iter(ds)
        resumed.set_state(state)
        assert [next(resumed).key for _ in range(40)] == reference[stop : stop + 40]


def test_epoch_mode_reads_every_sample_once_per_epoch(tmp_path):
    shard_list = _stream_shards(tmp_path, num_shards=4, per_shard=17)
    it = iter(tar_dataset.TarShardDataset(shard_list, resampled=False, seed=2, shuffle_window=1, shards_in_flight=3))
    epoch0 = [next(it).key for _ in range(68)]
    epoch1 = [next(it).key for _ in range(68)]
    assert len(set(epoch0)) == 68 and set(epoch0) == set(epoch1)
    assert epoch0 != epoch1  # shards come in another order


def test_fsspec_urls_are_streamed_and_resumed(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    for s in range(2):
        local = tmp_path / f"{s}.tar"
        _write_tarwriter(str(local), [(f"{s}{i:03d}", {"jpg": b"i", "txt": f"{s}-{i}".encode()}) for i in range(30)])
        fs.pipe(f"/remote/{s}.tar", local.read_bytes())
    shard_list = shards.resolve_shards("memory://remote/{0..1}.tar")
    assert [s.caption for s in webdataset.iter_shard(shard_list.urls[1])][:2] == ["1-0", "1-1"]
    ds = tar_dataset.TarShardDataset(shard_list, resampled=False, shuffle_window=4, shards_in_flight=2)
    it = iter(ds)
    reference = [next(it).caption for _ in range(80)]
    assert sorted(reference[:60]) == sorted(f"{s}-{i}" for s in range(2) for i in range(30))
    it = iter(ds)
    for _ in range(37):
        next(it)
    resumed = iter(ds)
    resumed.set_state(it.get_state())
    assert [next(resumed).caption for _ in range(20)] == reference[37:57]


def test_resampled_stream_respects_source_weights(tmp_path):
    for source in ("a", "b"):
        (tmp_path / source).mkdir()
        for s in range(4):
            _write_tarwriter(str(tmp_path / source / f"{s}.tar"),
                             [(f"{s}{i}", {"jpg": b"i", "txt": source.encode()}) for i in range(5)])
    shard_list = shards.resolve_shards(f"{tmp_path}/a/{{0..3}}.tar::{tmp_path}/b/{{0..3}}.tar", "1::3")
    it = iter(tar_dataset.TarShardDataset(shard_list, resampled=True, seed=1, shuffle_window=50, shards_in_flight=2))
    captions = [next(it).caption for _ in range(4000)]
    # 800 shard draws, each from source b with probability 3/4: standard deviation of the share ~0.015.
    assert abs(captions.count("b") / 4000 - 0.75) < 0.05
