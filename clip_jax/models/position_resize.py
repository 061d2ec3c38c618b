"""The NaFlex tower's positional embedding for each image's own grid: the learned g x g grid resized to the image's
rows x columns as torch's `F.interpolate(mode="bilinear", align_corners=False, antialias=True)` resizes it (what
transformers' Siglip2VisionEmbeddings and timm's NaFlexVit do), up or down, each axis on its own.

The grid is data, not a shape: each token's weights over the g x g positions are built from the image's (rows,
columns), so one compiled program resizes to every grid under a patch budget.
"""

import jax.numpy as jnp


def axis_weights(index, size, grid_size: int):
    """[..., grid_size] float32: output `index` of an axis resized from `grid_size` to `size` (arrays of the same
    shape) as weights over the `grid_size` inputs. Antialiased bilinear: a triangle filter centred on the output's
    centre in input coordinates, widened by the downscale factor when shrinking, its weights normalised to sum 1."""
    scale = grid_size / size.astype(jnp.float32)
    support = jnp.maximum(scale, 1.0)[..., None]
    center = ((index.astype(jnp.float32) + 0.5) * scale - 0.5)[..., None]
    source = jnp.arange(grid_size, dtype=jnp.float32)
    weights = jnp.maximum(1.0 - jnp.abs(source - center) / support, 0.0)
    return weights / weights.sum(-1, keepdims=True)


def resize_weights(grids, length: int, grid_size: int):
    """[B, length, grid_size**2] float32: token j of image b, the j-th cell in row-major order of its grid
    `grids[b]` = (rows, columns), as weights over the g x g positions (row-major); zero on the padding tokens
    (j >= rows * columns). `weights @ table` ([g * g, W] positional table) is each image's resized embedding."""
    grids = grids.astype(jnp.int32)
    rows, columns = jnp.maximum(grids[:, :1], 1), jnp.maximum(grids[:, 1:], 1)  # [B, 1]; a zero grid: all padding
    token = jnp.arange(length, dtype=jnp.int32)[None]  # [1, N]
    own = token < grids[:, :1] * grids[:, 1:]  # [B, N]
    token = jnp.where(own, token, 0)  # padding as the first cell: a row past the grid would weigh nothing (0 / 0)
    row_weights = axis_weights(token // columns, rows, grid_size)  # [B, N, g]
    column_weights = axis_weights(token % columns, columns, grid_size)
    weights = (row_weights[..., :, None] * column_weights[..., None, :]).reshape(grids.shape[0], length, -1)
    return weights * own[..., None]
