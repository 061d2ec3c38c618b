"""The named models (OpenCLIP's own model configs) and `get_model_config`, which resolves a name, an OpenCLIP
model-config `.json` file or dict, or a `CLIPConfig` to a `CLIPConfig`."""

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.models.config import CLIPConfig
from clip_jax.models.open_clip_json import TIMM_SIGLIP, config_from_open_clip

def _siglip(timm_name, tokenizer, width, context_length, vocab_size, heads, layers, mlp_ratio, approximate) -> dict:
    """OpenCLIP's SigLIP model config: timm's image tower `timm_name`, a text tower as wide as it, the tokenizer
    OpenCLIP reads from the Hub (`tokenizer`), which clip_jax does not download."""
    text = {"context_length": context_length, "vocab_size": vocab_size, "hf_tokenizer_name": tokenizer,
            "tokenizer_kwargs": {"clean": "canonicalize"}, "width": width, "heads": heads,
            "layers": layers, "no_causal_mask": True, "proj_bias": True, "pool_type": "last",
            "norm_kwargs": {"eps": 1e-6}}
    if mlp_ratio != 4.0:
        text["mlp_ratio"] = mlp_ratio
    if approximate != "none":
        text["act_kwargs"] = {"approximate": approximate}
    return {"embed_dim": width, "init_logit_bias": -10, "custom_text": True,
            "vision_cfg": {"image_size": TIMM_SIGLIP[timm_name]["image_size"], "timm_model_name": timm_name,
                           "timm_model_pretrained": False, "timm_pool": "map", "timm_proj": "none"},
            "text_cfg": text}


# OpenCLIP's model-config JSON, as in open_clip/model_configs/*.json (architecture fields, and the SigLIP models'
# tokenizers).
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
    # SigLIP and SigLIP 2 (fixed resolution): timm's attention-pooled ViT image towers and a bidirectional text
    # tower pooled at its last token, with a bias beside the scale; SentencePiece vocabularies (SigLIP's 32k, SigLIP
    # 2's Gemma 256k), whose files come with the weights.
    **{name: _siglip(*sizes) for name, sizes in {
        "ViT-B-16-SigLIP": ("vit_base_patch16_siglip_224", "timm/ViT-B-16-SigLIP", 768, 64, 32000, 12, 12, 4.0,
                            "none"),
        "ViT-B-16-SigLIP-256": ("vit_base_patch16_siglip_256", "timm/ViT-B-16-SigLIP", 768, 64, 32000, 12, 12, 4.0,
                                "none"),
        "ViT-L-16-SigLIP-384": ("vit_large_patch16_siglip_384", "timm/ViT-B-16-SigLIP", 1024, 64, 32000, 16, 24,
                                4.0, "none"),
        "ViT-SO400M-14-SigLIP": ("vit_so400m_patch14_siglip_224", "timm/ViT-B-16-SigLIP", 1152, 16, 32000, 16, 27,
                                 3.7362, "none"),
        "ViT-B-16-SigLIP2": ("vit_base_patch16_siglip_224", "timm/ViT-B-16-SigLIP2", 768, 64, 256000, 12, 12, 4.0,
                             "tanh"),
        "ViT-B-16-SigLIP2-256": ("vit_base_patch16_siglip_256", "timm/ViT-B-16-SigLIP2-256", 768, 64, 256000, 12,
                                 12, 4.0, "tanh"),
        "ViT-SO400M-16-SigLIP2-384": ("vit_so400m_patch16_siglip_384", "timm/ViT-SO400M-16-SigLIP2-384", 1152, 64,
                                      256000, 16, 27, 3.7362, "tanh"),
    }.items()},
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


# clip_jax's own models, each a model above with its image tower changed (OpenCLIP's JSON has no key for the change).
# SigLIP 2's NaFlex SO400M/16 (google/siglip2-so400m-patch16-naflex): the towers of ViT-SO400M-16-SigLIP2-384, the
# image tower NaFlex with a 16 x 16 learned position grid.
_VARIANTS = {
    "ViT-SO400M-16-SigLIP2-NaFlex": ("ViT-SO400M-16-SigLIP2-384", {"naflex": True, "image_size": 256}),
}


def list_models() -> list[str]:
    return sorted([*_OPEN_CLIP_CONFIGS, *_VARIANTS])


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
        try:
            with open(name) as f:
                cfg = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:  # the error names the line and column
            raise InvalidInput(f"model config file {name} is not valid JSON: {e}") from None
        return config_from_open_clip(cfg, name=os.path.basename(name)[: -len(".json")])
    base, quick = (name[: -len("-quickgelu")], True) if name.endswith("-quickgelu") else (name, False)
    base, vision_changes = _VARIANTS.get(base, (base, None))
    if base not in _OPEN_CLIP_CONFIGS:
        raise InvalidInput(f"unknown model {name!r}; known models: {', '.join(list_models())} (each also with "
                         "-quickgelu), or pass an OpenCLIP model-config .json file or dict")
    config = config_from_open_clip({**_OPEN_CLIP_CONFIGS[base], "quick_gelu": quick}, name=name)
    if vision_changes:
        config = dataclasses.replace(config, vision=dataclasses.replace(config.vision, **vision_changes))
    return config
