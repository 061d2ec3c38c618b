"""Device mesh, shardings of the train state and the global batch.

One mesh axis, `"data"`, spans every device of every process. The batch is split over it; with FSDP the
parameters and optimizer state are split over the same axis (ZeRO-3 style) and gathered where used, one layer at
a time (`clip_jax.training.train_step.make_forward`).

FSDP splits a leaf along a dimension that the device count divides. Where a large leaf has none (ViT-L/14's 1024
and 4096 on 384 GPUs), the mesh becomes a grid of two axes, `("replica", "data")` (3 x 128 there): the batch, and
every leaf that can be, are split over both, that is over every device; such a leaf is split over `"data"` alone,
each slice held by the devices of one `"replica"` column. `batch_axes` and `data_parallel_size` read either mesh.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from clip_jax.errors import InvalidInput

DATA_AXIS = "data"
REPLICA_AXIS = "replica"  # in a (replica, data) grid: the devices holding the same slice of an FSDP leaf

# Leaves smaller than this many elements stay replicated under FSDP: splitting them saves nothing and costs a
# gather each. The scanned-layer key: leaves below it carry a leading layer axis that is never split.
FSDP_MIN_SIZE = 2**14
LAYER_STACK_KEY = "resblocks"
BATCH_STATS_KEY = "batch_stats"  # the train state's BatchNorm statistics (a ResNet image tower)
POLICY_STATE_KEY = "policy_state"  # the train state's slot for a precision policy's own state (fp16's loss scale)


def create_mesh(devices: Sequence[jax.Device] | None = None, *, fsdp_params: Any = None) -> Mesh:
    """A 1-D mesh with axis `"data"` over `devices` (default: all devices of all processes); for an FSDP run given
    its parameters' shapes (`fsdp_params`) whose large leaves do not all have a dimension the device count divides,
    a `("replica", "data")` grid of the same devices in the same order (`fsdp_data_size`).

    The axes are `Auto`, not the `Explicit` default of `jax.make_mesh`: shardings are then fixed only at the
    jit boundary (train state, batch), inside `shard_map` (the loss) and, under FSDP, where the train step
    gathers the weights, and XLA propagates them through the model, so the model code carries no sharding
    annotations and runs unchanged on one device. (Under `Explicit` axes every op of the towers would need a
    sharding rule, and `shard_map` would refuse inputs not already sharded as its `in_specs` say.)
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("create_mesh: no devices given")
    data = len(devices) if fsdp_params is None else fsdp_data_size(fsdp_params, len(devices))
    if data == len(devices):
        return jax.make_mesh((len(devices),), (DATA_AXIS,), axis_types=(AxisType.Auto,), devices=devices)
    # Row-major, so the flattened grid is the device list: batch rows land where they would on the 1-D mesh.
    grid = np.array(devices, dtype=object).reshape(len(devices) // data, data)
    return Mesh(grid, (REPLICA_AXIS, DATA_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))


def batch_axes(mesh: Mesh) -> str | tuple[str, str]:
    """The mesh axes the batch is split over: every device."""
    return (REPLICA_AXIS, DATA_AXIS) if REPLICA_AXIS in mesh.shape else DATA_AXIS


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways the batch is split: the device count of the mesh."""
    return math.prod(mesh.shape[axis] for axis in (REPLICA_AXIS, DATA_AXIS) if axis in mesh.shape)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over every device, the rest whole."""
    return NamedSharding(mesh, P(batch_axes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def path_names(path) -> list[str]:
    """A pytree key path as names: ("visual", "transformer", "resblocks", "attn", ...)."""
    return jax.tree_util.keystr(path, simple=True, separator="/").split("/")


def fsdp_spec(
    shape: Sequence[int], axis_size: int, *, stacked: bool = False, min_size: int = FSDP_MIN_SIZE,
    axis: str | tuple[str, ...] = DATA_AXIS,
) -> P:
    """Split the largest dimension divisible by `axis_size` over `axis`; replicate leaves below `min_size`
    elements.

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
    spec[dim] = axis
    return P(*spec)


def is_split(spec: P) -> bool:
    return any(entry is not None for entry in spec)


def fsdp_data_size(params: Any, num_devices: int, *, min_size: int = FSDP_MIN_SIZE) -> int:
    """The size of the `"data"` axis for an FSDP run of these parameters (shapes suffice) on `num_devices`: all
    of them when every large leaf has a dimension they divide; otherwise the largest divisor of the count that a
    dimension of each such leaf allows (a leaf that even 2 does not split stays whole, and does not count)."""
    def layouts():
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            yield leaf.shape, LAYER_STACK_KEY in path_names(path)

    unsplit = [(shape, stacked) for shape, stacked in layouts()
               if not is_split(fsdp_spec(shape, num_devices, stacked=stacked, min_size=min_size))
               and is_split(fsdp_spec(shape, 2, stacked=stacked, min_size=min_size))]
    for size in sorted((d for d in range(2, num_devices + 1) if num_devices % d == 0), reverse=True):
        if all(is_split(fsdp_spec(shape, size, stacked=stacked, min_size=min_size)) for shape, stacked in unsplit):
            return size
    return num_devices


def fsdp_leaf_spec(mesh: Mesh, shape: Sequence[int], *, stacked: bool = False,
                   min_size: int = FSDP_MIN_SIZE) -> P:
    """Where FSDP keeps a leaf: split over every device when a dimension allows it, else (on a grid) over
    `"data"` alone, else whole."""
    spec = fsdp_spec(shape, data_parallel_size(mesh), stacked=stacked, min_size=min_size, axis=batch_axes(mesh))
    if is_split(spec) or REPLICA_AXIS not in mesh.shape:
        return spec
    return fsdp_spec(shape, mesh.shape[DATA_AXIS], stacked=stacked, min_size=min_size)


def state_shardings(abstract_state: Any, mesh: Mesh, *, fsdp: bool, min_size: int = FSDP_MIN_SIZE) -> Any:
    """NamedShardings for a pytree of arrays (params, optimizer state, a whole train state).

    Without FSDP everything is replicated. With FSDP each leaf follows `fsdp_leaf_spec`; the rule depends only
    on the leaf's path and shape, so Adam's moments are split exactly like the parameters they track. A ResNet's
    conv kernels ([kh, kw, in, out]) split like any kernel, on their largest dimension the device count divides;
    BatchNorm's scales and biases are vectors of at most a few thousand channels, below `FSDP_MIN_SIZE`, and stay
    whole. Its running statistics (the train state's `batch_stats`) are always replicated: every device normalises
    with all of them, and they are small (0.42 MiB for RN50x4). So is a precision policy's own state
    (`policy_state`: a few scalars, the same on every device).
    """

    def leaf_sharding(path, leaf):
        names = path_names(path)
        if not fsdp or names[0] in (BATCH_STATS_KEY, POLICY_STATE_KEY):
            return replicated(mesh)
        stacked = LAYER_STACK_KEY in names
        return NamedSharding(mesh, fsdp_leaf_spec(mesh, leaf.shape, stacked=stacked, min_size=min_size))

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
            raise InvalidInput(
                f"make_global_batch: '{name}' has shape {rows.shape}; its first dimension must be a multiple "
                f"of the {n_local} local devices. Choose a per-process batch size divisible by {n_local}."
            )
        batch[name] = jax.make_array_from_process_local_data(sharding, rows)
    return batch
