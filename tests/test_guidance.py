"""CLIP guidance: the eval transform in JAX against PIL's, the similarity's gradient against torch autograd through
OpenCLIP and against central finite differences, and `python -m clip_jax.guide` writing its image and strip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from open_clip_reference import TINY, open_clip_model, state_dict_numpy
from PIL import Image, ImageFont

from clip_jax.data.transforms import eval_crop, normalize
from clip_jax.interop import convert, guidance
from clip_jax.interop.export import export_open_clip
from clip_jax.interop.guide import LABEL_BAND, step_labels
from clip_jax.interop.guide import main as guide
from clip_jax.models import create_model, get_model_config
from clip_jax.normalization import OPENAI_MEAN, OPENAI_STD


def natural_looking(height: int, width: int, seed: int) -> np.ndarray:
    """uint8 [H, W, 3]: smooth colour waves with a few flat discs on them (edges of every direction)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    image = np.stack([0.5 + 0.3 * np.sin(2 * np.pi * (rng.uniform(0.5, 2) * xx + rng.uniform(0.5, 2) * yy)
                                         / max(height, width) + rng.uniform(0, 6)) for _ in range(3)], -1)
    for _ in range(4):
        cy, cx, r = rng.uniform(0, height), rng.uniform(0, width), rng.uniform(0.1, 0.3) * min(height, width)
        image[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = rng.uniform(0, 1, 3)
    return np.round(np.clip(image, 0, 1) * 255).astype(np.uint8)


@pytest.mark.parametrize("kind", ["natural", "noise"])
def test_the_jax_eval_transform_gives_pils_pixels(kind):
    for height, width, size in [(300, 400, 224), (500, 333, 224), (120, 90, 32), (64, 48, 32), (40, 30, 28),
                                (28, 28, 28)]:
        image = (natural_looking(height, width, height) if kind == "natural" else
                 np.random.default_rng(height).integers(0, 256, (height, width, 3), dtype=np.uint8))
        expected = normalize(eval_crop(Image.fromarray(image), size), OPENAI_MEAN, OPENAI_STD)
        got = np.asarray(guidance.preprocess(jnp.asarray(image, jnp.float32) / 255, size, OPENAI_MEAN, OPENAI_STD))
        difference = np.abs(got - expected)
        assert got.shape == expected.shape == (size, size, 3)
        assert difference.max() <= 0.02 and difference.mean() <= 2e-3, (height, width, difference.max())
        assert (difference > 1e-4).mean() < 0.005  # pixel for pixel PIL's but for a rare uint8 level


def test_the_gradient_at_the_model_input_equals_torch_autograd_through_open_clip():
    reference = open_clip_model(TINY, seed=6)
    params = convert.from_open_clip(state_dict_numpy(reference), TINY)
    model = create_model(get_model_config(TINY))
    rng = np.random.default_rng(0)
    images = rng.normal(size=(2, 32, 32, 3)).astype(np.float32)
    text = rng.normal(size=48)
    text = (text / np.linalg.norm(text)).astype(np.float32)

    def similarity(x):
        return jnp.mean(model.apply({"params": params}, x, method="encode_image") @ text)

    value, grad = jax.value_and_grad(similarity)(images)
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).requires_grad_(True)
    expected = (reference.encode_image(pixels, normalize=True) @ torch.from_numpy(text)).mean()
    expected.backward()
    expected_grad = pixels.grad.permute(0, 2, 3, 1).numpy()
    assert abs(float(value) - expected.item()) < 1e-5
    assert np.abs(np.asarray(grad) - expected_grad).max() <= 1e-4 * np.abs(expected_grad).max()


def test_the_guidance_gradient_with_cutouts_equals_central_finite_differences():
    """In float64 up to the embedding, which the model returns in float32 (its rounding, over a step of 2e-3, is
    ~4e-6 of a derivative of ~0.01-0.1: hence 2e-5), on the cutouts' path: smooth, where the whole-image path rounds to uint8 levels as PIL does, a staircase whose
    gradient is a straight-through one."""
    jax.config.update("jax_enable_x64", True)
    try:
        cfg = {**TINY, "vision_cfg": {**TINY["vision_cfg"], "layers": 1}}
        model = create_model(get_model_config(cfg), dtype=jnp.float64, param_dtype=jnp.float64)
        params = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), jnp.zeros((1, 20), jnp.int32))["params"]
        rng = np.random.default_rng(1)
        text = rng.normal(size=48)
        step = guidance.guidance(model, {"params": params}, text / np.linalg.norm(text), size=32, mean=OPENAI_MEAN,
                                 std=OPENAI_STD, num_cutouts=3)
        pixels = jnp.asarray(rng.uniform(0.2, 0.8, (48, 40, 3)))
        key = jax.random.key(7)
        _, grad = step(pixels, key)
        assert grad.dtype == jnp.float64 and np.abs(grad).max() > 0
        for direction_seed in range(3):
            direction = jnp.asarray(np.random.default_rng(direction_seed).normal(size=pixels.shape))
            epsilon = 1e-3
            plus, _ = step(pixels + epsilon * direction, key)
            minus, _ = step(pixels - epsilon * direction, key)
            finite = (float(plus) - float(minus)) / (2 * epsilon)
            analytic = float(jnp.vdot(grad, direction))
            assert abs(finite - analytic) <= 2e-5 and abs(analytic) > 1e-3, (finite, analytic)
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    folder = tmp_path_factory.mktemp("guide") / "export"
    cfg = {**TINY, "text_cfg": {**TINY["text_cfg"], "context_length": 77, "vocab_size": 49408}}
    params = convert.from_open_clip(state_dict_numpy(open_clip_model(cfg, seed=8)), cfg)
    export_open_clip(params, get_model_config(cfg), str(folder), mean=OPENAI_MEAN, std=OPENAI_STD)
    return folder


def test_the_command_raises_the_similarity_and_writes_the_image_and_its_strip(export, tmp_path, capsys):
    out = tmp_path / "red.png"
    assert guide(["--checkpoint", str(export), "--prompt", "a red square", "--output", str(out), "--steps", "6",
                  "--cutouts", "2", "--frames", "3", "--lr", "0.1"]) == 0
    printed = capsys.readouterr().out.splitlines()
    curve = [float(line.split()[-1]) for line in printed if line.startswith("step ")]
    assert [line.split()[1] for line in printed if line.startswith("step ")] == [f"{k}/6" for k in range(1, 7)]
    assert curve[-1] > curve[0]
    image, strip = Image.open(out), Image.open(tmp_path / "red.strip.png")
    assert image.size == (64, 64) and strip.size == (3 * 64, 64 + LABEL_BAND)  # twice the model's 32 px; 3 frames
    np.testing.assert_array_equal(np.asarray(strip)[:64, -64:], np.asarray(image))  # the last frame is the image
    # each frame's step below it: ink in each label's place, different labels, a white band elsewhere
    labels = [np.asarray(strip.convert("L"))[64:, k * 64:(k + 1) * 64] for k in range(3)]
    assert all((band < 128).sum() > 10 for band in labels)
    assert not np.array_equal(labels[0], labels[1]) and not np.array_equal(labels[1], labels[2])
    assert all((band[:, :8] == 255).all() for band in labels)
    assert step_labels([0, 3, 6], 64, ImageFont.load_default()) == ["step 0", "step 3", "step 6"]
    assert step_labels([0, 1000], 28, ImageFont.load_default()) == ["0", "1000"]  # a narrow frame: the number
    assert printed[-1].startswith(f"wrote {out} and {tmp_path / 'red.strip.png'}; similarity under the eval")


def test_bad_inputs_are_one_line_and_a_file_not_ours_is_left_as_it_is(export, tmp_path, capsys):
    theirs = tmp_path / "theirs.png"
    theirs.write_bytes(b"keep")
    for argv, said in [(["--output", str(theirs)], "theirs.png"),
                       (["--output", str(tmp_path / "a.png"), "--init", str(tmp_path / "none.jpg")],
                        f"--init {tmp_path / 'none.jpg'} does not exist"),
                       (["--output", str(tmp_path / "b.png"), "--size", "16"], "--size 16 is below the model's")]:
        assert guide(["--checkpoint", str(export), "--prompt", "x", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and said in err, err
    assert theirs.read_bytes() == b"keep"


def test_an_unwritable_output_and_a_ctrl_c_are_one_line_each(export, unwritable_folder, tmp_path, capsys,
                                                               monkeypatch):
    out = f"{unwritable_folder}/g.png"
    assert guide(["--checkpoint", str(export), "--prompt", "x", "--output", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write the guided image ") and err.count("\n") == 1 and "g.png" in err, err

    import clip_jax.interop.guide as guide_module

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(guide_module, "run", interrupted)
    out = tmp_path / "g.png"
    assert guide(["--checkpoint", str(export), "--prompt", "x", "--output", str(out)]) == 130
    assert capsys.readouterr().err == "stopped (Ctrl-C) before the image was written\n"
    assert not out.exists()

