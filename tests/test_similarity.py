"""`python -m clip_jax.similarity`: a model's predictions on your own images (the model and preprocessing the
checkpoint holds, a table of each image's best labels, images that do not decode named and skipped), and the demo:
Fashion-MNIST images and prompts through both towers."""

import json

import jax
import numpy as np
import pytest
from PIL import Image
from test_opener import paths  # noqa: F401 (the fixture)

import clip_jax
from clip_jax.data import fashion_mnist
from clip_jax.interop import similarity
from clip_jax.interop.weight_files import save_params
from clip_jax.models import create_model, init_params

TINY_REAL_VOCAB = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def test_one_image_per_class_in_class_order():
    labels = np.array([3, 1, 1, 0, 2, 3, 0])
    images = np.arange(7)[:, None, None] * np.ones((7, 2, 2), np.uint8)
    picked, picked_labels = similarity.one_image_per_class(images, labels, 4)
    np.testing.assert_array_equal(picked_labels, [0, 1, 2, 3])
    np.testing.assert_array_equal(picked[:, 0, 0], [3, 1, 4, 0])


@pytest.mark.slow
def test_demo_prints_a_table_of_probabilities(tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_REAL_VOCAB))
    assert similarity.main(["--model", str(config)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("t-shirt ", "bag ")) and "*" in line]
    assert len(rows) == 2
    probs = np.array([float(x.rstrip("*")) for x in rows[0].split()[1:]])
    assert probs.shape == (10,) and abs(probs.sum() - 1) < 0.02
    assert "images matched their own class's prompt" in out


def test_a_checkpoint_is_used_and_a_wrong_one_is_refused(tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_REAL_VOCAB))
    params = init_params(create_model(str(config)), jax.random.key(7))
    save_params(str(tmp_path / "p.npz"), params)
    assert similarity.main(["--model", str(config), "--checkpoint", str(tmp_path / "p.npz")]) == 0
    assert "freshly initialised" not in capsys.readouterr().out
    assert similarity.main(["--model", "ViT-B-32", "--checkpoint", str(tmp_path / "p.npz")]) == 2
    assert "does not match model 'ViT-B-32'" in capsys.readouterr().err


def test_missing_data_says_what_to_install(tmp_path, capsys):
    assert similarity.main(["--model", "ViT-B-32", "--data-dir", str(tmp_path)]) == 2
    assert "apt-get install dataset-fashion-mnist" in capsys.readouterr().err
    assert fashion_mnist.DEFAULT_DIR  # the default points at Debian's package


@pytest.fixture(scope="module")
def own_images(paths):
    """The opener's tests' model paths (an export, a run, a weights file: their own mean and std, not OpenAI's), and
    beside them a folder of photos with a file that is not an image, and one more image."""
    root = paths[0]
    (root / "photos" / "more").mkdir(parents=True)
    Image.new("RGB", (40, 30), "red").save(root / "photos" / "red.jpg")
    Image.new("RGB", (30, 50), "blue").save(root / "photos" / "more" / "blue.png")
    (root / "photos" / "notes.txt").write_text("not an image")
    Image.new("RGB", (20, 20), "green").save(root / "green.webp")
    return root


def _rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("photos/", "green.webp"))]


def test_own_images_and_labels_give_each_images_top_labels_with_the_models_own_preprocessing(own_images, capsys,
                                                                                           monkeypatch):
    monkeypatch.chdir(own_images)
    labels = ["a red square", "a blue square", "a green square", "a cat"]
    argv = ["--checkpoint", "export", "--images", "photos", "green.webp", "--labels", ",".join(labels) + ",",
            "--top", "2", "--json", "probs.json"]
    assert similarity.main(argv) == 0
    out = capsys.readouterr().out
    assert "freshly initialised" not in out and "3 images x 4 texts, softmax over the texts:" in out
    rows = _rows(out)
    assert [row.split()[0] for row in rows] == ["photos/more/blue.png", "photos/red.jpg", "green.webp"]
    report = json.load(open("probs.json"))
    assert report["texts"] == labels and report["skipped"] == []
    assert report["model"] != "ViT-B-32" and report["probabilities"] == "softmax over the texts"
    probs = np.array([image["probabilities"] for image in report["images"]])
    # the inference API's numbers, which the README's snippet prints
    model, params, _, transform = clip_jax.create_model_and_transforms("local-dir:export/")
    images = np.stack([transform(Image.open(image["image"])) for image in report["images"]])
    image_f = model.apply({"params": params}, images, method="encode_image")
    text_f = model.apply({"params": params}, clip_jax.get_tokenizer("local-dir:export/")(labels),
                         method="encode_text")
    expected = jax.nn.softmax(np.exp(params["logit_scale"]) * image_f @ text_f.T, axis=-1)
    np.testing.assert_allclose(probs, expected, atol=1e-5)
    best = np.argsort(-probs[1])[:2]  # red.jpg's two best labels, in the row in that order
    assert rows[1].split("   ", 1)[1].split() == " ".join(f"{labels[j]} {probs[1, j]:.3f}" for j in best).split()


def test_the_demo_takes_an_exported_folder_as_the_model_it_holds(own_images, capsys):
    assert similarity.main(["--checkpoint", str(own_images / "export")]) == 0  # no --model: not read as ViT-B-32
    out = capsys.readouterr().out
    assert "freshly initialised" not in out and "images matched their own class's prompt" in out


def test_a_weights_file_with_its_model_and_a_captions_file(own_images, capsys, monkeypatch):
    monkeypatch.chdir(own_images)
    (own_images / "captions.csv").write_text('title,source\n"a red, square thing",me\n\na blue square,me\n')
    argv = ["--checkpoint", "params.npz", "--model", "tiny.json", "--images", "photos/red.jpg", "--captions",
            "captions.csv"]
    assert similarity.main(argv) == 0
    row = _rows(capsys.readouterr().out)[0]
    assert "a red, square thing" in row and "a blue square" in row


def test_a_siglip_models_probabilities_are_each_texts_sigmoid(own_images, tmp_path, capsys):
    (tmp_path / "siglip.json").write_text(json.dumps({**TINY_REAL_VOCAB, "init_logit_bias": -10.0}))
    argv = ["--model", str(tmp_path / "siglip.json"), "--images", str(own_images / "green.webp"), "--labels",
            "green,red", "--json", str(tmp_path / "p.json")]
    assert similarity.main(argv) == 0
    assert "sigmoid of each text (a SigLIP model)" in capsys.readouterr().out
    probs = json.load(open(tmp_path / "p.json"))["images"][0]["probabilities"]
    assert all(0 < p < 0.01 for p in probs)  # logit_bias -10 and a scale of 10: sigmoid, not a softmax's 1/2


def test_an_image_that_does_not_decode_is_named_and_skipped(own_images, tmp_path, capsys):
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    argv = ["--checkpoint", str(own_images / "run"), "--labels", "a,b", "--images"]
    assert similarity.main(argv + [str(tmp_path / "broken.jpg"), str(own_images / "green.webp")]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(f"skipped {tmp_path}/broken.jpg: is not an image that decodes (")
    assert captured.err.count("\n") == 1 and "1 image x 2 texts" in captured.out
    assert similarity.main(argv + [str(tmp_path / "broken.jpg")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: no image of --images decodes (1 image tried): see the lines above")


@pytest.mark.parametrize("argv, error", [
    (["--images", "photos/more", "--labels", " , "], "--labels ' , ' names no label: give them comma-separated"),
    (["--images", "nowhere", "--labels", "a"], "--images nowhere does not exist: give image files and/or folders"),
    (["--images", "empty", "--labels", "a"], "--images empty: no images (.jpg, .jpeg, .png"),
    (["--images", "photos"], "--images needs the texts to match them with (--labels 'a,b,c' or --captions FILE)"),
    (["--labels", "a,b"], "--labels and --captions are matched with --images FILE_OR_FOLDER"),
    (["--images", "photos", "--captions", "nowhere.csv"], "--captions nowhere.csv does not exist"),
    (["--images", "photos", "--captions", "tiny.json", "--labels", "a"], "give --labels or --captions, not both"),
])
def test_a_wrong_image_or_label_argument_is_one_line(argv, error, own_images, capsys, monkeypatch):
    monkeypatch.chdir(own_images)
    (own_images / "empty").mkdir(exist_ok=True)
    assert similarity.main(["--checkpoint", "export"] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {error}") and err.count("\n") == 1, err
