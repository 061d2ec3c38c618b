"""The model config dataclasses: `CLIPConfig`, its towers (`VisionConfig` or `ResNetVisionConfig`, `TextConfig`) and
their residual blocks (`BlockConfig`), each checked when built (`InvalidInput` naming the field).

A `CLIPConfig` holds the architecture, the numbers that decide the parameter tree, and, as OpenCLIP's JSON does,
the image tower's training-time `patch_dropout` (it changes no parameter and no eval output). How the model runs
(compute dtype, rematerialisation, attention kernel) is chosen when it is created, so one checkpoint can be run
under any of them. OpenCLIP's JSON in and out: `clip_jax.models.open_clip_json`; named models:
`clip_jax.models.registry`.
"""

import dataclasses
import math

from clip_jax.errors import InvalidInput

GELU_APPROXIMATIONS = ("none", "tanh")  # torch's nn.GELU(approximate=...), what OpenCLIP's act_kwargs can set
BLOCK_TYPES = (None, "default", "custom")
VISION_POOL_TYPES = ("tok", "avg", "map")
TEXT_POOL_TYPES = ("argmax", "first", "last", "eos")
TEXT_PROJ_TYPES = ("linear", "none")
UNNAMED = "custom"  # the name of a model given as a bare config (a dict): it says nothing about the model


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """A tower's residual-block options, with OpenCLIP's names (its `CLIPVisionCfg` / `CLIPTextCfg` fields).

    `block_type` None picks OpenCLIP's custom block when any of its options is on, else the default block; the two
    have the same parameter names and compute the same function when no option is on. The custom block's options
    (NormFormer / Swin-V2 / Foundation-Transformer ideas, as OpenCLIP builds them):
    `qk_norm`: LayerNorm over each head's q and k (`attn.ln_q`, `attn.ln_k`);
    `scaled_cosine_attn`: logits are cosines of q and k times a learned per-head scale exp(min(s, ln 100))
    (`attn.logit_scale`, [heads, 1, 1], init ln 10);
    `scale_heads`: a learned per-head factor on the attention output (`attn.head_scale`, [heads, 1, 1]);
    `scale_attn_inner`: LayerNorm on the merged heads before the output projection (`attn.ln_inner`);
    `scale_attn`: LayerNorm on the attention branch's output (`ln_attn`);
    `scale_fc`: LayerNorm between the MLP's activation and its output projection (`mlp.ln`).
    `ls_init_value` (either block): LayerScale on both residual branches (`ls_1.gamma`, `ls_2.gamma`).

    The tower's `norm_kwargs` and `act_kwargs` live here too, since every LayerNorm of the tower (ln_pre, ln_post,
    ln_final included) and every MLP takes them: `norm_eps`, `norm_scale` / `norm_bias` (torch's `eps`,
    `elementwise_affine`, `bias`), `gelu_approximate` (torch's GELU `approximate`).
    """

    block_type: str | None = None
    qk_norm: bool = False
    scaled_cosine_attn: bool = False
    scale_heads: bool = False
    scale_attn_inner: bool = False
    scale_attn: bool = False
    scale_fc: bool = False
    ls_init_value: float | None = None
    norm_eps: float = 1e-5
    norm_scale: bool = True
    norm_bias: bool = True
    gelu_approximate: str = "none"

    def __post_init__(self):
        if self.block_type not in BLOCK_TYPES:
            raise InvalidInput(f"block_type={self.block_type!r}: choose one of {BLOCK_TYPES}")
        if self.qk_norm and self.scaled_cosine_attn:
            raise InvalidInput("qk_norm and scaled_cosine_attn cannot both be on (OpenCLIP refuses the pair: cosine "
                               "attention normalises q and k already)")
        if self.block_type == "default" and self.custom_options():
            raise InvalidInput(f"block_type='default' with {self.custom_options()}: those options exist only in "
                               "the custom block (OpenCLIP would build the default block and drop them); set "
                               "block_type='custom' or leave it out")
        if self.gelu_approximate not in GELU_APPROXIMATIONS:
            raise InvalidInput(f"act_kwargs approximate={self.gelu_approximate!r}: choose one of "
                               f"{GELU_APPROXIMATIONS}")
        if not self.norm_eps > 0:
            raise InvalidInput(f"norm_kwargs eps={self.norm_eps} must be positive")
        if not self.norm_scale:
            object.__setattr__(self, "norm_bias", False)  # torch: elementwise_affine=False has no bias either

    def custom_options(self) -> list[str]:
        """The custom block's options that are on, by name."""
        names = ("qk_norm", "scaled_cosine_attn", "scale_heads", "scale_attn_inner", "scale_attn", "scale_fc")
        return [name for name in names if getattr(self, name)]

    @property
    def custom(self) -> bool:
        """Whether this is OpenCLIP's custom block (its own attention module) rather than the default one."""
        return self.block_type == "custom" or (self.block_type is None and bool(self.custom_options()))


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    image_size: int
    patch_size: int
    width: int
    layers: int
    heads: int
    mlp_width: int
    # Training only (FLIP, OpenCLIP's key): the train step keeps max(1, int(N * (1 - p))) of the N patches per
    # sample, drawn at random, plus the class token. Eval never drops.
    patch_dropout: float = 0.0
    block: BlockConfig = BlockConfig()
    no_ln_pre: bool = False  # no LayerNorm between the embeddings and the blocks
    # "tok": the class token; "avg": the mean of the patch tokens. ln_post runs on every token before pooling,
    # or on the pooled vector only when final_ln_after_pool.
    # "map": SigLIP's tower (timm's `vit_*_siglip_*`, transformers' SiglipVisionModel): no class token, a patch
    # convolution with a bias, ln_post on every token, then multi-head attention pooling from a learned probe
    # followed by a residual MLP (`attn_pool`); no projection (the model's embed_dim is the tower's width).
    pool_type: str = "tok"
    final_ln_after_pool: bool = False
    # SigLIP 2's NaFlex tower (transformers' Siglip2VisionModel): a "map" tower that takes each image at its own
    # aspect ratio as a grid of patches under a patch budget (`clip_jax.models.naflex` has the input's layout), its
    # learned position grid (image_size / patch_size square) resized to each image's grid; padding patches masked.
    naflex: bool = False

    def __post_init__(self):
        if not 0.0 <= self.patch_dropout < 1.0:
            raise InvalidInput(f"patch_dropout={self.patch_dropout} must be in [0, 1)")
        if self.pool_type not in VISION_POOL_TYPES:
            raise InvalidInput(f"vision pool_type={self.pool_type!r}: choose one of {VISION_POOL_TYPES}")
        if self.pool_type == "map" and self.final_ln_after_pool:
            raise InvalidInput("vision pool_type='map' with final_ln_after_pool: SigLIP's attention pool reads "
                               "every token after ln_post (leave final_ln_after_pool out)")
        if self.naflex and self.pool_type != "map":
            raise InvalidInput(f"vision naflex with pool_type={self.pool_type!r}: a NaFlex tower is SigLIP 2's, "
                               "pooled by attention from a learned probe (pool_type 'map')")
        if self.naflex and self.patch_dropout:
            raise InvalidInput(f"vision naflex with patch_dropout={self.patch_dropout}: a NaFlex tower takes no patch "
                               "dropout yet (leave patch_dropout out, or 0)")

    @property
    def attention_pool(self) -> bool:
        """SigLIP's tower: no class token, pooled by attention from a learned probe."""
        return self.pool_type == "map"

    @property
    def grid_size(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_tokens(self) -> int:  # patches plus the class token (none in SigLIP's tower)
        return self.grid_size**2 + int(not self.attention_pool)


RESNET_STAGES = 4  # OpenCLIP's ModifiedResNet: layer1 ... layer4
# Each of the stem's stride-2 conv and average pool, and the strided first block of stages 2-4, halves the image:
# the attention pool sees a grid of image_size / 32, and only a multiple of 32 gives the grid its pool was made for.
RESNET_REDUCTION = 32


@dataclasses.dataclass(frozen=True)
class ResNetVisionConfig:
    """OpenCLIP's ModifiedResNet image tower (`vision_cfg` with a list of 4 `layers`): a 3-conv stem of widths
    width/2, width/2, width, then 4 stages of `layers[i]` bottleneck blocks of width width * 2**i (output 4x that),
    then attention pooling over a grid of image_size/32 with `width * 32 / head_width` heads."""

    image_size: int
    layers: tuple[int, ...]
    width: int = 64
    head_width: int = 64

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        if len(self.layers) != RESNET_STAGES or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                        for n in self.layers):
            raise InvalidInput(f"vision_cfg.layers={list(self.layers)!r}: a ModifiedResNet tower takes a list of "
                               f"{RESNET_STAGES} positive block counts, one per stage (RN50: [3, 4, 6, 3])")
        if self.width <= 0 or self.width % 2:
            raise InvalidInput(f"vision_cfg.width={self.width}: a ModifiedResNet stem needs a positive even width "
                               "(its first two convs are width/2 wide)")
        if self.image_size <= 0 or self.image_size % RESNET_REDUCTION:
            raise InvalidInput(f"vision_cfg.image_size={self.image_size}: a ModifiedResNet tower halves the image 5 "
                               f"times (stem conv and pool, 3 strided stages), so image_size must be a positive "
                               f"multiple of {RESNET_REDUCTION} for its attention pool's grid (RN50: 224, RN50x4: 288)")
        if self.head_width <= 0 or self.pool_width % self.head_width:
            raise InvalidInput(f"vision_cfg.head_width={self.head_width} does not divide the attention pool's width "
                               f"{self.pool_width} (32 x width)")

    @property
    def pool_width(self) -> int:
        """The width of the last stage's output, which the attention pool attends over."""
        return self.width * RESNET_REDUCTION

    @property
    def heads(self) -> int:
        return self.pool_width // self.head_width

    @property
    def grid_size(self) -> int:
        return self.image_size // RESNET_REDUCTION

    @property
    def num_tokens(self) -> int:  # the grid's cells plus their mean, the pooled query
        return self.grid_size**2 + 1

    @property
    def patch_dropout(self) -> float:  # no patches: OpenCLIP's ModifiedResNet takes no patch dropout
        return 0.0


def is_resnet(config: "CLIPConfig | VisionConfig | ResNetVisionConfig") -> bool:
    """Whether a model (or its image tower) is OpenCLIP's ModifiedResNet rather than a ViT."""
    vision = config.vision if isinstance(config, CLIPConfig) else config
    return isinstance(vision, ResNetVisionConfig)


@dataclasses.dataclass(frozen=True)
class TextConfig:
    context_length: int
    vocab_size: int
    width: int
    heads: int
    layers: int
    mlp_width: int
    block: BlockConfig = BlockConfig()
    # CoCa's learned class embedding (`cls_emb`), appended after the tokens; the tower then pools it (OpenCLIP
    # ignores pool_type), applies ln_final after pooling, and masks padding keys (id `pad_id`) in attention.
    embed_cls: bool = False
    pad_id: int = 0
    no_causal_mask: bool = False  # bidirectional attention
    # "argmax": the largest token id (OpenAI's EOT); "first", "last": a fixed position; "eos": the first `eos_id`.
    pool_type: str = "argmax"
    eos_id: int = 2
    final_ln_after_pool: bool = False  # ln_final on the pooled token only (the same values: LayerNorm is per token)
    proj_type: str = "linear"  # "none": no text projection, the features are the pooled width-wide vector
    proj_bias: bool = False  # the projection as a Linear with a bias (`text_projection.weight`, `.bias`)
    # The tokenizer, as OpenCLIP's `hf_tokenizer_name` and `tokenizer_kwargs.clean` name it: None is CLIP's BPE
    # (`clip_jax.text.clip_tokenizer`); else a folder holding a SentencePiece tokenizer's files (SigLIP's, SigLIP 2's
    # Gemma), or the Hub name OpenCLIP's named models give, which clip_jax does not download
    # (`clip_jax.text.model_tokenizer`).
    # `tokenizer_clean`: the text cleaning before it ("canonicalize", "lower", "whitespace", "none"; None: the
    # folder's own tokenizer config's). Neither changes a parameter.
    tokenizer: str | None = None
    tokenizer_clean: str | None = None

    def __post_init__(self):
        if self.pool_type not in TEXT_POOL_TYPES:
            raise InvalidInput(f"text pool_type={self.pool_type!r}: choose one of {TEXT_POOL_TYPES}")
        if self.proj_type not in TEXT_PROJ_TYPES:
            raise InvalidInput(f"text proj_type={self.proj_type!r}: choose one of {TEXT_PROJ_TYPES}")
        if self.proj_bias and self.proj_type == "none":
            raise InvalidInput("text proj_bias=True with proj_type='none': there is no projection to give a bias")

    @property
    def num_tokens(self) -> int:  # the tokens, plus the class embedding when embed_cls
        return self.context_length + int(self.embed_cls)


@dataclasses.dataclass(frozen=True)
class CLIPConfig:
    embed_dim: int
    vision: "VisionConfig | ResNetVisionConfig"
    text: TextConfig
    quick_gelu: bool = False  # OpenAI's original checkpoints use x * sigmoid(1.702 x); OpenCLIP's own use exact GELU
    name: str = UNNAMED
    # The head, as OpenCLIP's `init_logit_scale` / `init_logit_bias`: the raw scale's initial value, and the
    # initial value of a learned `logit_bias` the model has only when this is set (SigLIP: ln 10 and -10).
    init_logit_scale: float = math.log(1 / 0.07)
    init_logit_bias: float | None = None
    # OpenCLIP's CustomTextCLIP: the same text tower, its state_dict keys under `text.`. embed_cls needs it (the
    # plain CLIP class runs its own text forward, which has no class embedding).
    custom_text: bool = False

    def __post_init__(self):
        for tower in (self.text,) if is_resnet(self.vision) else (self.vision, self.text):
            if tower.width % tower.heads:
                raise InvalidInput(f"{self.name}: width {tower.width} is not divisible by {tower.heads} heads")
        if not is_resnet(self.vision) and self.vision.image_size % self.vision.patch_size:
            raise InvalidInput(
                f"{self.name}: image_size {self.vision.image_size} is not a multiple of "
                f"patch_size {self.vision.patch_size}"
            )
        if self.text.embed_cls and not self.custom_text:
            raise InvalidInput(f"{self.name}: text_cfg.embed_cls needs custom_text: true (OpenCLIP's plain CLIP "
                               "class runs a text forward without the class embedding)")
        if self.text.proj_type == "none" and self.text.width != self.embed_dim:
            raise InvalidInput(f"{self.name}: text_cfg.proj_type='none' gives {self.text.width}-wide text features, "
                               f"but the image features are embed_dim={self.embed_dim} wide")
        towers = (self.text,) if is_resnet(self.vision) else (self.vision, self.text)
        if not is_resnet(self.vision) and self.vision.attention_pool and self.vision.width != self.embed_dim:
            raise InvalidInput(f"{self.name}: an attention-pooled (SigLIP) image tower has no projection, so its "
                               f"width {self.vision.width} must be embed_dim={self.embed_dim}")
        if self.quick_gelu and any(t.block.gelu_approximate != "none" for t in towers):
            raise InvalidInput(f"{self.name}: act_kwargs with quick_gelu: OpenCLIP's QuickGELU takes no arguments")


# OpenCLIP's --siglip head: what a model trained with the sigmoid loss starts from when it has no logit_bias of its own.
SIGLIP_INIT_LOGIT_SCALE, SIGLIP_INIT_LOGIT_BIAS = math.log(10), -10.0


def with_siglip_head(config: CLIPConfig) -> CLIPConfig:
    """`config` for the sigmoid loss: OpenCLIP's --siglip head (scale ln 10, bias -10) unless it has a logit_bias."""
    if config.init_logit_bias is not None:
        return config
    return dataclasses.replace(config, init_logit_scale=SIGLIP_INIT_LOGIT_SCALE, init_logit_bias=SIGLIP_INIT_LOGIT_BIAS)


def with_patch_dropout(config: CLIPConfig, rate: float) -> CLIPConfig:
    """`config` whose image tower drops `rate` of its patches in training (checked by `VisionConfig`)."""
    return dataclasses.replace(config, vision=dataclasses.replace(config.vision, patch_dropout=float(rate)))


def as_trained(config: CLIPConfig, *, image_size: int | None = None, siglip_head: bool = False,
               patch_dropout: float | None = None) -> CLIPConfig:
    """`config` as a train step trains it: at `image_size` (OpenCLIP's --force-image-size; None or 0: its own), with
    OpenCLIP's --siglip head for the sigmoid loss (`with_siglip_head`), its image tower dropping `patch_dropout` of
    its patches (--force-patch-dropout; None: the config's own rate; a ResNet tower has no patches and takes none)."""
    if image_size:
        config = dataclasses.replace(config, vision=dataclasses.replace(config.vision, image_size=int(image_size)))
    if siglip_head:
        config = with_siglip_head(config)
    if patch_dropout is not None and not is_resnet(config):
        config = with_patch_dropout(config, patch_dropout)
    return config
