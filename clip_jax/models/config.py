"""Model configurations: the named registry and OpenCLIP's model-config JSON format.

A `CLIPConfig` holds the architecture, the numbers that decide the parameter tree, and, as OpenCLIP's JSON does,
the image tower's training-time `patch_dropout` (it changes no parameter and no eval output). How the model runs
(compute dtype, rematerialisation, attention kernel) is chosen when it is created, so one checkpoint can be run
under any of them.
"""

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from clip_jax.errors import InvalidInput, MissingInput

GELU_APPROXIMATIONS = ("none", "tanh")  # torch's nn.GELU(approximate=...), what OpenCLIP's act_kwargs can set
BLOCK_TYPES = (None, "default", "custom")
VISION_POOL_TYPES = ("tok", "avg")
TEXT_POOL_TYPES = ("argmax", "first", "last", "eos")
TEXT_PROJ_TYPES = ("linear", "none")


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
    pool_type: str = "tok"
    final_ln_after_pool: bool = False

    def __post_init__(self):
        if not 0.0 <= self.patch_dropout < 1.0:
            raise InvalidInput(f"patch_dropout={self.patch_dropout} must be in [0, 1)")
        if self.pool_type not in VISION_POOL_TYPES:
            raise InvalidInput(f"vision pool_type={self.pool_type!r}: choose one of {VISION_POOL_TYPES}")

    @property
    def grid_size(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_tokens(self) -> int:  # patches plus the class token
        return self.grid_size**2 + 1


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
    name: str = "custom"
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


# OpenCLIP's model-config JSON, as in open_clip/model_configs/*.json (architecture fields only).
_OPEN_CLIP_CONFIGS = {
    "ViT-B-32": {
        "embed_dim": 512,
        "vision_cfg": {"image_size": 224, "layers": 12, "width": 768, "patch_size": 32},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12},
    },
    "ViT-B-16": {
        "embed_dim": 512,
        "vision_cfg": {"image_size": 224, "layers": 12, "width": 768, "patch_size": 16},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12},
    },
    "ViT-L-14": {
        "embed_dim": 768,
        "vision_cfg": {"image_size": 224, "layers": 24, "width": 1024, "patch_size": 14},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 768, "heads": 12, "layers": 12},
    },
    "ViT-L-14-336": {
        "embed_dim": 768,
        "vision_cfg": {"image_size": 336, "layers": 24, "width": 1024, "patch_size": 14},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 768, "heads": 12, "layers": 12},
    },
    "ViT-H-14": {
        "embed_dim": 1024,
        "vision_cfg": {"image_size": 224, "layers": 32, "width": 1280, "head_width": 80, "patch_size": 14},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16, "layers": 24},
    },
    "ViT-g-14": {
        "embed_dim": 1024,
        "vision_cfg": {
            "image_size": 224,
            "layers": 40,
            "width": 1408,
            "head_width": 88,
            "mlp_ratio": 4.3637,
            "patch_size": 14,
        },
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16, "layers": 24},
    },
    # ModifiedResNet image towers (a list of 4 `layers`)
    "RN50": {
        "embed_dim": 1024,
        "vision_cfg": {"image_size": 224, "layers": [3, 4, 6, 3], "width": 64, "patch_size": None},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12},
    },
    "RN101": {
        "embed_dim": 512,
        "vision_cfg": {"image_size": 224, "layers": [3, 4, 23, 3], "width": 64, "patch_size": None},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12},
    },
    "RN50x4": {
        "embed_dim": 640,
        "vision_cfg": {"image_size": 288, "layers": [4, 6, 10, 6], "width": 80, "patch_size": None},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 640, "heads": 10, "layers": 12},
    },
    "RN50x16": {
        "embed_dim": 768,
        "vision_cfg": {"image_size": 384, "layers": [6, 8, 18, 8], "width": 96, "patch_size": None},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 768, "heads": 12, "layers": 12},
    },
    "RN50x64": {
        "embed_dim": 1024,
        "vision_cfg": {"image_size": 448, "layers": [3, 15, 36, 10], "width": 128, "patch_size": None},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16, "layers": 12},
    },
}

# OpenCLIP's keys, by tower, with the type each must have (checked before anything is built). "int" and "float"
# refuse bools and strings; "str?" / "float?" / "dict?" also take None (null).
_BLOCK_KEYS = {
    "block_type": "str?", "qk_norm": "bool", "scaled_cosine_attn": "bool", "scale_heads": "bool",
    "scale_attn_inner": "bool", "scale_attn": "bool", "scale_fc": "bool", "ls_init_value": "float?",
    "norm_kwargs": "dict?", "act_kwargs": "dict?",
}
_VISION_KEYS = {
    "image_size": "int", "layers": "int", "width": "int", "patch_size": "int", "head_width": "int",
    "mlp_ratio": "float", "patch_dropout": "float", "no_ln_pre": "bool", "pool_type": "str",
    "final_ln_after_pool": "bool", **_BLOCK_KEYS,
}
_TEXT_KEYS = {
    "context_length": "int", "vocab_size": "int", "width": "int", "heads": "int", "layers": "int",
    "mlp_ratio": "float", "embed_cls": "bool", "pad_id": "int", "eos_id": "int", "no_causal_mask": "bool",
    "pool_type": "str", "final_ln_after_pool": "bool", "proj_type": "str", "proj_bias": "bool", **_BLOCK_KEYS,
}
# Keys that concern preprocessing or tokenisation only (accepted, no effect on the model), and keys that matter
# only with a tower we refuse anyway (timm_*, hf_*, attn_pooler_*), or legacy keys OpenCLIP itself never reads.
_IGNORED_KEYS = {
    "timm_model_pretrained", "timm_pool", "timm_proj", "timm_proj_bias", "timm_drop", "timm_drop_path",
    "hf_model_pretrained", "hf_tokenizer_name", "tokenizer_kwargs", "tokenizer_mode", "proj", "pooler_type",
    "image_mean", "image_std", "image_interpolation", "image_resize_mode", "preprocess_cfg", "hf_proj_type",
    "hf_pooler_type", "n_queries", "attn_pooler_heads", "attn_pooler_queries", "output_dim",
}
# Keys of architectures clip_jax does not build: accepted only with OpenCLIP's default value.
_NOT_BUILT = {
    "timm_model_name": (None, "timm image towers are not built"),
    "hf_model_name": (None, "Hugging Face text towers are not built"),
    "attentional_pool": (False, "the attentional pooler (CoCa) is not built"),
    "output_tokens": (False, "the towers return pooled features only"),
    "pos_embed_type": ("learnable", "only the learned positional embedding is built"),
}
_NORM_KWARGS = {"eps": "float", "elementwise_affine": "bool", "bias": "bool"}
_ACT_KWARGS = {"approximate": "str"}
_TOP_KEYS = {"embed_dim": "int", "quick_gelu": "bool", "custom_text": "bool", "init_logit_scale": "float",
             "init_logit_bias": "float?", "cast_dtype": "str?"}
_TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
               "str?": "a string or null", "float?": "a number or null", "dict?": "a dict or null",
               "list": "a list"}


def _type_ok(value, kind: str) -> bool:
    if kind.endswith("?") and value is None:
        return True
    kind = kind.rstrip("?")
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"str": str, "dict": Mapping, "list": (list, tuple)}[kind])


def _check_types(cfg: Mapping[str, Any], schema: Mapping[str, str], where: str) -> None:
    for key, value in cfg.items():
        if key in schema and not _type_ok(value, schema[key]):
            raise InvalidInput(f"{where}.{key}={value!r} ({type(value).__name__}) must be {_TYPE_NAMES[schema[key]]}")


def list_models() -> list[str]:
    return sorted(_OPEN_CLIP_CONFIGS)


# A ModifiedResNet tower's keys: OpenCLIP reads only these four (and writes patch_size null in its JSON).
_RESNET_KEYS = {"image_size": "int", "layers": "list", "width": "int", "head_width": "int"}


def _resnet_from_open_clip(cfg: Mapping[str, Any], name: str) -> ResNetVisionConfig:
    """A ModifiedResNet tower from a `vision_cfg` whose `layers` is a list; every other key is refused by name
    (OpenCLIP would ignore a ViT key such as mlp_ratio here, so a config that sets one is a mistake)."""
    where = f"model config {name!r}: vision_cfg"
    unknown = set(cfg) - set(_RESNET_KEYS) - {"patch_size"} - _IGNORED_KEYS
    if unknown:
        raise InvalidInput(f"{where}: unknown key(s) {sorted(unknown)} for a ModifiedResNet tower (a list of "
                           f"layers); known keys are {sorted(_RESNET_KEYS)}")
    if cfg.get("patch_size") is not None:
        raise InvalidInput(f"{where}.patch_size={cfg['patch_size']!r}: a ModifiedResNet tower has no patches "
                           "(patch_size must be null or absent)")
    _check_types(cfg, _RESNET_KEYS, where)
    if "image_size" not in cfg:
        raise InvalidInput(f"{where} lacks required key 'image_size'")
    try:
        return ResNetVisionConfig(image_size=cfg["image_size"], layers=tuple(cfg["layers"]),
                                  width=cfg.get("width", 64), head_width=cfg.get("head_width", 64))
    except InvalidInput as e:
        raise InvalidInput(f"model config {name!r}: {e}") from None


def _check_tower(cfg: Mapping[str, Any], known: Mapping[str, str], where: str) -> None:
    """Unknown keys, keys of towers not built, and wrong types, each named, before any value is used."""
    if isinstance(cfg.get("layers"), (list, tuple)):
        raise InvalidInput(f"{where}.layers={cfg['layers']!r}: a list of layers (a ModifiedResNet) is an image "
                           "tower only")
    if isinstance(cfg.get("image_size"), (list, tuple)):
        raise InvalidInput(f"{where}.image_size={cfg['image_size']!r}: non-square image_size is not supported")
    unknown = set(cfg) - set(known) - _IGNORED_KEYS - set(_NOT_BUILT)
    if unknown:
        raise InvalidInput(f"{where}: unknown key(s) {sorted(unknown)}; known keys are {sorted(known)}")
    for key, (default, why) in _NOT_BUILT.items():
        if key in cfg and cfg[key] != default and not (cfg[key] is None and default is False):
            raise InvalidInput(f"{where}.{key}={cfg[key]!r}: {why} (supported: {default!r})")
    _check_types(cfg, known, where)
    for key, schema in (("norm_kwargs", _NORM_KWARGS), ("act_kwargs", _ACT_KWARGS)):
        kwargs = cfg.get(key) or {}
        unknown = set(kwargs) - set(schema)
        if unknown:
            raise InvalidInput(f"{where}.{key}: unknown key(s) {sorted(unknown)}; clip_jax builds {sorted(schema)}")
        _check_types(kwargs, schema, f"{where}.{key}")


# The image preprocessing a vision_cfg may ask for, and what clip_jax's transforms do (clip_jax.data.transforms):
# OpenCLIP's defaults. Anything else is refused, not silently preprocessed another way.
_PREPROCESSING = {"image_interpolation": (None, "bicubic"), "image_resize_mode": (None, "shortest")}


def _check_preprocessing(cfg: Mapping[str, Any], where: str) -> None:
    for key, supported in _PREPROCESSING.items():
        if cfg.get(key) not in supported:
            raise InvalidInput(f"{where}.{key}={cfg[key]!r}: clip_jax's transforms resize {supported[1]!r} only "
                               f"(omit the key or set {supported[1]!r})")


def _block_from_open_clip(cfg: Mapping[str, Any]) -> BlockConfig:
    norm, act = cfg.get("norm_kwargs") or {}, cfg.get("act_kwargs") or {}
    flags = ("qk_norm", "scaled_cosine_attn", "scale_heads", "scale_attn_inner", "scale_attn", "scale_fc")
    ls = cfg.get("ls_init_value")
    return BlockConfig(
        block_type=cfg.get("block_type"), **{k: cfg.get(k, False) for k in flags},
        ls_init_value=None if ls is None else float(ls), norm_eps=float(norm.get("eps", 1e-5)),
        norm_scale=norm.get("elementwise_affine", True), norm_bias=norm.get("bias", True),
        gelu_approximate=act.get("approximate", "none"),
    )


def _mlp_width(width: int, ratio) -> int:
    return int(width * float(ratio))


def _vit_from_open_clip(v: Mapping[str, Any]) -> VisionConfig:
    v_width = v["width"]
    return VisionConfig(
        image_size=v["image_size"],
        patch_size=v["patch_size"],
        width=v_width,
        layers=v["layers"],
        heads=v_width // v.get("head_width", 64),
        mlp_width=_mlp_width(v_width, v.get("mlp_ratio", 4.0)),
        patch_dropout=float(v.get("patch_dropout", 0.0)),
        block=_block_from_open_clip(v),
        no_ln_pre=v.get("no_ln_pre", False),
        pool_type=v.get("pool_type", "tok"),
        final_ln_after_pool=v.get("final_ln_after_pool", False),
    )


def config_from_open_clip(cfg: Mapping[str, Any], name: str = "custom") -> CLIPConfig:
    """Builds a `CLIPConfig` from a dict in OpenCLIP's model-config JSON format.

    Every key is checked first: an unknown key, a value of the wrong type, a tower clip_jax does not build or an
    option pair OpenCLIP rejects raises `InvalidInput` naming it, before any model is created."""
    missing = {"embed_dim", "vision_cfg", "text_cfg"} - set(cfg)
    if missing:
        raise InvalidInput(f"model config {name!r} lacks {sorted(missing)} (OpenCLIP's format has embed_dim, "
                         "vision_cfg and text_cfg)")
    unknown = set(cfg) - set(_TOP_KEYS) - {"vision_cfg", "text_cfg", "multimodal_cfg"}
    if unknown:
        raise InvalidInput(f"model config {name!r}: unknown top-level key(s) {sorted(unknown)}")
    if "multimodal_cfg" in cfg:
        raise InvalidInput(f"model config {name!r} is a CoCa model (multimodal_cfg); clip_jax builds two-tower CLIP")
    _check_types(cfg, _TOP_KEYS, f"model config {name!r}")
    for key in ("vision_cfg", "text_cfg"):
        if not isinstance(cfg[key], Mapping):
            raise InvalidInput(f"model config {name!r}: {key} must be a dict, got {type(cfg[key]).__name__}")
    v, t = dict(cfg["vision_cfg"]), dict(cfg["text_cfg"])
    resnet = _resnet_from_open_clip(v, name) if isinstance(v.get("layers"), (list, tuple)) else None
    if resnet is None:
        _check_tower(v, _VISION_KEYS, f"{name}: vision_cfg")
    _check_preprocessing(v, f"{name}: vision_cfg")
    _check_tower(t, _TEXT_KEYS, f"{name}: text_cfg")
    try:
        t_width = t["width"]
        vision = resnet or _vit_from_open_clip(v)
        text = TextConfig(
            context_length=t.get("context_length", 77),
            vocab_size=t.get("vocab_size", 49408),
            width=t_width,
            heads=t.get("heads", 8),
            layers=t.get("layers", 12),
            mlp_width=_mlp_width(t_width, t.get("mlp_ratio", 4.0)),
            block=_block_from_open_clip(t),
            embed_cls=t.get("embed_cls", False),
            pad_id=t.get("pad_id", 0),
            no_causal_mask=t.get("no_causal_mask", False),
            pool_type=t.get("pool_type", "argmax"),
            eos_id=t.get("eos_id", 2),
            final_ln_after_pool=t.get("final_ln_after_pool", False),
            proj_type=t.get("proj_type", "linear"),
            proj_bias=t.get("proj_bias", False),
        )
    except KeyError as e:
        raise InvalidInput(f"model config {name!r} lacks required key {e.args[0]!r}") from None
    except InvalidInput as e:
        raise InvalidInput(f"model config {name!r}: {e}") from None
    head = {k: float(cfg[k]) for k in ("init_logit_scale", "init_logit_bias") if cfg.get(k) is not None}
    return CLIPConfig(embed_dim=cfg["embed_dim"], vision=vision, text=text, quick_gelu=cfg.get("quick_gelu", False),
                      name=name, custom_text=cfg.get("custom_text", False), **head)


def _ratio(width: int, mlp_width: int) -> float:
    """An `mlp_ratio` that OpenCLIP's int(width * ratio) turns back into `mlp_width`."""
    ratio = mlp_width / width
    return ratio if _mlp_width(width, ratio) == mlp_width else (mlp_width + 0.5) / width


def _block_to_open_clip(block: BlockConfig) -> dict[str, Any]:
    out: dict[str, Any] = {k: True for k in block.custom_options()}
    if block.block_type is not None:
        out["block_type"] = block.block_type
    if block.ls_init_value is not None:
        out["ls_init_value"] = block.ls_init_value
    norm = {k: v for k, v, default in (("eps", block.norm_eps, 1e-5), ("elementwise_affine", block.norm_scale, True),
                                       ("bias", block.norm_bias, True)) if v != default}
    if not block.norm_scale:
        norm.pop("bias", None)
    if norm:
        out["norm_kwargs"] = norm
    if block.gelu_approximate != "none":
        out["act_kwargs"] = {"approximate": block.gelu_approximate}
    return out


def _resnet_to_open_clip(v: ResNetVisionConfig) -> dict[str, Any]:
    vision = {"image_size": v.image_size, "layers": list(v.layers), "width": v.width, "patch_size": None}
    if v.head_width != 64:
        vision["head_width"] = v.head_width
    return vision


def _vit_to_open_clip(v: VisionConfig) -> dict[str, Any]:
    vision = {"image_size": v.image_size, "layers": v.layers, "width": v.width, "patch_size": v.patch_size}
    if v.width // v.heads != 64:
        vision["head_width"] = v.width // v.heads
    if v.mlp_width != _mlp_width(v.width, 4.0):
        vision["mlp_ratio"] = _ratio(v.width, v.mlp_width)
    optional = (("patch_dropout", v.patch_dropout, 0.0), ("no_ln_pre", v.no_ln_pre, False),
                ("pool_type", v.pool_type, "tok"), ("final_ln_after_pool", v.final_ln_after_pool, False))
    vision.update({k: value for k, value, default in optional if value != default})
    vision.update(_block_to_open_clip(v.block))
    return vision


def open_clip_model_cfg(config: CLIPConfig) -> dict:
    """OpenCLIP's model-config dict (the JSON `open_clip.create_model` reads) for `config`: the inverse of
    `config_from_open_clip`. Keys at their OpenCLIP default are left out, so the dict stays as short as the
    configs OpenCLIP ships."""
    v, t = config.vision, config.text
    vision = _resnet_to_open_clip(v) if is_resnet(v) else _vit_to_open_clip(v)


    text = {"context_length": t.context_length, "vocab_size": t.vocab_size, "width": t.width, "heads": t.heads,
            "layers": t.layers}
    if t.mlp_width != _mlp_width(t.width, 4.0):
        text["mlp_ratio"] = _ratio(t.width, t.mlp_width)
    optional = (("embed_cls", t.embed_cls, False), ("pad_id", t.pad_id, 0), ("no_causal_mask", t.no_causal_mask, False),
                ("pool_type", t.pool_type, "argmax"), ("eos_id", t.eos_id, 2),
                ("final_ln_after_pool", t.final_ln_after_pool, False), ("proj_type", t.proj_type, "linear"),
                ("proj_bias", t.proj_bias, False))
    text.update({k: value for k, value, default in optional if value != default})
    text.update(_block_to_open_clip(t.block))

    out: dict[str, Any] = {"embed_dim": config.embed_dim, "vision_cfg": vision, "text_cfg": text}
    if config.quick_gelu:
        out["quick_gelu"] = True
    if config.custom_text:
        out["custom_text"] = True
    if config.init_logit_scale != math.log(1 / 0.07):
        out["init_logit_scale"] = config.init_logit_scale
    if config.init_logit_bias is not None:
        out["init_logit_bias"] = config.init_logit_bias
    return out


def get_model_config(name_or_config: "str | os.PathLike | Mapping[str, Any] | CLIPConfig") -> CLIPConfig:
    """A registered name (`ViT-L-14`, also `ViT-L-14-quickgelu`), an OpenCLIP JSON file or dict, or a `CLIPConfig`."""
    if isinstance(name_or_config, CLIPConfig):
        return name_or_config
    if isinstance(name_or_config, Mapping):
        return config_from_open_clip(name_or_config)
    name = os.fspath(name_or_config)
    if name.endswith(".json"):
        if not os.path.exists(name):
            raise MissingInput(f"model config file {name} does not exist")
        with open(name) as f:
            return config_from_open_clip(json.load(f), name=os.path.basename(name)[: -len(".json")])
    base, quick = (name[: -len("-quickgelu")], True) if name.endswith("-quickgelu") else (name, False)
    if base not in _OPEN_CLIP_CONFIGS:
        raise InvalidInput(f"unknown model {name!r}; known models: {', '.join(list_models())} (each also with "
                         "-quickgelu), or pass an OpenCLIP model-config .json file or dict")
    return config_from_open_clip({**_OPEN_CLIP_CONFIGS[base], "quick_gelu": quick}, name=name)
