"""Analytic model FLOPs: 2 x the multiply-adds of every matmul, attention included, as OpenCLIP's profile counts
them (ViT-L-14: 162.03 GFLOP image + 13.30 text = 175.33 per sample forward). Norms, softmax and GELU are left out,
and so are the block options' extra norms and per-head scales (elementwise, as those are).

`train=True` counts the forward as the train step runs it: under patch dropout (`vision.patch_dropout`) the image
tower's blocks see the class token and the kept patches only (every patch is still embedded). Eval counts all.
SigLIP's image tower has no class token and no projection; its attention pool (probe query, keys and values of every
token, output projection, MLP) is counted.

A NaFlex image tower (SigLIP 2's, `vision.naflex`) is counted at a patch budget, `max_num_patches`, which the
functions that count it take (a NaFlex config without one, or a budget for any other tower, is refused): its blocks
and attention pool see the budget's tokens whole, padding patches included, since they are computed (the mask
only keeps them out of the attention's weights); the linear embedding of each flattened patch has the MACs of the
patch convolution. Resizing the position grid to each image's grid is elementwise work (an interpolation) and is
left out, as norms are.

A ResNet image tower (OpenCLIP's ModifiedResNet) counts its convolutions (2 x input channels x output channels x
the kernel taps that read the image, each conv at the resolution it runs at: a block's strided 2x2 average pool comes
before its last 1x1 conv and its shortcut's) and the attention pool (the query of the one mean token, keys and values of
every cell and the mean, scores, weighted sum, output projection). BatchNorm, ReLU and the average pools are
elementwise and left out, as norms are for a ViT; train and eval count the same (no patch dropout)."""

from clip_jax.models.config import CLIPConfig, ResNetVisionConfig, VisionConfig, is_resnet
from clip_jax.models.naflex import patch_budget
from clip_jax.models.resnet import EXPANSION
from clip_jax.models.vit import kept_patch_count


def _transformer_macs(tokens: int, width: int, mlp_width: int, layers: int) -> int:
    per_layer = (
        3 * tokens * width * width  # q, k, v projections
        + 2 * tokens * tokens * width  # scores q @ k^T and the weighted sum of values (causal masks counted whole)
        + tokens * width * width  # output projection
        + 2 * tokens * width * mlp_width  # c_fc and c_proj
    )
    return layers * per_layer


def image_patches(vision: VisionConfig, max_num_patches: int | None = None) -> int:
    """Patches the image tower embeds: its grid's, or a NaFlex tower's budget (padding patches are computed too)."""
    budget = patch_budget(vision, max_num_patches)
    return vision.grid_size**2 if budget is None else budget


def image_tokens(vision: VisionConfig, train: bool = False, max_num_patches: int | None = None) -> int:
    """Tokens the image tower's blocks see: the class token (SigLIP's tower has none) and every patch (a NaFlex
    tower's: its budget's), or in training the kept patches."""
    patches = image_patches(vision, max_num_patches)
    return int(not vision.attention_pool) + (kept_patch_count(patches, vision.patch_dropout) if train else patches)


def _attention_pool_macs(tokens: int, width: int, mlp_width: int) -> int:
    """SigLIP's pooling head: the probe's query, keys and values of every token, the one query's scores and
    weighted sum, the output projection and the MLP on the pooled vector."""
    return width * width + 2 * tokens * width * width + 2 * tokens * width + width * width + 2 * width * mlp_width


def _conv_macs(size: int, kernel: int, channels_in: int, channels_out: int, stride: int = 1) -> int:
    """Multiply-adds of a `kernel` x `kernel` conv (padding kernel // 2) whose output is `size` x `size` cells,
    counting the taps that read the image, not its zero padding."""
    pad, in_size = kernel // 2, size * stride
    taps = sum(1 for o in range(size) for k in range(kernel) if 0 <= o * stride + k - pad < in_size)  # one axis
    return taps * taps * channels_in * channels_out


def resnet_image_macs(v: ResNetVisionConfig, embed_dim: int) -> int:
    """Multiply-adds of one image through a ModifiedResNet tower (see the module docstring)."""
    half, size = v.width // 2, v.image_size // 2  # the stem's first conv has stride 2
    macs = _conv_macs(size, 3, 3, half, stride=2) + _conv_macs(size, 3, half, half) + _conv_macs(size, 3, half, v.width)
    size //= 2  # the stem's 2x2 average pool
    channels = v.width
    for stage, blocks in enumerate(v.layers):
        planes, stride = v.width * 2**stage, 1 if stage == 0 else 2
        for block in range(blocks):
            stride_here = stride if block == 0 else 1
            out_size = size // stride_here
            macs += _conv_macs(size, 1, channels, planes) + _conv_macs(size, 3, planes, planes)
            macs += _conv_macs(out_size, 1, planes, planes * EXPANSION)
            if stride_here > 1 or channels != planes * EXPANSION:  # the shortcut's 1x1 conv, after its pool
                macs += _conv_macs(out_size, 1, channels, planes * EXPANSION)
            channels, size = planes * EXPANSION, out_size
    tokens, width = v.num_tokens, v.pool_width  # the grid's cells and their mean
    macs += width * width + 2 * tokens * width * width  # q of the mean; k and v of every token
    macs += 2 * tokens * width  # scores of the one query and the weighted sum of values
    macs += width * embed_dim  # c_proj
    return macs


def image_forward_flops(config: CLIPConfig, train: bool = False, max_num_patches: int | None = None) -> int:
    """FLOPs of one image through the image tower (a NaFlex tower's at `max_num_patches`)."""
    patch_budget(config.vision, max_num_patches, config.name)  # refused where it does not belong, named
    if is_resnet(config):
        return 2 * resnet_image_macs(config.vision, config.embed_dim)
    v = config.vision
    macs = image_patches(v, max_num_patches) * (v.patch_size**2 * 3) * v.width  # patch embedding
    tokens = image_tokens(v, train, max_num_patches)
    macs += _transformer_macs(tokens, v.width, v.mlp_width, v.layers)
    if v.attention_pool:
        macs += _attention_pool_macs(tokens, v.width, v.mlp_width)
    else:
        macs += v.width * config.embed_dim  # proj of the class token
    return 2 * macs


def text_forward_flops(config: CLIPConfig) -> int:
    t = config.text
    macs = _transformer_macs(t.num_tokens, t.width, t.mlp_width, t.layers)  # with embed_cls's class token
    if t.proj_type != "none":
        macs += t.width * config.embed_dim  # text_projection of the pooled token
    return 2 * macs


def forward_flops(config: CLIPConfig, train: bool = False, max_num_patches: int | None = None) -> int:
    """FLOPs of one sample through both towers (`train`: with the step's patch dropout; a NaFlex image tower at
    `max_num_patches`)."""
    return image_forward_flops(config, train, max_num_patches) + text_forward_flops(config)


def train_flops(config: CLIPConfig, remat: bool = False, max_num_patches: int | None = None) -> int:
    """FLOPs of one sample in a train step: forward + backward (2x forward), plus one more forward when every
    block is rematerialised. The contrastive loss (B x B logits) is negligible and left out. Under patch dropout
    only the kept tokens count; a NaFlex image tower counts its budget, `max_num_patches`."""
    return (4 if remat else 3) * forward_flops(config, train=True, max_num_patches=max_num_patches)
