"""make_shards writes img2dataset-format shards (checked with plain tarfile); check summarises shards."""

import gzip
import hashlib
import io
import json
import os
import struct
import subprocess
import sys
import tarfile
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from clip_jax import data
from clip_jax.data import check, fashion_mnist, make_shards, write_once
from clip_jax.runtime import ownership

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
    assert sorted(os.listdir(out)) == sorted([ownership.MANIFEST] + [f"{s:05d}{ext}" for s in range(3)
                                                                     for ext in (".tar", "_stats.json", ".parquet")])
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


def _bad_files_folder(tmp_path):
    """Two good captioned images beside one of each bad kind: an empty .jpg, a .jpg that is text, a JPEG cut short
    (its header whole), and a good image whose .txt caption is Latin-1."""
    folder = tmp_path / "mine"
    folder.mkdir()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(folder / "good1.jpg")
    Image.new("RGB", (30, 40), (10, 200, 10)).save(folder / "good2.png")
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "text.jpg").write_bytes(b"a caption saved under the wrong name")
    whole = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8)).save(whole, "JPEG")
    (folder / "cut.jpg").write_bytes(whole.getvalue()[:len(whole.getvalue()) // 2])
    Image.open(folder / "cut.jpg")  # its header reads: only decoding the whole image finds it cut short
    Image.new("RGB", (20, 20), 0).save(folder / "latin1.jpg")
    for name in ("good1", "good2", "empty", "text", "cut"):
        (folder / f"{name}.txt").write_text(f"a photo called {name}")
    (folder / "latin1.txt").write_bytes("une photo d'été".encode("latin-1"))
    return folder


def _written_captions(out):
    samples, _ = _read_tar(out / "00000.tar")
    for files in samples.values():
        image = files.get("jpg", files.get("png"))
        Image.open(io.BytesIO(image)).load()  # every image written decodes whole
    return sorted(files["txt"].decode() for files in samples.values())


def test_bad_files_in_an_image_folder_are_counted_named_and_left_out(tmp_path, capsys):
    folder, out = _bad_files_folder(tmp_path), tmp_path / "out"
    assert make_shards.main(["folder", "--images", str(folder), "--out", str(out)]) == 0
    assert _written_captions(out) == ["a photo called good1", "a photo called good2"]
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "left out 4 bad files of 6 images" in warning, warning
    for told in ("1 empty (empty.jpg)", "1 not an image (text.jpg)", "1 cut short or damaged (cut.jpg)",
                 "1 caption not UTF-8 (latin1.txt)"):
        assert told in warning, warning


def test_a_captions_file_line_that_is_not_utf8_is_left_out(tmp_path, capsys):
    folder, out = _bad_files_folder(tmp_path), tmp_path / "out"
    (tmp_path / "captions.tsv").write_bytes(b"image\tcaption\ngood1.jpg\tthe first\ngood2.png\tla deuxi\xe8me\n"
                                            b"cut.jpg\tcut\nlatin1.jpg\tfine here\n")
    assert make_shards.main(["folder", "--images", str(folder), "--captions", str(tmp_path / "captions.tsv"),
                             "--out", str(out)]) == 0
    assert _written_captions(out) == ["fine here", "the first"]
    warning = capsys.readouterr().err
    assert "1 caption not UTF-8 (captions.tsv:3)" in warning and "1 cut short or damaged (cut.jpg)" in warning
    assert "2 of 6 images have no caption" in warning  # empty.jpg and text.jpg: not in the file


@pytest.mark.parametrize("out_exists", [False, True])
def test_a_folder_of_bad_files_only_is_one_line_and_leaves_no_folder_it_made(tmp_path, capsys, out_exists):
    folder = _bad_files_folder(tmp_path)
    for name in ("good1.jpg", "good2.png", "latin1.jpg"):
        (folder / name).unlink()
    out = tmp_path / "new" / "out"
    if out_exists:
        out.mkdir(parents=True)
    assert make_shards.main(["folder", "--images", str(folder), "--out", str(out)]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith(f"error: no usable image under {folder}: 3 bad files"), error
    assert "1 empty (empty.jpg)" in error and "cut.jpg" in error and "text.jpg" in error
    assert sorted(os.listdir(tmp_path)) == (["mine", "new"] if out_exists else ["mine"])  # an --out given stays
    assert not out_exists or os.listdir(out) == []


@pytest.mark.parametrize("per_shard", [2, 1])
def test_a_writer_stopped_before_its_first_shard_is_complete_leaves_no_folder_it_made(tmp_path, per_shard):
    def samples():
        yield make_shards.Sample(b"x", "jpg", "one", "u", 1, 1, 1, 1)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        make_shards.write_shards(samples(), str(tmp_path / "a" / "b"), samples_per_shard=per_shard)
    kept = [ownership.MANIFEST, "00000.parquet", "00000.tar", "00000_stats.json"] if per_shard == 1 else None
    assert (sorted(os.listdir(tmp_path / "a" / "b")) == kept) if kept else os.listdir(tmp_path) == []


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


@pytest.mark.slow
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


def _tiny_fashion_mnist(root, num_images):
    """A Fashion-MNIST folder of ``num_images`` random images per split, in the idx format of the real one."""
    rng = np.random.default_rng(0)
    os.makedirs(root, exist_ok=True)
    for prefix in ("train", "t10k"):
        images = rng.integers(0, 256, (num_images, 28, 28), np.uint8)
        with gzip.open(os.path.join(root, f"{prefix}-images-idx3-ubyte.gz"), "wb") as f:
            f.write(struct.pack(">HBBIII", 0, 8, 3, num_images, 28, 28) + images.tobytes())
        with gzip.open(os.path.join(root, f"{prefix}-labels-idx1-ubyte.gz"), "wb") as f:
            f.write(struct.pack(">HBBI", 0, 8, 1, num_images) + rng.integers(0, 10, num_images, np.uint8).tobytes())
    return str(root)


# Waits for the go file, so that the processes ask for the shards at the same moment.
_WRITER = """
import logging, os, sys, time
from clip_jax.data import make_shards
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s", force=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.001)
print(make_shards.fashion_mnist_shards(sys.argv[2], "train", root=sys.argv[3], samples_per_shard=300))
"""


@pytest.mark.subprocess
@pytest.mark.slow
def test_processes_asking_for_the_demo_shards_together_get_one_set_written_once(tmp_path):
    root = _tiny_fashion_mnist(tmp_path / "fmnist", 3000)
    out, go = tmp_path / "shards", tmp_path / "go"
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(go), str(out), root], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for _ in range(3)]
    time.sleep(3)  # the imports
    go.touch()
    outputs = [w.communicate(timeout=120)[0] for w in writers]
    assert [w.returncode for w in writers] == [0, 0, 0], outputs
    pattern = f"{out}/{{00000..00009}}.tar"
    assert all(o.strip().endswith(pattern) for o in outputs), outputs
    assert sum("writing 10 shards" in o for o in outputs) == 1, outputs
    assert data.count_samples(data.resolve_shards(pattern)) == 3000
    assert sum(len(_read_tar(f"{out}/{s:05d}.tar")[0]) for s in range(10)) == 3000
    assert sorted(os.listdir(out)) == sorted([write_once.LOCK_FILE, ownership.MANIFEST] + [
        f"{s:05d}{ext}" for s in range(10) for ext in (".tar", "_stats.json", ".parquet")])


def test_a_writer_killed_half_way_leaves_no_complete_looking_set(tmp_path, monkeypatch):
    root = _tiny_fashion_mnist(tmp_path / "fmnist", 100)
    out, write_shards = tmp_path / "shards", make_shards.write_shards

    def dies_after_two_shards(samples, folder, samples_per_shard, **options):  # options: the stop check
        write_shards(list(samples)[:2 * samples_per_shard], folder, samples_per_shard, **options)
        raise KeyboardInterrupt

    monkeypatch.setattr(make_shards, "write_shards", dies_after_two_shards)
    with pytest.raises(KeyboardInterrupt):
        make_shards.fashion_mnist_shards(str(out), "train", root=root, samples_per_shard=25)
    assert os.listdir(out) == [write_once.LOCK_FILE]
    monkeypatch.undo()
    assert make_shards.fashion_mnist_shards(str(out), "train", root=root, samples_per_shard=25).endswith(
        "{00000..00003}.tar")


def test_a_run_config_writes_its_missing_shards_from_fashion_mnist(tmp_path, monkeypatch):
    monkeypatch.setattr(fashion_mnist, "DEFAULT_DIR", _tiny_fashion_mnist(tmp_path / "fmnist", 100))
    pattern = f"{tmp_path}/fashion-mnist/train/{{00000..00003}}.tar"  # named as the demo's own folder
    cfg = data.TrainDataConfig(shards=pattern, train_num_samples=None, make_from="fashion-mnist")
    shards = data.resolve_train_shards(cfg)
    assert len(shards) == 4 and data.count_samples(shards) == 100  # 25 a shard, as many shards as the pattern names
    assert data.steps_per_epoch(cfg, 10, shards) == 10
    with pytest.raises(ValueError, match="name shards 00000.tar, 00001.tar"):
        data.resolve_train_shards(data.TrainDataConfig(shards=f"{tmp_path}/{{1..3}}.tar", make_from="fashion-mnist"))
    with pytest.raises(ValueError, match="make_train_data='mnist': the trainer can write only 'fashion-mnist'"):
        data.resolve_train_shards(data.TrainDataConfig(shards=pattern, make_from="mnist"))


@pytest.mark.parametrize("folder", ["my-data", "fashion-mnist/trian", "empty"])
def test_the_demo_writer_fills_no_folder_but_the_demos_own(tmp_path, monkeypatch, folder):
    """The demo's config copied for one's own shards with make_train_data left on: a mistyped or new path, or an
    empty folder of one's own, is refused in one line naming it and the fix, and nothing is written there."""
    monkeypatch.setattr(fashion_mnist, "DEFAULT_DIR", _tiny_fashion_mnist(tmp_path / "fmnist", 100))
    if folder == "empty":
        (tmp_path / folder).mkdir()
    cfg = data.TrainDataConfig(shards=f"{tmp_path}/{folder}/{{00000..00003}}.tar", make_from="fashion-mnist")
    with pytest.raises(ValueError) as refused:
        data.resolve_train_shards(cfg)
    message = str(refused.value)
    assert "\n" not in message and str(tmp_path / folder) in message, message
    assert "--config.make_train_data=''" in message and "fashion-mnist/train" in message, message
    assert sorted(os.listdir(tmp_path)) == sorted(["fmnist"] + (["empty"] if folder == "empty" else []))
    assert folder != "empty" or os.listdir(tmp_path / folder) == []


def test_the_demo_configs_folder_is_the_one_the_demo_writer_fills():
    import importlib.util

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("demo", os.path.join(repo, "configs", "demo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert make_shards.is_demo_folder(os.path.dirname(module.get_config().train_data))


# Fails on any file opened for writing or folder made while configs/demo.py loads.
_LOAD_DEMO = """
import os, sys
WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT
def refuse(event, args):
    if (event == "open" and isinstance(args[2], int) and args[2] & WRITES) or event == "os.mkdir":
        raise AssertionError(f"loading configs/demo.py wrote: {event} {args[:2]}")
from ml_collections import config_flags  # noqa: F401 - what the trainer loads configs with, imported beforehand
import clip_jax.run_config
sys.addaudithook(refuse)
import importlib.util
spec = importlib.util.spec_from_file_location("demo", "configs/demo.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
config = module.get_config()
assert config.make_train_data == "fashion-mnist" and config.train_data.endswith("{00000..00011}.tar")
assert "clip_jax.data" not in sys.modules, "the run config imports the data package"
print("ok")
"""


@pytest.mark.subprocess
def test_loading_the_demo_config_writes_nothing_and_imports_no_data_package():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-B", "-c", _LOAD_DEMO], cwd=repo, capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-3000:]
