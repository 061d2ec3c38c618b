"""Analytic model FLOPs: 2 x the multiply-adds of every matmul, attention included, as OpenCLIP's profile counts
them (ViT-L-14: 162.03 GFLOP image + 13.30 text = 175.33 per sample forward). Norms, softmax and GELU are left out,
and so are the block options' extra norms and per-head scales (elementwise, as those are).

`train=True` counts the forward as the train step runs it: under patch dropout (`vision.patch_dropout`) the image
tower's blocks see the class token and the kept patches only (every patch is still embedded). Eval counts all."""

from clip_jax.models.config import CLIPConfig, VisionConfig, require_vit
from clip_jax.models.vit import kept_patch_count


def _transformer_macs(tokens: int, width: int, mlp_width: int, layers: int) -> int:
    per_layer = (
        3 * tokens * width * width  # q, k, v projections
        + 2 * tokens * tokens * width  # scores q @ k^T and the weighted sum of values (causal masks counted whole)
        + tokens * width * width  # output projection
        + 2 * tokens * width * mlp_width  # c_fc and c_proj
    )
    return layers * per_layer


def image_tokens(vision: VisionConfig, train: bool = False) -> int:
    """Tokens the image tower's blocks see: the class token and every patch, or in training the kept patches."""
    patches = vision.grid_size**2
    return 1 + (kept_patch_count(patches, vision.patch_dropout) if train else patches)


def image_forward_flops(config: CLIPConfig, train: bool = False) -> int:
    require_vit(config, "the analytic FLOPs count")
    v = config.vision
    patches = v.grid_size**2
    macs = patches * (v.patch_size**2 * 3) * v.width  # patch embedding
    macs += _transformer_macs(image_tokens(v, train), v.width, v.mlp_width, v.layers)
    macs += v.width * config.embed_dim  # proj of the class token
    return 2 * macs


def text_forward_flops(config: CLIPConfig) -> int:
    t = config.text
    macs = _transformer_macs(t.num_tokens, t.width, t.mlp_width, t.layers)  # with embed_cls's class token
    if t.proj_type != "none":
        macs += t.width * config.embed_dim  # text_projection of the pooled token
    return 2 * macs


def forward_flops(config: CLIPConfig, train: bool = False) -> int:
    """FLOPs of one sample through both towers (`train`: with the step's patch dropout)."""
    return image_forward_flops(config, train) + text_forward_flops(config)


def train_flops(config: CLIPConfig, remat: bool = False) -> int:
    """FLOPs of one sample in a train step: forward + backward (2x forward), plus one more forward when every
    block is rematerialised. The contrastive loss (B x B logits) is negligible and left out. Under patch dropout
    only the kept tokens count."""
    return (4 if remat else 3) * forward_flops(config, train=True)
