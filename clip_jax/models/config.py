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

    def __post_init__(self):
        if not 0.0 <= self.patch_dropout < 1.0:
            raise InvalidInput(f"patch_dropout={self.patch_dropout} must be in [0, 1)")

    @property
    def grid_size(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_tokens(self) -> int:  # patches plus the class token
        return self.grid_size**2 + 1


@dataclasses.dataclass(frozen=True)
class TextConfig:
    context_length: int
    vocab_size: int
    width: int
    heads: int
    layers: int
    mlp_width: int


@dataclasses.dataclass(frozen=True)
class CLIPConfig:
    embed_dim: int
    vision: VisionConfig
    text: TextConfig
    quick_gelu: bool = False  # OpenAI's original checkpoints use x * sigmoid(1.702 x); OpenCLIP's own use exact GELU
    name: str = "custom"
    # The head, as OpenCLIP's `init_logit_scale` / `init_logit_bias`: the raw scale's initial value, and the
    # initial value of a learned `logit_bias` the model has only when this is set (SigLIP: ln 10 and -10).
    init_logit_scale: float = math.log(1 / 0.07)
    init_logit_bias: float | None = None

    def __post_init__(self):
        for tower in (self.vision, self.text):
            if tower.width % tower.heads:
                raise InvalidInput(f"{self.name}: width {tower.width} is not divisible by {tower.heads} heads")
        if self.vision.image_size % self.vision.patch_size:
            raise InvalidInput(
                f"{self.name}: image_size {self.vision.image_size} is not a multiple of "
                f"patch_size {self.vision.patch_size}"
            )


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
}

# Keys of OpenCLIP's JSON that we read, and keys that only concern training or preprocessing (accepted, ignored).
_VISION_KEYS = {"image_size", "layers", "width", "patch_size", "head_width", "mlp_ratio", "patch_dropout"}
_TEXT_KEYS = {"context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio"}
_IGNORED_KEYS = {
    "timm_model_name", "timm_model_pretrained", "timm_pool", "timm_proj", "timm_proj_bias",
    "timm_drop", "timm_drop_path", "hf_model_pretrained", "hf_tokenizer_name", "tokenizer_kwargs", "proj",
    "pooler_type",
    "custom_text", "cast_dtype", "image_mean", "image_std",
    "image_interpolation", "image_resize_mode", "preprocess_cfg", "output_tokens", "ls_init_value", "embed_cls",
    "pad_id", "no_causal_mask", "final_ln_after_pool", "pool_type", "attentional_pool", "proj_type", "proj_bias",
    "act_kwargs", "norm_kwargs", "no_ln_pre", "hf_model_name", "hf_proj_type", "hf_pooler_type", "n_queries",
    "attn_pooler_heads", "attn_pooler_queries", "output_dim",
}
# Ignored keys that change the architecture unless they hold OpenCLIP's default for the CLIP models we build.
_DEFAULTS_WE_BUILD = {
    "ls_init_value": None, "no_causal_mask": False, "final_ln_after_pool": False, "attentional_pool": False,
    "no_ln_pre": False, "proj_bias": False, "embed_cls": False, "timm_model_name": None, "hf_model_name": None,
    "output_tokens": False, "pad_id": 0,
}
_POOL_TYPES = {"vision": {"tok"}, "text": {"argmax"}}


def list_models() -> list[str]:
    return sorted(_OPEN_CLIP_CONFIGS)


def _check_tower(cfg: Mapping[str, Any], known: set[str], tower: str, where: str) -> None:
    unknown = set(cfg) - known - _IGNORED_KEYS
    if unknown:
        raise InvalidInput(f"{where}: unknown key(s) {sorted(unknown)} in {tower}; known keys are {sorted(known)}")
    for key, default in _DEFAULTS_WE_BUILD.items():
        value = cfg.get(key, default)
        if value != default and not (value is None and default is False):
            raise InvalidInput(
                f"{where}: {tower}.{key}={cfg[key]!r} describes an architecture clip_jax does not build "
                f"(supported: {default!r})"
            )
    if "pool_type" in cfg and cfg["pool_type"] not in _POOL_TYPES[tower.split("_")[0]]:
        raise InvalidInput(f"{where}: {tower}.pool_type={cfg['pool_type']!r} is not supported")


def config_from_open_clip(cfg: Mapping[str, Any], name: str = "custom") -> CLIPConfig:
    """Builds a `CLIPConfig` from a dict in OpenCLIP's model-config JSON format."""
    missing = {"embed_dim", "vision_cfg", "text_cfg"} - set(cfg)
    if missing:
        raise InvalidInput(f"model config {name!r} lacks {sorted(missing)} (OpenCLIP's format has embed_dim, "
                         "vision_cfg and text_cfg)")
    unknown = set(cfg) - {"embed_dim", "vision_cfg", "text_cfg", "quick_gelu", "custom_text", "init_logit_scale",
                          "init_logit_bias", "cast_dtype", "multimodal_cfg"}
    if unknown:
        raise InvalidInput(f"model config {name!r}: unknown top-level key(s) {sorted(unknown)}")
    if "multimodal_cfg" in cfg:
        raise InvalidInput(f"model config {name!r} is a CoCa model (multimodal_cfg); clip_jax builds two-tower CLIP")
    v, t = dict(cfg["vision_cfg"]), dict(cfg["text_cfg"])
    _check_tower(v, _VISION_KEYS, "vision_cfg", name)
    _check_tower(t, _TEXT_KEYS, "text_cfg", name)
    try:
        v_width, t_width = int(v["width"]), int(t["width"])
        vision = VisionConfig(
            image_size=int(v["image_size"]),
            patch_size=int(v["patch_size"]),
            width=v_width,
            layers=int(v["layers"]),
            heads=v_width // int(v.get("head_width", 64)),
            mlp_width=int(v_width * float(v.get("mlp_ratio", 4.0))),
            patch_dropout=float(v.get("patch_dropout", 0.0)),
        )
        text = TextConfig(
            context_length=int(t.get("context_length", 77)),
            vocab_size=int(t.get("vocab_size", 49408)),
            width=t_width,
            heads=int(t.get("heads", 8)),
            layers=int(t.get("layers", 12)),
            mlp_width=int(t_width * float(t.get("mlp_ratio", 4.0))),
        )
    except KeyError as e:
        raise InvalidInput(f"model config {name!r} lacks required key {e.args[0]!r}") from None
    if isinstance(v.get("image_size"), (list, tuple)):
        raise InvalidInput(f"model config {name!r}: non-square image_size is not supported")
    head = {k: float(cfg[k]) for k in ("init_logit_scale", "init_logit_bias") if cfg.get(k) is not None}
    return CLIPConfig(embed_dim=int(cfg["embed_dim"]), vision=vision, text=text,
                      quick_gelu=bool(cfg.get("quick_gelu", False)), name=name, **head)


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


def _mlp_ratio(width: int, mlp_width: int) -> float:
    """A ratio OpenCLIP turns back into exactly `mlp_width` (it computes `int(width * mlp_ratio)`; the plain quotient
    can land one ulp below and truncate to mlp_width - 1)."""
    ratio = mlp_width / width
    while int(width * ratio) < mlp_width:
        ratio = math.nextafter(ratio, math.inf)
    return ratio


def open_clip_model_cfg(config: CLIPConfig) -> dict:
    """`config` in OpenCLIP's model-config JSON format (the inverse of `config_from_open_clip`): what an exported
    model's `open_clip_config.json` holds as `model_cfg`, so that OpenCLIP builds the same architecture."""
    v, t = config.vision, config.text
    cfg = {
        "embed_dim": config.embed_dim,
        "quick_gelu": config.quick_gelu,
        "vision_cfg": {"image_size": v.image_size, "layers": v.layers, "width": v.width, "patch_size": v.patch_size,
                       "head_width": v.width // v.heads, "mlp_ratio": _mlp_ratio(v.width, v.mlp_width),
                       "patch_dropout": v.patch_dropout},
        "text_cfg": {"context_length": t.context_length, "vocab_size": t.vocab_size, "width": t.width,
                     "heads": t.heads, "layers": t.layers, "mlp_ratio": _mlp_ratio(t.width, t.mlp_width)},
        "init_logit_scale": config.init_logit_scale,
    }
    if config.init_logit_bias is not None:
        cfg["init_logit_bias"] = config.init_logit_bias
    return cfg
