"""The tiny model most unit tests compile, its random batch, plain SGD and the check that two updates agree: shared
by the step tests (tests/conftest.py hands the model and batch out as fixtures too)."""

import jax
import numpy as np

from clip_jax.step_factory import OptimizerSpec

# Two layers a tower and a vocabulary of 1,000, so a sharded step compiles in seconds. (The OpenCLIP parity tests
# use their own, with more heads, in open_clip_reference.py.)
TINY_MODEL = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 1000, "width": 32, "heads": 2, "layers": 2},
}
SGD_LR = 0.5  # plain SGD, so the parameter change is the gradient itself (Adam's first step is ~sign(grad))
SGD = OptimizerSpec("sgd", lr=SGD_LR)


def random_batch(rows: int) -> dict[str, np.ndarray]:
    """Images and tokens for the tiny model (token ids below its vocabulary of 1000), the same on every call."""
    rng = np.random.default_rng(0)
    return {
        "images": rng.normal(size=(rows, 32, 32, 3)).astype(np.float32),
        "tokens": rng.integers(1, 1000, size=(rows, 16)).astype(np.int32),
    }


def assert_same_update(params, after, expected_after, rtol=1e-4):
    """The parameter changes agree leaf by leaf (relative to the size of the change)."""
    for path, before in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        delta = np.asarray(_get(after, path), np.float64) - before
        expected = np.asarray(_get(expected_after, path), np.float64) - before
        scale = np.linalg.norm(expected)
        assert scale > 0, name
        assert np.linalg.norm(delta - expected) <= rtol * scale, name


def _get(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree
