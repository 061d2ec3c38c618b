"""The NaFlex image tower's train step as the planner compiles it: from abstract NaFlex rows its memory is that of the
step lowered from real rows of images at several aspect ratios, and the step runs on them. (SigLIP 2's NaFlex SO400M/16
planned on H200s at 256, 576 and 1024 patches beside its fixed-resolution tower: benchmarks/naflex_plan.py.)"""

import jax
import numpy as np
import pytest
from tiny_model import naflex_model

from clip_jax import plan as planner
from clip_jax.models.naflex import pack_rows, row_width
from clip_jax.runtime.mesh import create_mesh, make_global_batch
from clip_jax.training.step_factory import StepSpec, build_step

BUDGET = 24


def naflex_rows(count: int, rng) -> np.ndarray:
    """NaFlex rows [count, BUDGET, 8 * 8 * 3 + 2] of images at grids from 1 x 24 to 6 x 4 (some padded)."""
    grids = [(1, 24), (4, 6), (6, 4), (3, 5), (2, 2), (4, 4)]
    return np.stack([pack_rows(rng.normal(size=(r * c, 8 * 8 * 3)), (r, c), BUDGET)
                     for r, c in (grids[i % len(grids)] for i in range(count))])


@pytest.mark.slow
def test_planned_naflex_memory_is_xla_memory_of_the_step_on_real_rows():
    setup = StepSpec.for_model(naflex_model(), "fp32", "nothing_saveable", fsdp=True, max_num_patches=BUDGET)
    mesh = create_mesh(jax.devices()[:8])
    per_device = 3
    planned = planner.StepMemory.of(planner.compile_train_step(setup, mesh, per_device))

    step = build_step(setup, mesh)
    state = step.init(1)
    rng = np.random.default_rng(0)
    batch = make_global_batch({"images": naflex_rows(8 * per_device, rng),
                               "tokens": rng.integers(1, 999, size=(8 * per_device, 16)).astype(np.int32)}, mesh)
    real = planner.StepMemory.of(step.update.lower(state, batch).compile())
    assert batch["images"].shape == (24, BUDGET, row_width(8))
    assert planned.total == pytest.approx(real.total, rel=1e-3)
    assert planned.argument == real.argument
    held = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state))
    assert real.argument == held + planner.batch_bytes_per_device(setup.model, per_device, BUDGET)
    # The step runs on them: one update, a finite loss.
    _, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
