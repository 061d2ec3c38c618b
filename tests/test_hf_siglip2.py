"""transformers' Siglip2Model (SigLIP 2's NaFlex model) folders both ways: a folder transformers wrote opens through
the one opener; `embed` on non-square images gives transformers' image and text embeddings at the folder's patch
budget and at another `--max_num_patches`; `zeroshot` gives its predictions; an export loads in transformers with the
same embeddings; what cannot take a NaFlex model is refused in one line."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from clip_jax.evaluation import embed, zeroshot
from clip_jax.interop import export, similarity
from clip_jax.interop.opener import open_model
from clip_jax.text.sentencepiece_tokenizer import train_sentencepiece

pytest.importorskip("sentencepiece")

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.3, 0.25)  # not SigLIP 2's 0.5: the folder's processor must carry them
PATCH, BUDGET, OTHER_BUDGET, LENGTH = 8, 24, 40, 16
# (height, width): wide, tall, square, a sliver (a 1 x 15 grid) and one smaller than a patch (resized up)
SIZES = [(37, 53), (64, 28), (40, 40), (6, 90), (5, 7), (90, 31)]
TEMPLATES = ["a photo of a {}.", "a drawing of the {}"]
WORDS = "a an the photo drawing picture of cat dog bird red blue small big on in near grass sky".split()


def _captions(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(2, 9))) for _ in range(count)]


def _image(size, seed: int) -> Image.Image:
    """A smooth picture (a photograph rather than noise: resamplers agree on it to an 8-bit step)."""
    rng = np.random.default_rng(seed)
    height, width = size
    y, x = np.mgrid[0:height, 0:width]
    channels = [np.sin(x * rng.uniform(0.02, 0.2) + y * rng.uniform(0.02, 0.2) + rng.uniform(0, 6)) for _ in range(3)]
    return Image.fromarray(((np.stack(channels, -1) + 1) * 127.5).astype(np.uint8))


@pytest.fixture(scope="module")
def theirs(tmp_path_factory):
    """A Siglip2Model folder as transformers writes it (random init, norms, biases and positions moved), with a toy
    Gemma-style tokenizer and Siglip2ImageProcessor's settings (budget 24 patches of 8 px, our mean and std)."""
    folder = tmp_path_factory.mktemp("hf") / "tiny-siglip2"
    tokenizer = train_sentencepiece(_captions(400, seed=1), folder, vocab_size=300, style="gemma")
    config = transformers.Siglip2Config(
        text_config={"vocab_size": tokenizer.vocab_size, "hidden_size": 32, "intermediate_size": 80,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": LENGTH,
                     "projection_size": 48},
        vision_config={"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 3,
                       "num_patches": 16, "patch_size": PATCH, "hidden_act": "gelu", "layer_norm_eps": 1e-5})
    torch.manual_seed(0)
    model = transformers.Siglip2Model(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2 or name.endswith(("bias", "probe", "position_embedding.weight")):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(str(folder))
    _processor(BUDGET).save_pretrained(str(folder))
    return folder, model


def _processor(budget: int):
    return transformers.Siglip2ImageProcessor(patch_size=PATCH, max_num_patches=budget, image_mean=list(MEAN),
                                              image_std=list(STD))


def _reference(model, folder, images, texts, budget):
    """transformers' image embeddings of `images` at `budget` and text embeddings of `texts` from `input_ids` alone,
    padded to the model's length, L2-normalised."""
    inputs = _processor(budget)(images=images, return_tensors="pt")
    ids = transformers.AutoTokenizer.from_pretrained(str(folder))(
        texts, padding="max_length", max_length=LENGTH, truncation=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        image = model.get_image_features(pixel_values=inputs["pixel_values"],
                                         pixel_attention_mask=inputs["pixel_attention_mask"],
                                         spatial_shapes=inputs["spatial_shapes"]).pooler_output.numpy()
        text = model.get_text_features(input_ids=ids).pooler_output.numpy()
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    return unit(image), unit(text)


def _cosines(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def images_folder(tmp_path_factory):
    """Non-square images with captions, as `embed --input_format files` reads them."""
    folder = tmp_path_factory.mktemp("images")
    captions = _captions(len(SIZES), seed=2)
    for i, (size, caption) in enumerate(zip(SIZES, captions)):
        _image(size, seed=i).save(folder / f"{i:03d}.png")
        (folder / f"{i:03d}.txt").write_text(caption)
    return folder, [_image(size, seed=i) for i, size in enumerate(SIZES)], captions


def _embedded(out):
    return (np.load(out / "img_emb" / "img_emb_0.npy").astype(np.float32),
            np.load(out / "text_emb" / "text_emb_0.npy").astype(np.float32))


@pytest.mark.parametrize("budget", [None, OTHER_BUDGET])
def test_embed_gives_transformers_embeddings_at_the_folders_budget_and_another(theirs, images_folder, tmp_path,
                                                                              capsys, budget):
    folder, model = theirs
    images_dir, images, captions = images_folder
    out = tmp_path / "out"
    flags = [] if budget is None else ["--max_num_patches", str(budget)]
    assert embed.main(["--input_dataset", str(images_dir), "--output_folder", str(out), "--clip_model", str(folder),
                       "--batch_size", "8", *flags]) == 0
    assert f"images at {budget or BUDGET} patches" in capsys.readouterr().out
    image, text = _embedded(out)
    expected_image, expected_text = _reference(model, folder, images, captions, budget or BUDGET)
    # the embeddings are stored as float16, as clip-retrieval stores them
    assert _cosines(image, expected_image).min() >= 0.9999
    assert _cosines(text, expected_text).min() >= 0.9999


def test_the_budget_changes_the_embeddings(theirs, images_folder):
    """The second budget is a test of something: transformers' own embeddings move with it."""
    folder, model = theirs
    _, images, captions = images_folder
    at_folder, _ = _reference(model, folder, images, captions, BUDGET)
    at_other, _ = _reference(model, folder, images, captions, OTHER_BUDGET)
    assert _cosines(at_folder, at_other).min() < 0.999


def test_the_folder_opens_as_a_naflex_model_in_either_processor_layout(theirs, tmp_path):
    folder, _ = theirs
    opened = open_model(str(folder))
    assert opened.naflex and opened.max_num_patches == BUDGET
    assert opened.normalization() == (MEAN, STD)
    assert opened.at_budget(OTHER_BUDGET).resize_mode.max_num_patches == OTHER_BUDGET
    # transformers 5's layout: the image processor nested in processor_config.json, no preprocessor_config.json
    newer = tmp_path / "newer"
    shutil.copytree(folder, newer)
    saved = json.loads((newer / "preprocessor_config.json").read_text())
    os.remove(newer / "preprocessor_config.json")
    (newer / "processor_config.json").write_text(json.dumps({"image_processor": {**saved, "max_num_patches": 32}}))
    assert open_model(str(newer)).max_num_patches == 32


def _split_pair(model, folder, images) -> tuple[str, str]:
    """Two class names between which transformers' predictions on `images` split, each image's margin clear of
    float rounding (a random tiny model prefers one class for most images: the pair is chosen so that the test's
    predictions are not all one)."""
    best = (0, ())
    image, text = _reference(model, folder, images, [t.format(w) for w in WORDS for t in TEMPLATES], BUDGET)
    classifier = text.reshape(len(WORDS), len(TEMPLATES), -1).mean(1)
    classifier /= np.linalg.norm(classifier, axis=-1, keepdims=True)
    logits = image @ classifier.T  # [images, words]
    for a in range(len(WORDS)):
        for b in range(a + 1, len(WORDS)):
            margin = logits[:, a] - logits[:, b]
            if np.abs(margin).min() > 1e-3:
                balance = min((margin > 0).sum(), (margin < 0).sum())
                best = max(best, (balance, (WORDS[a], WORDS[b])))
    assert best[0] >= 3, best
    return best[1]


def test_zeroshot_gives_transformers_predictions(theirs, tmp_path):
    folder, model = theirs
    images = [_image(size, seed=seed) for seed in range(2) for size in SIZES]
    classes = _split_pair(model, folder, images)
    root, labels = tmp_path / "val", []
    for i, image in enumerate(images):  # labels that are not the predictions: the accuracy is neither 0 nor 1
        label = i % 2
        (root / classes[label]).mkdir(parents=True, exist_ok=True)
        image.save(root / classes[label] / f"{i:02d}.png")
        labels.append(label)
    (tmp_path / "templates.txt").write_text("\n".join(TEMPLATES))
    (tmp_path / "classes.txt").write_text("\n".join(classes))
    report = tmp_path / "report.json"
    assert zeroshot.main(["--checkpoint", str(folder), "--imagenet-val", str(root), "--templates",
                          str(tmp_path / "templates.txt"), "--class-names", str(tmp_path / "classes.txt"),
                          "--no-progress", "--output", str(report), "--batch-size", "8"]) == 0
    results = json.loads(report.read_text())
    order = [images[i] for i in np.argsort([f"{classes[label]}/{i:02d}" for i, label in enumerate(labels)])]
    image, text = _reference(model, folder, order, [t.format(c) for c in classes for t in TEMPLATES], BUDGET)
    classifier = text.reshape(len(classes), len(TEMPLATES), -1).mean(1)
    predictions = np.argmax(image @ classifier.T, -1)
    expected = np.mean(predictions == np.sort(labels))
    assert 0 < expected < 1
    (metrics,) = [v for v in results["results"].values() if "top1" in v]
    assert metrics["top1"] == pytest.approx(expected)
    assert results["max_num_patches"] == BUDGET


def test_an_export_is_a_siglip2_folder_transformers_loads_with_the_same_embeddings(theirs, images_folder, tmp_path,
                                                                                  capsys):
    folder, model = theirs
    _, images, captions = images_folder
    out = tmp_path / "exported"
    export.main([str(folder), str(out)])
    printed = capsys.readouterr().out
    assert "OpenCLIP" in printed  # the one line saying OpenCLIP's format has no NaFlex model
    assert not (out / "open_clip_config.json").exists()
    reloaded = transformers.Siglip2Model.from_pretrained(str(out)).eval()
    processor = json.loads((out / "preprocessor_config.json").read_text())
    assert processor["max_num_patches"] == BUDGET and tuple(processor["image_mean"]) == MEAN
    image, text = _reference(reloaded, out, images, captions, BUDGET)
    expected_image, expected_text = _reference(model, folder, images, captions, BUDGET)
    np.testing.assert_allclose(image, expected_image, atol=1e-6)
    np.testing.assert_allclose(text, expected_text, atol=1e-6)


def test_what_cannot_take_a_naflex_model_is_refused_in_one_line(theirs, images_folder, tmp_path, capsys):
    folder, _ = theirs
    images_dir, _, _ = images_folder

    def refused(main, argv) -> str:
        assert main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err

    assert "at least one patch" in refused(embed.main, ["--input_dataset", images_dir, "--output_folder",
                                                        tmp_path / "a", "--clip_model", folder,
                                                        "--max_num_patches", 0])
    assert "NaFlex" in refused(similarity.main, ["--max_num_patches", 16])  # a fresh fixed-size model
    from clip_jax.interop import guide

    assert "NaFlex" in refused(guide.main, ["--checkpoint", folder, "--prompt", "a cat", "--output",
                                            tmp_path / "g.png"])
    from clip_jax.errors import InvalidInput
    from clip_jax.interop.timm_tower import timm_args

    with pytest.raises(InvalidInput, match="SigLIP 2 NaFlex folder"):
        timm_args(str(folder))
    naflex = open_model(str(folder))
    fixed = dataclasses.replace(naflex.config, vision=dataclasses.replace(naflex.config.vision, naflex=False))
    with pytest.raises(InvalidInput, match="--max_num_patches 16: .* is not a NaFlex model"):
        open_model(str(folder), fixed, max_num_patches=16)


def test_the_folders_weights_start_a_fixed_resolution_model_of_its_towers(theirs):
    """A pretrained start: the folder read as the fixed-resolution SigLIP model of the same towers (at another image
    size) takes every weight as it is but the position grid, resized to the model's."""
    folder, _ = theirs
    naflex = open_model(str(folder))
    vision = dataclasses.replace(naflex.config.vision, naflex=False, image_size=6 * PATCH)
    fixed = dataclasses.replace(naflex.config, vision=vision, name="fixed")
    as_fixed = open_model(str(folder), fixed).variables()["params"]
    own = naflex.variables()["params"]
    assert as_fixed["visual"]["positional_embedding"].shape == (36, 48)
    np.testing.assert_array_equal(as_fixed["visual"]["conv1"]["kernel"], own["visual"]["conv1"]["kernel"])
    np.testing.assert_array_equal(as_fixed["token_embedding"]["embedding"], own["token_embedding"]["embedding"])


def test_a_naflex_model_config_keeps_its_tower_through_the_model_config_json(theirs):
    from clip_jax.models.open_clip_json import config_from_open_clip, open_clip_model_cfg

    config = open_model(str(theirs[0])).config
    written = open_clip_model_cfg(config)
    assert written["vision_cfg"]["naflex"] is True and written["vision_cfg"]["pool_type"] == "map"
    assert config_from_open_clip(written, config.name).vision == config.vision


def test_similarity_and_score_read_the_folder_at_a_budget_as_transformers_does(theirs, images_folder, tmp_path,
                                                                               capsys):
    from clip_jax.evaluation import clip_score

    folder, model = theirs
    images_dir, images, captions = images_folder
    labels = ["a red dog", "two small birds on the grass"]
    report = tmp_path / "similarity.json"
    assert similarity.main(["--checkpoint", str(folder), "--images", str(images_dir), "--labels", ",".join(labels),
                            "--max_num_patches", str(OTHER_BUDGET), "--json", str(report)]) == 0
    assert f"(at {OTHER_BUDGET} patches)" in capsys.readouterr().out
    rows = sorted(json.loads(report.read_text())["images"], key=lambda row: os.path.basename(row["image"]))
    image, text = _reference(model, folder, images, labels, OTHER_BUDGET)
    expected = torch.sigmoid(model.logit_scale.exp() * torch.from_numpy(image @ text.T) + model.logit_bias)
    np.testing.assert_allclose([row["probabilities"] for row in rows], expected.detach().numpy(), atol=1e-4)

    table = tmp_path / "captions.csv"
    table.write_text("".join(f"{i:03d}.png,{caption}\n" for i, caption in enumerate(captions)))
    scores = tmp_path / "scores.csv"
    assert clip_score.main(["--checkpoint", str(folder), "--images", str(images_dir), "--captions", str(table),
                            "--output", str(scores)]) == 0
    assert f"images at {BUDGET} patches" in capsys.readouterr().out
    image, text = _reference(model, folder, images, captions, BUDGET)
    written = [float(line.rsplit(",", 1)[1]) for line in scores.read_text().splitlines()[1:]]
    np.testing.assert_allclose(written, 100 * np.maximum(np.sum(image * text, -1), 0), atol=2e-2)
