"""The NaFlex image tower's input: each image at its own aspect ratio as a grid of patches, padded to a budget.

A batch of NaFlex images is one float32 array [B, N, P * P * 3 + 2] ("NaFlex rows"), N the patch budget
(`max_num_patches`) and P the patch size. Row j of image b is its j-th patch in row-major order over the image's
grid: the patch's pixels, normalised, in (row, column, channel) order (the order of the patch embedding's kernel
[P, P, 3, W] flattened), then the image's grid (rows, columns) in the last two columns. Padding rows, after an
image's rows x columns patches, are zero throughout, so a zero grid marks them. One array makes a NaFlex batch
travel every path an image batch does (padding rows, splitting over devices) and keeps the grid data, not a shape:
one compiled program serves every aspect ratio at a budget.
"""

import numbers

import numpy as np

from clip_jax.errors import InvalidInput

GRID_COLUMNS = 2  # (rows, columns) of the image's patch grid, after the pixels


def row_width(patch_size: int) -> int:
    """The width of a NaFlex row for patches of `patch_size`: the pixels, then the grid."""
    return patch_size * patch_size * 3 + GRID_COLUMNS


def patch_budget(vision, max_num_patches: int | None, name: str = "this model") -> int | None:
    """The patch budget an image tower runs at: `max_num_patches` for a NaFlex tower, which needs one; None for any
    other tower (a ViT's or a ResNet's config), which takes square images and refuses a budget. `name` names the
    model in the one-line `InvalidInput`."""
    if not getattr(vision, "naflex", False):
        if max_num_patches is not None:
            raise InvalidInput(f"max_num_patches={max_num_patches}: {name}'s image tower is not NaFlex (it takes "
                               f"{vision.image_size} x {vision.image_size} images): leave max_num_patches out")
        return None
    if max_num_patches is None:
        raise InvalidInput(f"{name}'s image tower is NaFlex: give max_num_patches, its patch budget per image "
                           f"(padding included; e.g. {vision.grid_size**2}, its position grid's "
                           f"{vision.grid_size} x {vision.grid_size})")
    if isinstance(max_num_patches, bool) or not isinstance(max_num_patches, numbers.Integral) or max_num_patches < 1:
        raise InvalidInput(f"max_num_patches={max_num_patches!r}: give a positive number of patches per image")
    return int(max_num_patches)


def image_input_shape(vision, max_num_patches: int | None = None, name: str = "this model") -> tuple[int, ...]:
    """One sample's image input: [image_size, image_size, 3] pixels, or a NaFlex tower's rows
    [max_num_patches, P * P * 3 + 2] (both float32)."""
    budget = patch_budget(vision, max_num_patches, name)
    if budget is None:
        return vision.image_size, vision.image_size, 3
    return budget, row_width(vision.patch_size)


def pack_rows(patches, grid: tuple[int, int], max_num_patches: int) -> np.ndarray:
    """One image's NaFlex rows [max_num_patches, P * P * 3 + 2] from its patches [rows * columns, P * P * 3]
    (row-major over the grid, each patch in (row, column, channel) order) and its grid (rows, columns)."""
    patches = np.asarray(patches, np.float32)
    rows, columns = grid
    if patches.ndim != 2 or len(patches) != rows * columns:
        raise ValueError(f"patches {patches.shape} are not a {rows} x {columns} grid of flattened patches")
    if len(patches) > max_num_patches:
        raise ValueError(f"a {rows} x {columns} grid has more than max_num_patches={max_num_patches} patches")
    out = np.zeros((max_num_patches, patches.shape[1] + GRID_COLUMNS), np.float32)
    out[:len(patches), :-GRID_COLUMNS] = patches
    out[:len(patches), -GRID_COLUMNS:] = grid
    return out


def blank_rows(batch_size: int, patch_size: int, grid: tuple[int, int], max_num_patches: int) -> np.ndarray:
    """NaFlex rows [batch_size, max_num_patches, P * P * 3 + 2] of zero images, each a `grid` of patches."""
    rows, columns = grid
    one = pack_rows(np.zeros((rows * columns, row_width(patch_size) - GRID_COLUMNS)), grid, max_num_patches)
    return np.broadcast_to(one, (batch_size, *one.shape)).copy()


def split_rows(rows):
    """NaFlex rows [B, N, D + 2] -> (patches [B, N, D], grids [B, 2] int32 (rows, columns), mask [B, N] bool, True
    on an image's own patches). Works on numpy and JAX arrays alike."""
    xp = np if isinstance(rows, np.ndarray) else _jnp()
    patches, grid_columns = rows[..., :-GRID_COLUMNS], rows[..., -GRID_COLUMNS:]
    grids = grid_columns[:, 0].astype(xp.int32)  # an image's first row is its own (every image has a patch)
    return patches, grids, grid_columns[..., 0] > 0


def _jnp():
    import jax.numpy as jnp

    return jnp
