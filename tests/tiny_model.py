"""The tiny model most unit tests compile, its random batch, plain SGD and the check that two updates agree: shared
by the step tests (tests/conftest.py hands the model and batch out as fixtures too). Also the check that a model's
bfloat16 compute gives its float32 features."""

import dataclasses

import jax
import numpy as np

from clip_jax.models import get_model_config
from clip_jax.training.step_factory import OptimizerSpec

# Two layers a tower and a vocabulary of 1,000, so a sharded step compiles in seconds. (The OpenCLIP parity tests
# use their own, with more heads, in open_clip_reference.py.)
TINY_MODEL = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 1000, "width": 32, "heads": 2, "layers": 2},
}
# The tiny model's towers with SigLIP 2's NaFlex image tower (attention-pooled, a 4 x 4 position grid of patches of 8).
TINY_NAFLEX = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 16, "pool_type": "map",
                   "no_ln_pre": True},
    "text_cfg": TINY_MODEL["text_cfg"],
}
SGD_LR = 0.5  # plain SGD, so the parameter change is the gradient itself (Adam's first step is ~sign(grad))
SGD = OptimizerSpec("sgd", lr=SGD_LR)


def naflex_model(cfg=TINY_NAFLEX):
    """The model of an OpenCLIP config dict with its (attention-pooled) image tower NaFlex."""
    config = get_model_config(cfg)
    return dataclasses.replace(config, vision=dataclasses.replace(config.vision, naflex=True))


def random_batch(rows: int) -> dict[str, np.ndarray]:
    """Images and tokens for the tiny model (token ids below its vocabulary of 1000), the same on every call."""
    rng = np.random.default_rng(0)
    return {
        "images": rng.normal(size=(rows, 32, 32, 3)).astype(np.float32),
        "tokens": rng.integers(1, 1000, size=(rows, 16)).astype(np.int32),
    }


# Float32 rounding of a whole tower's update, as measured (see `assert_same_update`): 16 units of 2**-23.
UPDATE_ROUNDING = 16 * float(np.finfo(np.float32).eps)


def assert_same_update(params, after, expected_after, rtol=1e-4, floor=UPDATE_ROUNDING):
    """The parameter changes agree leaf by leaf: each leaf's difference is at most `rtol` of its own change plus
    `floor` of its tower's whole change (the image tower `visual`; the rest: the text tower and the head).

    Why the second term: the rounding of a float32 step (the batch summed in another order on 8 devices, BatchNorm's
    statistics, the loss's reductions) reaches every leaf's gradient through activations the whole tower computes,
    so a leaf whose own change is small still carries an error of the size of the tower's rounding. Measured with the
    single-device references themselves, fed the same batches with their rows in another order (the same sums,
    rounded in another order): a leaf moves by up to 8 float32 units (9.3e-7) of its tower's change, and by up to
    2.5e-4 of its own change where that is small (the attention pool's q/k projections of the ResNet step tests);
    `floor` is twice the former. A wrong step (per-device instead of global BatchNorm statistics, a gradient term
    dropped, gradients 0.1% off) fails it (the ResNet step tests: the first leaf checked, `ln_final.bias`, is off
    by 1.6x to 2,400x its bound)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    changes = {jax.tree_util.keystr(path): (np.asarray(_get(after, path), np.float64) - before,
                                            np.asarray(_get(expected_after, path), np.float64) - before)
               for path, before in leaves}
    tower_of = {jax.tree_util.keystr(path): _tower(path) for path, _ in leaves}
    tower_change = {}
    for name, (_, expected) in changes.items():
        tower_change[tower_of[name]] = tower_change.get(tower_of[name], 0.0) + float(np.sum(expected ** 2))
    for name, (delta, expected) in changes.items():
        scale = np.linalg.norm(expected)
        assert scale > 0, name
        bound = rtol * scale + floor * np.sqrt(tower_change[tower_of[name]])
        assert np.linalg.norm(delta - expected) <= bound, (name, np.linalg.norm(delta - expected), bound)


# How far bfloat16 compute may take the features from float32 compute, as a multiple of what rounding the params and
# images to bfloat16 alone does to the float32 computation (see `assert_bf16_features_close`).
BF16_FEATURE_ERROR = 3.0


def assert_bf16_features_close(fp32_apply, bf16_apply, params, images, tokens):
    """The bfloat16-compute model's image and text features are float32 and, tower by tower, at most
    `BF16_FEATURE_ERROR` times as far (Frobenius norm of the difference, over the batch) from the float32 model's
    as the float32 model's own features are once its params and images are rounded to bfloat16.

    The rounded inputs are the error no bfloat16 computation avoids; computing in bfloat16 rounds every activation
    as well. Measured with the two tests' models (tests/test_models.py's TINY and tests/test_model_options.py's
    HEAVY, float32 params): the ratio is 1.78 to 1.89 at the tests' seeds, 0.61 to 2.28 over six seeds of each
    model's params and inputs, so 3 leaves 1.3x over the worst (the float32 features themselves are within 1e-5 of
    OpenCLIP's: tests/test_model_parity.py). A bfloat16-only bug fails it where the former bound (atol 3e-2 or 5e-2
    on the unit features) did not: attention logits scaled 5% off give 3.4 to 6.0 (their largest element off by
    1.8e-2 at most), 10% off 5.7 to 11.7 (3.4e-2); LayerScale skipped gives 15 to 363, the text MLPs skipped 180 to
    200. LayerNorm statistics or the final L2 norm done in bfloat16 stay within the rounding here (2.2 at most): at
    these widths they cost no more than rounding the activations does."""
    expected = [np.asarray(f, np.float64) for f in fp32_apply({"params": params}, images, tokens)[:2]]
    got = bf16_apply({"params": params}, images, tokens)[:2]
    to_bf16 = lambda x: np.asarray(jax.numpy.asarray(x).astype("bfloat16").astype("float32"))  # noqa: E731
    rounded = fp32_apply({"params": jax.tree.map(to_bf16, params)}, to_bf16(images), tokens)[:2]
    for tower, e, g, r in zip(("image", "text"), expected, got, rounded):
        assert g.dtype == np.float32, tower
        error, rounding = np.linalg.norm(np.asarray(g, np.float64) - e), np.linalg.norm(np.asarray(r, np.float64) - e)
        assert 0 < rounding and error <= BF16_FEATURE_ERROR * rounding, (tower, error, rounding)


def _tower(path) -> str:
    return "visual" if path[0].key == "visual" else "text and head"


def _get(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree
