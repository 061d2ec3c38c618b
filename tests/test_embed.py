"""`python -m clip_jax.embed` writes what clip-retrieval's inference writes (img_emb/, text_emb/, metadata/, parts
numbered its way, row for row), with OpenCLIP's own features of the same samples; bad samples are skipped and
counted, a killed or partly deleted output continues with the parts missing, and a folder of other embeddings is
refused in one line."""

import io
import json
import os
import tarfile

import numpy as np
import open_clip
import pyarrow.parquet as pq
import pytest
import torch
from open_clip_reference import TINY_77, open_clip_model, state_dict_numpy
from PIL import Image
from safetensors.numpy import save_file
from xla_flags import xla_flags

from clip_jax.evaluation import embed, embed_parts, embed_writer

HALF = (0.5, 0.5, 0.5)
CAPTIONS = ["a red shoe on grass", "two cats", "the sea at night, photographed from a boat", "a bag",
            "an old map of a city", "sunflowers", "a bicycle leaning on a wall", "snow"]


def write_export(folder, seed: int) -> str:
    """An OpenCLIP model folder written by OpenCLIP's own state_dict (not by clip_jax's export)."""
    os.makedirs(folder)
    model = open_clip_model(TINY_77, seed=seed)
    save_file({k: np.ascontiguousarray(v) for k, v in state_dict_numpy(model).items()},
              os.path.join(folder, "open_clip_model.safetensors"))
    preprocess = {"size": TINY_77["vision_cfg"]["image_size"], "mode": "RGB", "mean": list(HALF), "std": list(HALF),
                  "interpolation": "bicubic", "resize_mode": "shortest"}
    with open(os.path.join(folder, "open_clip_config.json"), "w") as f:
        json.dump({"model_cfg": TINY_77, "preprocess_cfg": preprocess}, f)
    return str(folder)


def image_bytes(seed: int, fmt: str = "JPEG") -> bytes:
    """A smooth picture of its own size (landscape, portrait; one greyscale)."""
    rng = np.random.default_rng(seed)
    width, height = int(rng.integers(30, 90)), int(rng.integers(30, 90))
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([(x * rng.uniform(1, 4) + y * rng.uniform(0, 3) + rng.uniform(0, 255)) % 256
                       for _ in range(3)], -1).astype(np.uint8)
    image = Image.fromarray(pixels)
    if seed % 5 == 4:
        image = image.convert("L")
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def samples(count: int):
    """(key, image bytes, caption, json fields) of good samples."""
    return [(f"{i:09d}", image_bytes(i, "PNG" if i % 3 == 0 else "JPEG"), CAPTIONS[i % len(CAPTIONS)],
             {"url": f"https://example.com/{i}.jpg", "width": 10 + i, "exif": {"camera": f"c{i % 2}"}})
            for i in range(count)]


def write_tar(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    good = samples(10)
    shards = []  # 3 shards: 4, 4 and 2 good samples; a corrupt image and a sample without caption in the first
    for shard, rows in enumerate((good[0:4], good[4:8], good[8:10])):
        members = []
        for key, image, caption, fields in rows:
            members += [(f"{key}.jpg", image), (f"{key}.txt", caption.encode()),
                        (f"{key}.json", json.dumps(fields).encode())]
        if shard == 0:
            members += [("bad000001.jpg", b"not an image"), ("bad000001.txt", b"broken"),
                        ("bad000002.jpg", image_bytes(99))]
        shards.append(str(root / f"{shard:05d}.tar"))
        write_tar(shards[-1], members)
    folder = root / "files"
    (folder / "sub").mkdir(parents=True)
    for i, (key, image, caption, fields) in enumerate(good):
        where = folder / "sub" if i % 2 else folder
        (where / f"{key}.{'png' if i % 3 == 0 else 'jpg'}").write_bytes(image)
        (where / f"{key}.txt").write_text(caption)
        (where / f"{key}.json").write_text(json.dumps(fields))
    (folder / "lonely.jpg").write_bytes(image_bytes(50))  # no caption: not a sample
    (folder / "broken.jpg").write_bytes(b"\xff\xd8 truncated")
    (folder / "broken.txt").write_text("a broken image")
    return {"root": root, "pattern": str(root / "{00000..00002}.tar"), "folder": str(folder), "samples": good,
            "model": write_export(root / "model", seed=0), "other_model": write_export(root / "other", seed=1)}


@pytest.fixture(scope="module")
def reference(data):
    """OpenCLIP's own normalised features of every good sample, by key: its preprocessing, tokenizer, towers."""
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{data['model']}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{data['model']}")
    keys = [key for key, *_ in data["samples"]]
    images = torch.stack([preprocess(Image.open(io.BytesIO(image))) for _, image, _, _ in data["samples"]])
    with torch.no_grad():
        image_f = model.eval().encode_image(images, normalize=True).numpy()
        text_f = model.encode_text(tokenizer([caption for _, _, caption, _ in data["samples"]]), normalize=True).numpy()
    return {key: (i, t) for key, i, t in zip(keys, image_f, text_f)}


def run_embed(*args) -> int:
    return embed.main([str(a) for a in args])


def read_parts(folder, kind="img_emb"):
    """{number: (image embeddings, text embeddings, metadata rows)} of every part written."""
    parts = {}
    for name in sorted(os.listdir(os.path.join(folder, "metadata"))):
        number = name.removeprefix("metadata_").removesuffix(".parquet")
        image = np.load(os.path.join(folder, "img_emb", f"img_emb_{number}.npy"))
        text = np.load(os.path.join(folder, "text_emb", f"text_emb_{number}.npy"))
        parts[number] = (image, text, pq.read_table(os.path.join(folder, "metadata", name)).to_pylist())
    return parts


def assert_open_clip_features(parts, reference, key_of=lambda row: row["image_path"]):
    seen = 0
    for image, text, rows in parts.values():
        assert image.dtype == text.dtype == np.float16 and len(image) == len(text) == len(rows)
        np.testing.assert_allclose(np.linalg.norm(image.astype(np.float32), axis=1), 1, atol=2e-3)
        for row, image_f, text_f in zip(rows, image.astype(np.float32), text.astype(np.float32)):
            expected_image, expected_text = reference[key_of(row)]
            assert image_f @ expected_image / np.linalg.norm(image_f) >= 0.999, row
            assert text_f @ expected_text / np.linalg.norm(text_f) >= 0.999, row
            seen += 1
    assert seen == len(reference)


def test_webdataset_parts_hold_open_clips_features_row_for_row_with_the_metadata(data, reference, tmp_path,
                                                                                capsys):
    out = tmp_path / "out"
    # 3 shards counted as 4 samples each, 5 samples a part: 3 parts, part i reading shard i.
    assert run_embed("--input_dataset", data["pattern"], "--input_format", "webdataset", "--output_folder", out,
                     "--clip_model", data["model"], "--enable_metadata", "True", "--write_batch_size", 5,
                     "--wds_number_file_per_input_file", 4, "--batch_size", 3) == 0
    printed = capsys.readouterr()
    assert "corrupt_image 1" in printed.out and "no_caption 1" in printed.out
    assert "samples/s" in printed.err
    parts = read_parts(out)
    assert sorted(parts) == ["0", "1", "2"]
    assert [row["image_path"] for row in parts["0"][2]] == [key for key, *_ in data["samples"][:4]]
    assert [len(p[2]) for p in parts.values()] == [4, 4, 2]
    first = parts["1"][2][0]
    assert list(first) == ["image_path", "caption", "url", "width", "exif.camera"]
    assert first == {"image_path": "000000004", "caption": CAPTIONS[4], "url": "https://example.com/4.jpg",
                     "width": 14, "exif.camera": "c0"}
    assert_open_clip_features(parts, reference)


def test_a_files_folder_is_embedded_by_key_order_with_the_image_paths(data, reference, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_embed("--input_dataset", data["folder"], "--output_folder", out, "--pretrained", data["model"],
                     "--write_batch_size", 4, "--batch_size", 8) == 0
    assert "corrupt_image 1" in capsys.readouterr().out
    parts = read_parts(out)
    assert sorted(parts) == ["0", "1", "2"]  # 11 samples with captions (one does not decode), 4 a part
    keys = sorted(["broken"] + [key if i % 2 == 0 else f"sub/{key}" for i, (key, *_) in enumerate(data["samples"])])
    assert [os.path.relpath(row["image_path"], data["folder"]).rsplit(".", 1)[0] for row in parts["1"][2]] == \
        [k for k in keys[1::3] if k != "broken"]
    assert list(parts["0"][2][0]) == ["image_path", "caption"]  # no .json fields without --enable_metadata
    assert_open_clip_features(parts, reference, key_of=lambda row: os.path.basename(row["image_path"])[:9])


def test_a_killed_run_and_a_deleted_part_are_completed_and_the_parts_written_are_kept(data, tmp_path,
                                                                                    monkeypatch):
    out = tmp_path / "out"
    args = ["--input_dataset", data["pattern"], "--input_format", "webdataset", "--output_folder", out,
            "--clip_model", data["model"], "--write_batch_size", 4, "--wds_number_file_per_input_file", 4]
    write_part, written = embed_writer.write_part, []

    def killed_after_one_part(paths, **kwargs):
        if written:  # the second part dies between its embeddings and its metadata
            embed_writer._replace(paths["img_emb"], b"half")
            raise KeyboardInterrupt
        written.append(paths)
        write_part(paths, **kwargs)

    monkeypatch.setattr(embed_writer, "write_part", killed_after_one_part)
    assert run_embed(*args) == 130  # Ctrl-C: one line, no traceback (tests/test_entry.py)
    assert sorted(os.listdir(out / "metadata")) == ["metadata_0.parquet"]
    (out / "text_emb" / ".clip_jax-partial-text_emb_1.npy.99999").write_bytes(b"a killed run's half file")
    monkeypatch.setattr(embed_writer, "write_part", write_part)
    first = os.stat(out / "img_emb" / "img_emb_0.npy").st_mtime_ns
    assert run_embed(*args) == 0
    assert os.stat(out / "img_emb" / "img_emb_0.npy").st_mtime_ns == first  # kept, not written again
    complete = read_parts(out)
    assert sorted(complete) == ["0", "1", "2"]

    os.remove(out / "text_emb" / "text_emb_1.npy")
    assert run_embed(*args) == 0
    again = read_parts(out)
    for number in complete:
        np.testing.assert_array_equal(again[number][0], complete[number][0])
        np.testing.assert_array_equal(again[number][1], complete[number][1])
        assert again[number][2] == complete[number][2]
    assert not [name for kind in ("img_emb", "text_emb", "metadata") for name in os.listdir(out / kind)
                if name.startswith(".")]


def test_parts_written_to_a_bucket_equal_a_local_folders_and_a_second_run_keeps_them(data, tmp_path, capsys):
    import local_s3

    args = ["--input_dataset", data["pattern"], "--input_format", "webdataset", "--clip_model", data["model"],
            "--enable_metadata", "True", "--write_batch_size", 5, "--wds_number_file_per_input_file", 4]
    assert run_embed(*args, "--output_folder", tmp_path / "local") == 0
    with local_s3.moto_server() as endpoint, local_s3.bucket_on(endpoint, "embeddings") as s3:
        assert run_embed(*args, "--output_folder", "s3://embeddings/laion/out") == 0
        objects = local_s3.keys(s3, "embeddings", "laion/out/")
        for key in objects:  # read back straight from the server, not through the code under test
            path = tmp_path / "bucket" / key.removeprefix("laion/out/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(s3.get_object(Bucket="embeddings", Key=key)["Body"].read())
        capsys.readouterr()
        assert run_embed(*args, "--output_folder", "s3://embeddings/laion/out") == 0
        assert "into 0 parts of 3 (3 written before kept)" in capsys.readouterr().out
        assert local_s3.keys(s3, "embeddings", "laion/out/") == objects
        assert run_embed(*args, "--output_folder", "s3://no-such-bucket/out") == 2
        assert "bucket s3://no-such-bucket (of s3://no-such-bucket/out) does not exist" in capsys.readouterr().err
    assert not [key for key in objects if ".clip_jax-partial-" in key]
    local, bucket = read_parts(tmp_path / "local"), read_parts(tmp_path / "bucket")
    assert sorted(bucket) == sorted(local) == ["0", "1", "2"]
    for number, (image, text, rows) in local.items():
        np.testing.assert_array_equal(bucket[number][0], image)
        np.testing.assert_array_equal(bucket[number][1], text)
        assert bucket[number][2] == rows


def test_a_folder_of_other_embeddings_or_a_mistyped_flag_is_refused_in_one_line(data, tmp_path, capsys):
    out = tmp_path / "out"
    base = ["--input_dataset", data["pattern"], "--input_format", "webdataset", "--output_folder", out,
            "--write_batch_size", 40000]
    assert run_embed(*base, "--clip_model", data["model"], "--enable_text", "False") == 0
    before = (out / "img_emb" / "img_emb_0.npy").read_bytes()
    capsys.readouterr()

    def refused(*args) -> str:
        assert run_embed(*args) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        return lines[0]

    assert "holds the embeddings of another model" in refused(*base, "--clip_model", data["other_model"],
                                                              "--enable_text", "False")
    assert "other settings" in refused(*base, "--clip_model", data["model"])  # text embeddings now too
    assert (out / "img_emb" / "img_emb_0.npy").read_bytes() == before

    theirs = tmp_path / "theirs"  # clip-retrieval's own output: not clip_jax's to replace
    (theirs / "img_emb").mkdir(parents=True)
    (theirs / "img_emb" / "img_emb_0.npy").write_bytes(b"x")
    assert "clip_jax did not write (img_emb)" in refused(*base[:-3], theirs, "--clip_model", data["model"])
    assert "--input_format 'webdatset'" in refused("--input_dataset", data["pattern"], "--input_format",
                                                   "webdatset", "--output_folder", out, "--clip_model",
                                                   data["model"])
    assert "no such folder" in refused("--input_dataset", data["root"] / "nowhere", "--output_folder", out,
                                       "--clip_model", data["model"])
    assert "shards do not exist" in refused("--input_dataset", data["root"] / "{00000..00009}.tar",
                                            "--input_format", "webdataset", "--output_folder", out,
                                            "--clip_model", data["model"])
    assert "does not exist" in refused(*base, "--clip_model", data["root"] / "no-model")


def test_parts_are_numbered_and_shared_out_as_clip_retrieval_numbers_them():
    assert embed_parts.partition_count(10, 5) == 2 and embed_parts.partition_count(11, 5) == 3
    assert [embed_parts.part_number(3, n) for n in (9, 10, 99, 100)] == ["3", "03", "03", "003"]
    assert embed_parts.part_inputs(list("abcdefg"), 1, 3) == ["b", "e"]
    shares = [list(embed_parts.process_parts(10, p, 4)) for p in range(4)]
    assert shares == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_processes_write_their_own_parts_of_one_output(data, tmp_path):
    """Ranks joined as launch/local.py joins them, 2 simulated devices each: rank 0 writes parts 0 and 2, rank 1
    part 1, and the output equals one process's."""
    import subprocess
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "launch"))
    import local as local_launch

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["--input_dataset", data["pattern"], "--input_format", "webdataset", "--clip_model", data["model"],
            "--write_batch_size", 4, "--wds_number_file_per_input_file", 4, "--batch_size", 4]
    assert run_embed(*args, "--output_folder", tmp_path / "one") == 0
    port, ranks = local_launch.free_port(), []
    for rank in range(2):
        env = local_launch.rank_env(os.environ, rank, 2, port, 2, 60)
        env["XLA_FLAGS"] = xla_flags(2)
        env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")])
        ranks.append(subprocess.Popen([sys.executable, "-m", "clip_jax.embed", *map(str, args), "--output_folder",
                                       str(tmp_path / "two")], env=env, cwd=repo, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        logs = [rank.communicate(timeout=240)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], logs
    assert "part 0 written" in logs[0] and "part 2 written" in logs[0] and "part 1 written" in logs[1], logs
    assert "embed (process 1/2)" in logs[1]
    one, two = read_parts(tmp_path / "one"), read_parts(tmp_path / "two")
    assert sorted(two) == sorted(one) == ["0", "1", "2"]
    for number in one:
        np.testing.assert_allclose(two[number][0], one[number][0], atol=2e-3)
        np.testing.assert_allclose(two[number][1], one[number][1], atol=2e-3)
        assert two[number][2] == one[number][2]


def test_texts_alone_with_the_caption_from_a_json_field(data, tmp_path, reference):
    out = tmp_path / "out"
    assert run_embed("--input_dataset", data["pattern"], "--input_format", "webdataset", "--output_folder", out,
                     "--clip_model", data["model"], "--enable_image", "False", "--wds_caption_key", "json:url",
                     "--write_batch_size", 100000) == 0
    assert sorted(os.listdir(out)) == [".clip_jax-embed.json", ".clip_jax-written", "metadata", "text_emb"]
    rows = pq.read_table(out / "metadata" / "metadata_0.parquet").to_pylist()
    assert rows == [{"caption": f"https://example.com/{i}.jpg"} for i in range(10)]
    texts = np.load(out / "text_emb" / "text_emb_0.npy").astype(np.float32)
    model = open_clip.create_model_and_transforms(f"local-dir:{data['model']}")[0].eval()
    with torch.no_grad():
        expected = model.encode_text(open_clip.get_tokenizer(f"local-dir:{data['model']}")(
            [row["caption"] for row in rows]), normalize=True).numpy()
    assert np.all(np.sum(texts * expected, axis=1) / np.linalg.norm(texts, axis=1) >= 0.999)
