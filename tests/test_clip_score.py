"""`python -m clip_jax.score`: CLIPScore (100 x max(cos, 0)) of image-caption pairs from a folder with a captions CSV
or from webdataset shards, against transformers' CLIPModel on the same export."""

import csv
import io

import numpy as np
import pytest
import torch
import transformers
import webdataset as wds
from open_clip_reference import TINY_77, open_clip_model, state_dict_numpy
from PIL import Image

from clip_jax.evaluation import clip_score
from clip_jax.interop import convert
from clip_jax.interop.export import export_open_clip
from clip_jax.models import get_model_config

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.3, 0.25)
# Sizes whose centre crop transformers and OpenCLIP place alike (tests/test_hf_transformers.py)
SIZES = [(37, 53), (64, 48), (32, 32), (101, 40), (31, 90), (48, 64)]
CAPTIONS = ["a photo of a shoe", "A Bag!!  with\tspaces", "it's 42 degrees, isn't it?", "café naïve résumé",
            "a red square", "two, with a comma"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    folder = tmp_path_factory.mktemp("score") / "export"
    params = convert.from_open_clip(state_dict_numpy(open_clip_model(TINY_77, seed=5)), TINY_77)
    assert export_open_clip(params, get_model_config(TINY_77), str(folder), mean=MEAN, std=STD) is None
    return folder


def _images():
    rng = np.random.default_rng(1)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]


def _transformers_scores(folder, images, captions) -> np.ndarray:
    """100 x max(cos, 0) of each pair, from transformers' CLIPModel and CLIPProcessor on the export, in float64."""
    model = transformers.CLIPModel.from_pretrained(str(folder)).eval()
    processor = transformers.CLIPProcessor.from_pretrained(str(folder), backend="pil")
    inputs = processor(text=captions, images=images, return_tensors="pt", padding="max_length", truncation=True)
    with torch.no_grad():
        out = model(**inputs)
    image, text = out.image_embeds.double().numpy(), out.text_embeds.double().numpy()
    cosine = np.sum(image * text, -1) / np.linalg.norm(image, axis=-1) / np.linalg.norm(text, axis=-1)
    return 100 * np.maximum(cosine, 0)


def _read(path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_scores_equal_transformers_from_a_folder_and_from_shards_and_a_bad_image_is_named_and_skipped(
        export, tmp_path, capsys):
    images = _images()
    expected = _transformers_scores(export, images, CAPTIONS)
    assert (expected == 0).any() and (expected > 0).any()  # random weights: both sides of the max are exercised

    folder = tmp_path / "generated"
    folder.mkdir()
    for i, image in enumerate(images):
        image.save(folder / f"{i}.png")
    (folder / "broken.png").write_bytes(b"not a png")
    with open(tmp_path / "prompts.csv", "w", newline="", encoding="utf-8") as f:
        rows = [("filename", "caption")] + [(f"{i}.png", c) for i, c in enumerate(CAPTIONS[:3])]
        rows += [("broken.png", "a broken image")] + [(f"{i}.png", c) for i, c in enumerate(CAPTIONS) if i >= 3]
        csv.writer(f).writerows(rows)
    out = tmp_path / "scores.csv"
    assert clip_score.main(["--checkpoint", str(export), "--images", str(folder), "--captions",
                            str(tmp_path / "prompts.csv"), "--output", str(out), "--batch-size", "4"]) == 0
    printed = capsys.readouterr()
    assert f"skipped {folder / 'broken.png'}: corrupt_image" in printed.err
    rows = _read(out)
    assert [r["image"] for r in rows] == [str(folder / f"{i}.png") for i in range(len(CAPTIONS))]
    assert [r["caption"] for r in rows] == CAPTIONS
    got = np.array([float(r["score"]) for r in rows])
    np.testing.assert_allclose(got, expected, atol=1e-3)
    assert printed.out.splitlines()[-2].endswith("skipped: corrupt_image 1")
    assert abs(float(printed.out.splitlines()[-1].removeprefix("CLIPScore ")) - expected.mean()) < 1e-3

    with wds.TarWriter(str(tmp_path / "00000.tar"), encoder=False) as sink:  # the same pairs as shards
        for i, (image, caption) in enumerate(zip(images, CAPTIONS)):
            encoded = io.BytesIO()
            image.save(encoded, "PNG")
            sink.write({"__key__": f"{i:04d}", "png": encoded.getvalue(), "txt": caption.encode()})
        sink.write({"__key__": "9999", "txt": b"a caption without its image"})
    out = tmp_path / "shard_scores.csv"
    assert clip_score.main(["--checkpoint", str(export), "--images", str(tmp_path / "{00000..00000}.tar"),
                            "--output", str(out)]) == 0
    assert "skipped: no_image 1" in capsys.readouterr().out
    rows = _read(out)
    assert [r["image"] for r in rows] == [f"{i:04d}" for i in range(len(CAPTIONS))]
    np.testing.assert_allclose([float(r["score"]) for r in rows], expected, atol=1e-3)


def test_bad_inputs_are_one_line_each_and_a_file_not_ours_is_left_as_it_is(export, tmp_path, capsys):
    folder = tmp_path / "images"
    folder.mkdir()
    _images()[0].save(folder / "a.png")
    mistyped = tmp_path / "mistyped.csv"
    mistyped.write_text("a.png,a caption\nb.png,another\n")
    someone_elses = tmp_path / "theirs.csv"
    someone_elses.write_text("keep me\n")
    cases = [
        (["--images", str(folder)], f"--images {folder} is a folder: give --captions FILE.csv"),
        (["--images", str(folder), "--captions", str(mistyped)],
         f"--captions {mistyped}: 1 of its 2 file names are no file in {folder} (first: 'b.png')"),
        (["--images", str(tmp_path / "{00000..00001}.tar")], "2 of 2 shards do not exist"),
    ]
    for argv, said in cases:
        out = tmp_path / "out.csv"
        assert clip_score.main(["--checkpoint", str(export), "--output", str(out), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and said in err, err
        assert not out.exists()
    assert clip_score.main(["--checkpoint", str(export), "--images", str(folder), "--captions", str(mistyped),
                            "--output", str(someone_elses)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "theirs.csv" in err, err
    assert someone_elses.read_text() == "keep me\n"


def test_the_score_is_100_times_the_cosine_clipped_at_zero():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 50, 8))
    a /= np.linalg.norm(a, axis=-1, keepdims=True)
    b /= np.linalg.norm(b, axis=-1, keepdims=True)
    expected = [100 * max(float(np.dot(x, y)), 0.0) for x, y in zip(a, b)]
    np.testing.assert_allclose(clip_score.clip_scores(a.astype(np.float32), b.astype(np.float32)), expected,
                               atol=1e-4)


def test_an_unwritable_output_and_a_ctrl_c_are_one_line_each(export, unwritable_folder, tmp_path, capsys,
                                                               monkeypatch):
    folder = tmp_path / "images"
    folder.mkdir()
    _images()[0].save(folder / "a.png")
    (tmp_path / "c.csv").write_text("a.png,a caption\n")
    argv = ["--checkpoint", str(export), "--images", str(folder), "--captions", str(tmp_path / "c.csv")]
    assert clip_score.main([*argv, "--output", f"{unwritable_folder}/s.csv"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write the scores ") and err.count("\n") == 1 and "s.csv" in err, err

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(clip_score, "score", interrupted)
    assert clip_score.main([*argv, "--output", str(tmp_path / "s.csv")]) == 130
    assert capsys.readouterr().err == "stopped (Ctrl-C) before the scores were written\n"
    assert not (tmp_path / "s.csv").exists()

