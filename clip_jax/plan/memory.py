"""Memory per device: XLA's memory analysis of the compiled step, the train state and batch it holds, and the
searches over it (the largest per-device batch that fits, the accumulation that makes a batch fit)."""

import math
from collections.abc import Callable

import jax
import numpy as np

from clip_jax.errors import InvalidInput
from clip_jax.models import CLIPConfig
from clip_jax.models.naflex import image_input_shape
from clip_jax.training.step_factory import StepMemory, StepSpec, build_step  # noqa: F401 (StepMemory: the planner's)


class BatchDoesNotFit(InvalidInput):
    """Even one sample per device needs more memory than the budget."""


def state_bytes_per_device(spec: StepSpec, mesh) -> int:
    """Params + optimizer state + step counter held by one device, from the tree and its shardings."""
    total = 0
    for leaf in jax.tree.leaves(build_step(spec, mesh).abstract_state):
        total += math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total


def batch_bytes_per_device(config: CLIPConfig, per_device_batch: int, max_num_patches: int | None = None) -> int:
    """Bytes of the batch one device holds: float32 images (a NaFlex tower's rows at `max_num_patches`) and int32
    tokens."""
    image_bytes = math.prod(image_input_shape(config.vision, max_num_patches, config.name)) * 4
    return per_device_batch * (image_bytes + config.text.context_length * 4)


def largest_fitting_batch(memory_of: Callable[[int], int], budget: int, *, guess: int = 1,
                          limit: int = 1 << 16) -> int:
    """The largest batch b <= `limit` with memory_of(b) <= budget, for memory growing with b.

    Brackets the answer between a batch that fits and one that does not (doubling from `guess`), then shrinks the
    bracket in rounds of three probes: the affine interpolation of the bracket's ends at the budget, its neighbour
    on the other side of the budget (compiled memory is close to affine in the batch, so these two usually settle
    it), and the midpoint, which keeps the search logarithmic when they do not. The result fits and the next batch
    does not (unless it is `limit`). Raises BatchDoesNotFit when even b = 1 does not fit.
    """
    probes: dict[int, int] = {}

    def fits(b: int) -> bool:
        if b not in probes:
            probes[b] = memory_of(b)
        return probes[b] <= budget

    if not fits(1):
        raise BatchDoesNotFit(f"batch 1 needs {probes[1]:,} bytes, more than the budget of {budget:,}")
    lo, hi = 1, None
    b = min(max(guess, 2), limit)
    while hi is None:
        if fits(b):
            lo = b
            if b == limit:
                return limit
            b = min(2 * b, limit)
        else:
            hi = b
    round_probe = 0
    while hi - lo > 1:
        if round_probe == 0:  # interpolate
            slope = (probes[hi] - probes[lo]) / (hi - lo)
            b = lo + int((budget - probes[lo]) / slope) if slope > 0 else (lo + hi) // 2
        elif round_probe == 1:  # the neighbour across the budget of the interpolated batch
            b = b + 1 if b == lo else b - 1
        else:
            b = (lo + hi) // 2
        b = min(max(b, lo + 1), hi - 1)
        if fits(b):
            lo = b
        else:
            hi = b
        round_probe = (round_probe + 1) % 3
    return lo


def smallest_accum(batch_size: int, start: int, fits_with: Callable[[int], bool]) -> int | None:
    """The smallest divisor k >= start of the per-device batch whose accumulated step fits."""
    for k in range(max(start, 1), batch_size + 1):
        if batch_size % k == 0 and fits_with(k):
            return k
    return None


def affine_fit(probes: dict[int, int]) -> tuple[float, float] | None:
    """(bytes at batch 0, bytes per sample) through the compiled points, None with fewer than two: how other GPUs'
    largest batches are estimated without compiling for them."""
    if len(probes) < 2:
        return None
    b, m = np.array(list(probes), float), np.array(list(probes.values()), float)
    slope, intercept = np.polyfit(b, m, 1)
    return float(intercept), float(slope)


def memory_savers(config) -> str:
    """What the config could change to need less memory per device, as a sentence end."""
    savers = []
    if not config.grad_checkpointing:
        savers.append("grad_checkpointing=True")
    if not config.fsdp:
        savers.append("fsdp=True")
    if config.precision != "pure_bf16":
        savers.append("precision='pure_bf16'")
    return ", ".join(savers + ["a GPU with more memory"])
