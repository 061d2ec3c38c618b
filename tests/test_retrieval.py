"""Image-text retrieval: recall@k against a brute-force float64 reference (ties, several captions per image),
parity with features from OpenCLIP itself on webdataset shards, and the command line."""

import io
import json
import tarfile

import numpy as np
import open_clip
import pytest
import torch
from open_clip_reference import TINY_77, open_clip_model, state_dict_numpy
from PIL import Image

from clip_jax.data.transforms import OPENAI_MEAN, OPENAI_STD
from clip_jax.evaluation import evaluate_retrieval, load_retrieval_set, retrieval_recall, zeroshot
from clip_jax.evaluation.retrieval import first_images
from clip_jax.interop import convert, weight_files
from clip_jax.models import create_model
from clip_jax.runtime.mesh import create_mesh

KS = (1, 2, 5, 10)


def reference_recall(images: np.ndarray, texts: np.ndarray, caption_image: np.ndarray, ks) -> dict[str, float]:
    """Brute force in float64: sort every candidate list by (score descending, index ascending)."""
    images, texts = images.astype(np.float64), texts.astype(np.float64)
    metrics = {}
    for k in ks:
        found = []
        for t, text in enumerate(texts):
            scores = [float(np.dot(text, image)) for image in images]
            order = sorted(range(len(images)), key=lambda i: (-scores[i], i))
            found.append(caption_image[t] in order[:k])
        metrics[f"text_to_image_recall@{k}"] = float(np.mean(found))
        found = []
        for i, image in enumerate(images):
            scores = [float(np.dot(text, image)) for text in texts]
            order = sorted(range(len(texts)), key=lambda t: (-scores[t], t))
            found.append(any(caption_image[t] == i for t in order[:k]))
        metrics[f"image_to_text_recall@{k}"] = float(np.mean(found))
    return metrics


def _pairs(rng, num_images, max_captions):
    """Each image gets 1..max_captions captions; captions are listed in a shuffled order."""
    caption_image = np.concatenate([[i] * int(rng.integers(1, max_captions + 1)) for i in range(num_images)])
    return rng.permutation(caption_image)


@pytest.mark.parametrize("seed", range(4))
def test_recall_equals_brute_force_with_exact_ties(seed):
    """Small-integer features: dot products are exact in float32 and float64, and many are equal."""
    rng = np.random.default_rng(seed)
    caption_image = _pairs(rng, 30, 5)
    images = rng.integers(-1, 2, (30, 4)).astype(np.float32)
    texts = rng.integers(-1, 2, (len(caption_image), 4)).astype(np.float32)
    got = retrieval_recall(images, texts, caption_image, KS)
    assert got == reference_recall(images, texts, caption_image, KS)
    assert 0 < got["text_to_image_recall@1"] < got["text_to_image_recall@10"] < 1  # ties do decide here


def test_recall_equals_brute_force_on_random_features_with_duplicates():
    rng = np.random.default_rng(7)
    caption_image = _pairs(rng, 40, 5)
    images = rng.standard_normal((40, 16)).astype(np.float32)
    images[[3, 17, 31]] = images[9]  # identical images: exact ties for every caption
    texts = rng.standard_normal((len(caption_image), 16)).astype(np.float32)
    texts[: len(texts) // 2] += 2 * images[caption_image[: len(texts) // 2]]  # half the captions match well
    texts[[5, 6]] = texts[4]
    got = retrieval_recall(images, texts, caption_image, KS)
    assert got == reference_recall(images, texts, caption_image, KS)
    assert got["image_to_text_recall@1"] > 0.2


def test_a_nan_feature_is_never_found():
    images = np.eye(3, dtype=np.float32)
    texts = np.eye(3, dtype=np.float32)
    texts[1] = np.nan
    got = retrieval_recall(images, texts, np.arange(3), ks=(1, 3))
    assert got["text_to_image_recall@3"] == got["image_to_text_recall@3"] == pytest.approx(2 / 3)


def test_pairs_that_leave_an_image_without_caption_or_point_nowhere_are_refused():
    features = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match="1 image\\(s\\) have no caption \\(first: image 1\\)"):
        retrieval_recall(features, features, np.array([0, 2, 2]))
    with pytest.raises(ValueError, match="indices outside \\[0, 3\\)"):
        retrieval_recall(features, features, np.array([0, 1, 3]))


# ---------------------------------------------------------------------------------------------------------------
# From shards, against OpenCLIP's own features

WORDS = ["red", "blue", "striped", "small", "large", "dark", "bright", "round", "square", "soft"]


def _write_shards(root, num_images, seed=0):
    """Two shards; captions as json["captions"] (2-4 per image) in the first, as txt lines in the second."""
    rng = np.random.default_rng(seed)
    captions = []
    for shard in range(2):
        with tarfile.open(root / f"{shard:05d}.tar", "w") as tar:
            for i in range(shard * num_images // 2, (shard + 1) * num_images // 2):
                coarse = rng.integers(0, 256, (3, 3, 3), dtype=np.uint8)
                image = Image.fromarray(coarse).resize((int(rng.integers(30, 50)), int(rng.integers(30, 50))),
                                                       Image.Resampling.BILINEAR)
                buffer = io.BytesIO()
                image.save(buffer, "PNG")
                texts = [" ".join(rng.choice(WORDS, 3)) + f" thing {i % 7}" for _ in range(rng.integers(2, 5))]
                captions.append(texts)
                meta = json.dumps({"captions": texts}).encode() if shard == 0 else "\n".join(texts).encode()
                for name, data in ((f"{i:06d}.png", buffer.getvalue()),
                                   (f"{i:06d}.{'json' if shard == 0 else 'txt'}", meta)):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(root / "{00000..00001}.tar"), captions


@pytest.fixture(scope="module")
def torch_model():
    return open_clip_model(TINY_77, seed=11)


def test_recall_from_shards_equals_recall_of_open_clips_features(tmp_path, torch_model):
    pattern, captions = _write_shards(tmp_path, 24)
    retrieval_set = load_retrieval_set(pattern)
    assert retrieval_set.num_images == 24 and list(retrieval_set.captions) == sum(captions, [])

    params = convert.from_open_clip(state_dict_numpy(torch_model), TINY_77)
    got = evaluate_retrieval(create_model(TINY_77), params, retrieval_set, create_mesh(), batch_size=16,
                             text_batch_size=64, ks=KS)

    preprocess = open_clip.image_transform(32, is_train=False, mean=OPENAI_MEAN, std=OPENAI_STD)
    images = []
    for shard in range(2):
        with tarfile.open(tmp_path / f"{shard:05d}.tar") as tar:
            images += [preprocess(Image.open(tar.extractfile(m)).convert("RGB"))
                       for m in tar.getmembers() if m.name.endswith(".png")]
    with torch.no_grad():
        image_features = torch_model.encode_image(torch.stack(images), normalize=True).numpy()
        text_features = torch_model.encode_text(open_clip.tokenize(sum(captions, [])), normalize=True).numpy()
    caption_image = np.concatenate([[i] * len(c) for i, c in enumerate(captions)])
    expected = reference_recall(image_features, text_features, caption_image, KS)
    assert {k: v for k, v in got.items() if "recall" in k} == expected
    assert got["num_images"] == 24 and got["num_captions"] == len(caption_image)
    assert 0 < expected["text_to_image_recall@1"] < 1


def test_the_script_reports_retrieval_and_limit_keeps_the_first_images(tmp_path, capsys):
    pattern, captions = _write_shards(tmp_path, 12, seed=1)
    assert first_images(load_retrieval_set(pattern), 5).captions == tuple(sum(captions[:5], []))
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_77))
    checkpoint = tmp_path / "random_init.npz"
    weight_files.save_params(str(checkpoint), convert.from_open_clip(state_dict_numpy(open_clip_model(TINY_77, 2)),
                                                                TINY_77))
    output = tmp_path / "retrieval.json"
    assert zeroshot.main(["--model", str(config), "--checkpoint", str(checkpoint), "--retrieval", pattern,
                          "--limit", "10", "--batch-size", "8", "--output", str(output), "--no-progress"]) == 0
    metrics = json.loads(output.read_text())["results"][f"retrieval:{pattern}"]
    assert metrics["num_images"] == 10 and metrics["num_captions"] == sum(len(c) for c in captions[:10])
    assert metrics["text_to_image_recall@10"] == 1.0  # there are only 10 images
    assert 0 <= metrics["image_to_text_recall@1"] <= metrics["image_to_text_recall@5"] <= 1
    out = capsys.readouterr().out
    assert "image->text" in out and "R@5" in out
