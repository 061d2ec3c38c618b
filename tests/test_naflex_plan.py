"""A NaFlex image tower planned at a patch budget: its FLOPs count the budget's patches whole (padding included), the
planned step's images are NaFlex rows [B, N, P * P * 3 + 2], and a budget is needed by a NaFlex model and refused by
any other, in one line, before anything compiles."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from tiny_model import naflex_model

from clip_jax import plan as planner
from clip_jax.errors import InvalidInput
from clip_jax.models import get_model_config
from clip_jax.models.flops import forward_flops, image_forward_flops, train_flops
from clip_jax.plan.flops import analytic_only
from clip_jax.run_config import default_config
from clip_jax.runtime.mesh import create_mesh
from clip_jax.training.step_factory import StepSpec, build_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAFLEX = "ViT-SO400M-16-SigLIP2-NaFlex"


def products(matmuls) -> int:
    """2 x the multiply-adds of [m, k] @ [k, n] products, given as (m, k, n)."""
    return 2 * sum(m * k * n for m, k, n in matmuls)


def so400m_image_by_hand(patches: int) -> int:
    """One image through SigLIP 2's SO400M/16 image tower at `patches` tokens, product by product."""
    n, w, mlp, heads, head = patches, 1152, 4304, 16, 72
    embed = [(n, 16 * 16 * 3, w)]  # each flattened 16 x 16 x 3 patch times the embedding
    block = [(n, w, 3 * w),  # q, k, v
             *[(n, head, n)] * heads, *[(n, n, head)] * heads,  # every head's scores and weighted values
             (n, w, w), (n, w, mlp), (n, mlp, w)]  # output projection, the MLP
    pool = [(1, w, w), (n, w, 2 * w),  # the probe's query; keys and values of every token
            *[(1, head, n)] * heads, *[(1, n, head)] * heads,  # the one query's scores and weighted values
            (1, w, w), (1, w, mlp), (1, mlp, w)]  # output projection, the MLP
    return products(embed + 27 * block + pool)


@pytest.mark.parametrize("budget", [256, 576, 1024])
def test_naflex_image_flops_are_the_budgets_patches_counted_by_hand(budget):
    config = get_model_config(NAFLEX)
    assert image_forward_flops(config, max_num_patches=budget) == so400m_image_by_hand(budget)
    # The train step: 3x the forward of both towers (no patch dropout), the text tower's whatever the budget.
    text = forward_flops(config, max_num_patches=budget) - so400m_image_by_hand(budget)
    assert text == forward_flops(config, max_num_patches=64) - so400m_image_by_hand(64)
    assert train_flops(config, max_num_patches=budget) == 3 * (so400m_image_by_hand(budget) + text)


def test_a_naflex_tower_at_its_fixed_resolution_budget_counts_as_the_fixed_resolution_tower():
    """SigLIP 2's fixed-resolution SO400M/16 at 384 sees 24 x 24 patches: the NaFlex tower at 576 does the same work
    (the linear patch embedding as the convolution; the position grid's resize is left out, as norms are)."""
    fixed = get_model_config("ViT-SO400M-16-SigLIP2-384")
    assert forward_flops(get_model_config(NAFLEX), max_num_patches=576) == forward_flops(fixed)


def test_the_registry_names_siglip2_naflex_as_the_384_models_towers_with_a_16_by_16_position_grid():
    config, fixed = get_model_config(NAFLEX), get_model_config("ViT-SO400M-16-SigLIP2-384")
    assert config.vision.naflex and (config.vision.image_size, config.vision.patch_size) == (256, 16)
    assert config.vision.grid_size == 16 and config.vision.attention_pool
    assert config.text == fixed.text and config.embed_dim == fixed.embed_dim
    assert config.init_logit_bias == fixed.init_logit_bias
    assert config.vision == dataclasses.replace(fixed.vision, naflex=True, image_size=256)


def test_a_budget_is_needed_by_a_naflex_tower_and_refused_by_any_other():
    with pytest.raises(InvalidInput, match=f"{NAFLEX}'s image tower is NaFlex: give max_num_patches.*e.g. 256"):
        forward_flops(get_model_config(NAFLEX))
    with pytest.raises(InvalidInput, match="max_num_patches=256: ViT-B-32's image tower is not NaFlex \\(it takes "
                                           "224 x 224 images\\): leave max_num_patches out"):
        train_flops(get_model_config("ViT-B-32"), max_num_patches=256)
    with pytest.raises(InvalidInput, match="max_num_patches=256: RN50's image tower is not NaFlex"):
        forward_flops(get_model_config("RN50"), max_num_patches=256)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(InvalidInput, match=f"max_num_patches={bad!r}: give a positive number of patches"):
            forward_flops(get_model_config(NAFLEX), max_num_patches=bad)
    with pytest.raises(InvalidInput, match="ViT-B-32's image tower is not NaFlex"):
        StepSpec.for_model("ViT-B-32", max_num_patches=256)


def test_the_planned_steps_images_are_naflex_rows_of_the_budget_split_over_the_devices():
    spec = StepSpec.for_model(naflex_model(), "bf16", max_num_patches=12)
    mesh = create_mesh(jax.devices()[:8])
    batch = build_step(spec, mesh).abstract_batch(per_device_batch=3)
    images, tokens = batch["images"], batch["tokens"]
    assert (images.shape, images.dtype) == ((24, 12, 8 * 8 * 3 + 2), jnp.float32)
    assert images.sharding.shard_shape(images.shape) == (3, 12, 194)
    assert tokens.shape == (24, 16) and tokens.dtype == jnp.int32
    # The batch bytes the planner reports: 3 samples of 12 rows of 194 float32 and 16 int32 tokens.
    assert planner.batch_bytes_per_device(spec.model, 3, 12) == 3 * (12 * 194 * 4 + 16 * 4)
    # The analytic FLOPs the planner takes count the budget: 12 tokens through the tower's two blocks.
    flops = analytic_only(spec)
    assert flops.forward_analytic == forward_flops(spec.model, max_num_patches=12)
    assert flops.train_analytic == 3 * flops.forward_analytic
    with pytest.raises(InvalidInput, match="image tower is NaFlex: give max_num_patches"):
        build_step(StepSpec.for_model(naflex_model()), mesh).abstract_batch(per_device_batch=3)


def tiny_naflex_run(**fields):
    c = default_config()
    c.update(model=NAFLEX, loss="siglip", batch_size=2, precision="bf16", train_num_samples=1000, workers=1)
    c.update(fields)
    return c


def test_the_planner_needs_a_budget_for_a_naflex_model_and_refuses_one_for_any_other_before_compiling():
    devices = jax.devices()[:1]
    with pytest.raises(InvalidInput, match=f"{NAFLEX}'s image tower is NaFlex: give max_num_patches"):
        planner.plan(tiny_naflex_run(), "h200", 1, devices=devices)
    with pytest.raises(InvalidInput, match="max_num_patches=576: ViT-B-32's image tower is not NaFlex"):
        planner.plan(tiny_naflex_run(model="ViT-B-32"), "h200", 1, devices=devices, max_num_patches=576)


@pytest.mark.subprocess
def test_the_command_line_refuses_a_budget_for_a_model_that_is_not_naflex_in_one_line():
    command = [sys.executable, "-m", "clip_jax.plan", "--config", os.path.join(REPO, "configs/l14_laion2b.py"),
               "--gpu", "h200", "--max_num_patches", "256"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == ["error: max_num_patches=256: ViT-L-14's image tower is not NaFlex (it takes 224 x 224 images): "
                     "leave max_num_patches out"], done.stderr[-2000:]
