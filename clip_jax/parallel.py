"""Device mesh, shardings of the train state and the global batch.

One mesh axis, `"data"`, spans every device of every process. The batch is split over it; with FSDP the
parameters and optimizer state are split over the same axis (ZeRO-3 style) and gathered where used, one layer at
a time (`clip_jax.train_step.make_forward`).
"""

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"

# Leaves smaller than this many elements stay replicated under FSDP: splitting them saves nothing and costs a
# gather each. The scanned-layer key: leaves below it carry a leading layer axis that is never split.
FSDP_MIN_SIZE = 2**14
LAYER_STACK_KEY = "resblocks"


def create_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh with axis `"data"` over `devices` (default: all devices of all processes).

    The axis is `Auto`, not the `Explicit` default of `jax.make_mesh`: shardings are then fixed only at the
    jit boundary (train state, batch), inside `shard_map` (the loss) and, under FSDP, where the train step
    gathers the weights, and XLA propagates them through the model, so the model code carries no sharding
    annotations and runs unchanged on one device. (Under `Explicit` axes every op of the towers would need a
    sharding rule, and `shard_map` would refuse inputs not already sharded as its `in_specs` say.)
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("create_mesh: no devices given")
    return jax.make_mesh((len(devices),), (DATA_AXIS,), axis_types=(AxisType.Auto,), devices=devices)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over `"data"`, the rest whole."""
    return NamedSharding(mesh, P(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def path_names(path) -> list[str]:
    """A pytree key path as names: ("visual", "transformer", "resblocks", "attn", ...)."""
    return jax.tree_util.keystr(path, simple=True, separator="/").split("/")


def fsdp_spec(
    shape: Sequence[int], axis_size: int, *, stacked: bool = False, min_size: int = FSDP_MIN_SIZE
) -> P:
    """Split the largest dimension divisible by `axis_size`; replicate leaves below `min_size` elements.

    `stacked` leaves (layers scanned with `nn.scan`) keep their leading layer axis whole, so that every
    scan iteration slices its layer locally.
    """
    if axis_size == 1 or int(np.prod(shape, dtype=np.int64)) < min_size:
        return P()
    first = 1 if stacked else 0
    candidates = [d for d in range(first, len(shape)) if shape[d] % axis_size == 0]
    if not candidates:
        return P()
    dim = max(candidates, key=lambda d: (shape[d], -d))  # largest; first of equals
    spec = [None] * len(shape)
    spec[dim] = DATA_AXIS
    return P(*spec)


def state_shardings(abstract_state: Any, mesh: Mesh, *, fsdp: bool, min_size: int = FSDP_MIN_SIZE) -> Any:
    """NamedShardings for a pytree of arrays (params, optimizer state, a whole train state).

    Without FSDP everything is replicated. With FSDP each leaf follows `fsdp_spec`; the rule depends only on
    the leaf's path and shape, so Adam's moments are split exactly like the parameters they track.
    """
    axis_size = mesh.shape[DATA_AXIS]

    def leaf_sharding(path, leaf):
        if not fsdp:
            return replicated(mesh)
        stacked = LAYER_STACK_KEY in path_names(path)
        return NamedSharding(mesh, fsdp_spec(leaf.shape, axis_size, stacked=stacked, min_size=min_size))

    return jax.tree_util.tree_map_with_path(leaf_sharding, abstract_state)


def make_global_batch(local_batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Global arrays, batch split over `"data"`, from this process's rows (`[B_process, ...]` each).

    The global batch is the concatenation of every process's rows in process order.
    """
    n_local = len(mesh.local_devices)
    sharding = batch_sharding(mesh)
    batch = {}
    for name, rows in local_batch.items():
        rows = np.asarray(rows)
        if rows.ndim == 0 or rows.shape[0] % n_local:
            raise ValueError(
                f"make_global_batch: '{name}' has shape {rows.shape}; its first dimension must be a multiple "
                f"of the {n_local} local devices. Choose a per-process batch size divisible by {n_local}."
            )
        batch[name] = jax.make_array_from_process_local_data(sharding, rows)
    return batch
