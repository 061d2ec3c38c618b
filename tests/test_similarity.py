"""The demo command: Fashion-MNIST images and prompts through both towers."""

import json

import jax
import numpy as np
import pytest

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
