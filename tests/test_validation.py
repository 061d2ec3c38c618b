"""Validation during training: recall and loss on held-out shards against a float64 brute force over features from a
second (unsharded) code path and torch's cross-entropy; an empty or missing set is refused by name."""

import jax
import numpy as np
import pytest
import torch

from clip_jax.data import make_shards
from clip_jax.data.transforms import OPENAI_MEAN, OPENAI_STD
from clip_jax.errors import InvalidInput
from clip_jax.evaluation.classifier import tokenize_for
from clip_jax.evaluation.validation import first_caption_rows, open_validation_set, pair_loss, validate
from clip_jax.models import create_model, init_params
from clip_jax.runtime.mesh import create_mesh

NUM_IMAGES = 40


def val_samples(count, extra_caption_every=3):
    """Fashion-MNIST test images, each caption made unique, every third image with a second caption."""
    for i, sample in enumerate(make_shards.fashion_mnist_samples("test", limit=count)):
        caption = f"{sample.caption}, item {i}"
        if i % extra_caption_every == 0:
            caption += f"\nanother view of item {i}"
        yield sample._replace(caption=caption)


@pytest.fixture(scope="module")
def val_pattern(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("val"))
    return make_shards.shard_pattern(make_shards.write_shards(val_samples(NUM_IMAGES), out, 16))


def brute_force_recall(images, texts, caption_image, k):
    """Float64 dot products; candidates sorted by (score descending, index ascending)."""
    images, texts = images.astype(np.float64), texts.astype(np.float64)
    t2i = [caption_image[t] in sorted(range(len(images)), key=lambda i: (-float(texts[t] @ images[i]), i))[:k]
           for t in range(len(texts))]
    i2t = [any(caption_image[t] == i for t in sorted(range(len(texts)),
                                                     key=lambda t: (-float(texts[t] @ images[i]), t))[:k])
           for i in range(len(images))]
    return float(np.mean(i2t)), float(np.mean(t2i))


def torch_clip_loss(images, texts, scale, batch):
    total = 0.0
    for s in range(0, len(images), batch):
        logits = scale * torch.tensor(images[s:s + batch], dtype=torch.float64) @ torch.tensor(
            texts[s:s + batch], dtype=torch.float64).T
        labels = torch.arange(len(logits))
        loss = (torch.nn.functional.cross_entropy(logits, labels) + torch.nn.functional.cross_entropy(logits.T, labels))
        total += float(loss) / 2 * len(logits)
    return total / len(images)


@pytest.mark.slow
def test_recall_and_loss_equal_an_independent_computation(val_pattern, trainer_model_file):
    val_set = open_validation_set(val_pattern)
    assert val_set.num_images == NUM_IMAGES and len(val_set.captions) == NUM_IMAGES + -(-NUM_IMAGES // 3)
    model = create_model(trainer_model_file)
    params = init_params(model, jax.random.key(3))
    params = {**params, "logit_scale": np.float32(np.log(20.0))}
    got = validate(model, params, val_set, create_mesh(), batch_size=16, loss_batch_size=24, mean=OPENAI_MEAN,
                   std=OPENAI_STD)

    # The reference: the whole set in one unsharded call per tower.
    images = np.concatenate(list(val_set.image_batches(batch_size=64, image_size=28, mean=OPENAI_MEAN,
                                                       std=OPENAI_STD)))
    image_features = np.asarray(model.apply({"params": params}, images, method="encode_image"))
    text_features = np.asarray(model.apply({"params": params}, tokenize_for(model, val_set.captions),
                                           method="encode_text"))
    for k in (1, 5, 10):
        i2t, t2i = brute_force_recall(image_features, text_features, val_set.caption_image, k)
        assert got[f"image_to_text_recall@{k}"] == i2t and got[f"text_to_image_recall@{k}"] == t2i
    assert 0 < got["image_to_text_recall@10"] < 1  # a random model: the numbers are not trivially 0 or 1
    firsts = [list(val_set.caption_image).index(i) for i in range(NUM_IMAGES)]
    assert got["loss"] == pytest.approx(torch_clip_loss(image_features, text_features[firsts], 20.0, 24), rel=1e-5)
    assert got["num_images"] == NUM_IMAGES
    # A softmax run whose model carries a logit_bias (e.g. init_logit_bias in its JSON) is validated with its own
    # loss, not the sigmoid one the bias would suggest.
    biased = {**params, "logit_bias": np.float32(-10.0)}
    as_run = validate(model, biased, val_set, create_mesh(), batch_size=16, loss_batch_size=24, mean=OPENAI_MEAN,
                      std=OPENAI_STD, loss="clip")
    assert as_run["loss"] == pytest.approx(got["loss"], rel=1e-12)


def test_the_sigmoid_loss_equals_its_definition():
    rng = np.random.default_rng(0)
    images, texts = rng.standard_normal((5, 3)), rng.standard_normal((5, 3))
    expected = []
    for s in (0, 3):
        logits = 2.0 * images[s:s + 3] @ texts[s:s + 3].T - 1.0
        signs = np.where(np.eye(len(logits)) > 0, 1.0, -1.0)
        expected.append(-np.log(1 / (1 + np.exp(-signs * logits))).sum())  # the batch's loss times its size
    assert pair_loss(images, texts, 2.0, -1.0, batch_size=3) == pytest.approx(sum(expected) / 5, rel=1e-12)


def test_first_caption_rows():
    assert first_caption_rows(np.array([1, 0, 1, 2, 0]), 3).tolist() == [1, 0, 3]


def test_first_samples_only(val_pattern):
    assert open_validation_set(val_pattern, num_samples=7).num_images == 7


def test_an_empty_validation_set_is_one_clear_error(tmp_path):
    samples = [s._replace(caption="") for s in make_shards.fashion_mnist_samples("test", limit=4)]
    pattern = make_shards.shard_pattern(make_shards.write_shards(samples, str(tmp_path), 4))
    with pytest.raises(InvalidInput, match=r"val_data='.*': no image with a caption in .*; validation needs"):
        open_validation_set(pattern)
