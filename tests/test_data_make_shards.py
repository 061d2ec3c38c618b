"""make_shards writes img2dataset-format shards (checked with plain tarfile); check summarises shards."""

import gzip
import hashlib
import io
import json
import os
import tarfile

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from clip_jax import data
from clip_jax.data import check, fashion_mnist, make_shards

FMNIST = fashion_mnist.DEFAULT_DIR


def _labels(split):
    """Labels straight from the idx file: 8-byte header, then one byte per label."""
    with gzip.open(os.path.join(FMNIST, f"{'train' if split == 'train' else 't10k'}-labels-idx1-ubyte.gz")) as f:
        return np.frombuffer(f.read()[8:], np.uint8)


def _read_tar(path):
    """{key: {ext: bytes}} and member names in order, with the standard library's reader."""
    samples, names = {}, []
    with tarfile.open(path) as tar:
        for member in tar:
            names.append(member.name)
            key, ext = member.name.split(".", 1)
            samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    return samples, names


def test_fashion_mnist_shards_in_img2dataset_format(tmp_path):
    out = tmp_path / "fm"
    assert make_shards.main(["fashion-mnist", "--out", str(out), "--split", "test", "--limit", "250",
                             "--samples-per-shard", "100"]) == 0
    assert sorted(os.listdir(out)) == sorted(f"{s:05d}{ext}" for s in range(3)
                                             for ext in (".tar", "_stats.json", ".parquet"))
    labels = _labels("test")
    index = 0
    for shard in range(3):
        samples, names = _read_tar(out / f"{shard:05d}.tar")
        expected_rows = 100 if shard < 2 else 50
        assert len(samples) == expected_rows and len(names) == 3 * expected_rows
        for row, (key, files) in enumerate(samples.items()):
            assert key == f"{shard * 10_000 + row:09d}" and len(key) == 9
            assert set(files) == {"jpg", "txt", "json"}
            meta = json.loads(files["json"])
            assert set(meta) >= {"url", "caption", "key", "status", "width", "height", "original_width",
                                 "original_height", "exif", "sha256"}
            assert meta["key"] == key and meta["caption"] == files["txt"].decode() and meta["status"] == "success"
            assert meta["sha256"] == hashlib.sha256(files["jpg"]).hexdigest()
            image = Image.open(io.BytesIO(files["jpg"]))
            assert image.mode == "L" and image.size == (28, 28) == (meta["width"], meta["height"])
            caption = files["txt"].decode()
            assert not caption.endswith("\n")
            assert any(synonym in caption for synonym in fashion_mnist.SYNONYMS[labels[index]])
            index += 1
        stats = json.loads((out / f"{shard:05d}_stats.json").read_text())
        assert stats["count"] == stats["successes"] == expected_rows
        table = pq.read_table(out / f"{shard:05d}.parquet").to_pylist()
        assert [r["key"] for r in table] == list(samples)
    cfg = data.TrainDataConfig(shards=f"{out}/{{00000..00002}}.tar")
    assert data.count_samples(data.resolve_shards(cfg.shards)) == 250
    assert data.steps_per_epoch(cfg, 50) == 5 and data.steps_per_epoch(cfg, 60) == 5  # ceil(250 / 60)


def test_captions_use_several_templates_and_synonyms():
    captions = fashion_mnist.captions(np.arange(2000) % 10, seed=0)
    assert len({c for c in captions if "boot" in c}) >= 12
    assert all(c[0].islower() or c[0].isdigit() or c.startswith("this") for c in captions)
    assert fashion_mnist.zeroshot_prompts("ankle boot")[0] == "a photo of an ankle boot."
    assert fashion_mnist.zeroshot_prompts("trousers")[0] == "a photo of trousers."
    assert len(fashion_mnist.CLASS_NAMES) == len(fashion_mnist.SYNONYMS) == 10


def test_missing_fashion_mnist_tells_how_to_install_it(tmp_path, capsys):
    assert make_shards.main(["fashion-mnist", "--root", str(tmp_path), "--out", str(tmp_path / "o")]) == 1
    assert "apt-get install dataset-fashion-mnist" in capsys.readouterr().err


def _folder(tmp_path):
    folder = tmp_path / "photos"
    (folder / "cats").mkdir(parents=True)
    Image.new("RGB", (40, 30), (200, 10, 10)).save(folder / "cats" / "a.jpg")
    Image.new("RGB", (30, 60), (10, 200, 10)).save(folder / "cats" / "b.png")
    Image.new("L", (50, 50), 90).save(folder / "c.jpg")
    return folder


def test_image_folder_with_captions_file_and_resizing(tmp_path, capsys):
    folder = _folder(tmp_path)
    (tmp_path / "captions.tsv").write_text("image\tcaption\ncats/a.jpg\ta red cat\ncats/b.png\ta green cat\n")
    out = tmp_path / "out"
    assert make_shards.main(["folder", "--images", str(folder), "--captions", str(tmp_path / "captions.tsv"),
                             "--out", str(out)]) == 0
    samples, _ = _read_tar(out / "00000.tar")
    assert [(s["txt"].decode(), sorted(s)) for s in samples.values()] == [
        ("a red cat", ["jpg", "json", "txt"]), ("a green cat", ["json", "png", "txt"])]
    assert "1 of 3 images have no caption" in capsys.readouterr().err
    assert samples["000000001"]["png"] == (folder / "cats" / "b.png").read_bytes()  # original bytes kept

    (folder / "c.txt").write_text("a grey square\n")
    out2 = tmp_path / "out2"
    assert make_shards.main(["folder", "--images", str(folder), "--out", str(out2), "--image-size", "20"]) == 0
    samples, _ = _read_tar(out2 / "00000.tar")
    (only,) = samples.values()
    meta = json.loads(only["json"])
    assert only["txt"] == b"a grey square"
    assert (meta["width"], meta["height"], meta["original_width"]) == (20, 20, 50)
    assert make_shards.main(["folder", "--images", str(tmp_path / "nope"), "--out", str(out2)]) == 1


def test_check_summarises_good_and_bad_shards(tmp_path, capsys):
    out = tmp_path / "fm"
    make_shards.main(["fashion-mnist", "--out", str(out), "--split", "train", "--limit", "60",
                      "--samples-per-shard", "30"])
    long_caption = " ".join(["word"] * 100)
    with tarfile.open(out / "00002.tar", "w") as tar:
        for name, payload in [("000020000.jpg", b"not a jpeg"), ("000020000.txt", b"corrupt"),
                              ("000020001.json", b"{}"),
                              ("000020002.jpg", _grey_jpeg()),
                              ("000020002.txt", long_caption.encode())]:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    (out / "00003.tar").write_bytes((out / "00000.tar").read_bytes()[:5000])  # truncated copy
    assert check.main([f"{out}/{{00000..00003}}.tar"]) == 0
    report = capsys.readouterr().out
    assert "shards            4 read, 1 bad" in report
    assert "samples           62 good, 2 skipped" in report  # 60 + 1 + the truncated copy's first complete one
    assert "json_only       1" in report and "corrupt_image   1" in report and "truncated_shard 1" in report
    assert "truncated at 77   1 captions" in report
    assert check.main([f"{out}/{{00000..00003}}.tar", "--strict"]) == 1
    capsys.readouterr()
    assert check.main([f"{tmp_path}/none/{{0..2}}.tar"]) == 1
    assert "matches no file" in capsys.readouterr().err


def _grey_jpeg():
    buffer = io.BytesIO()
    Image.new("L", (28, 28), 40).save(buffer, "JPEG")
    return buffer.getvalue()


@pytest.mark.parametrize("rows", [0, 10_001])
def test_shard_size_limits(tmp_path, rows):
    with pytest.raises(ValueError, match="samples_per_shard"):
        make_shards.write_shards([], str(tmp_path), samples_per_shard=rows)


def test_fashion_mnist_shards_are_written_once(tmp_path):
    pattern = make_shards.fashion_mnist_shards(str(tmp_path), "test", samples_per_shard=4000)
    assert pattern == f"{tmp_path}/{{00000..00002}}.tar"
    assert data.count_samples(data.resolve_shards(pattern)) == 10_000
    before = (tmp_path / "00000.tar").stat().st_mtime_ns
    assert make_shards.fashion_mnist_shards(str(tmp_path), "test", samples_per_shard=4000) == pattern
    assert (tmp_path / "00000.tar").stat().st_mtime_ns == before


def test_check_distributions_agree_with_numpy():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 300, 1001), rng.integers(5, 100, 10), np.array([], np.int64)]
    merged = check.Distribution(4096)
    for part in parts:
        one = check.Distribution(4096)
        one.add(part)
        merged = merged + one
    values = np.concatenate(parts)
    assert merged.spread() == (f"min {values.min()}  median {int(np.median(values))}  mean {values.mean():.1f}  "
                               f"max {values.max()}")
    counts = np.histogram(values, [0, 100, 200, 10**6])[0]
    assert merged.histogram((0, 100, 200)) == "  ".join(
        f"{label}: {n}" for label, n in zip(["0-99", "100-199", ">=200"], counts))
