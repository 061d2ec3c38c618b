"""OpenCLIP's model-config JSON (the dicts of open_clip/model_configs/*.json) in and out of a `CLIPConfig`.

`config_from_open_clip(cfg, name)` checks every key first (unknown keys, wrong types, towers clip_jax does not
build, option pairs OpenCLIP rejects each raise `InvalidInput` naming the key), then builds the config;
`open_clip_model_cfg(config)` is its inverse, leaving out keys at OpenCLIP's default.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from clip_jax.errors import InvalidInput
from clip_jax.models.config import (UNNAMED, BlockConfig, CLIPConfig, ResNetVisionConfig, TextConfig, VisionConfig,
                                    is_resnet)

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
    "final_ln_after_pool": "bool", "naflex": "bool", **_BLOCK_KEYS,
}
_TEXT_KEYS = {
    "context_length": "int", "vocab_size": "int", "width": "int", "heads": "int", "layers": "int",
    "mlp_ratio": "float", "embed_cls": "bool", "pad_id": "int", "eos_id": "int", "no_causal_mask": "bool",
    "pool_type": "str", "final_ln_after_pool": "bool", "proj_type": "str", "proj_bias": "bool",
    "hf_tokenizer_name": "str?", "tokenizer_kwargs": "dict?", **_BLOCK_KEYS,
}
_TOKENIZER_KWARGS = {"clean": "str"}  # OpenCLIP's HFTokenizer cleans "whitespace" when none is given
_OPEN_CLIP_CLEAN = ("canonicalize", "lower", "whitespace")  # OpenCLIP's modes; clip_jax's tokenizer has more
# Keys that concern preprocessing or tokenisation only (accepted, no effect on the model), and keys that matter
# only with a tower we refuse anyway (timm_*, hf_*, attn_pooler_*), or legacy keys OpenCLIP itself never reads.
_IGNORED_KEYS = {
    "timm_model_pretrained", "timm_pool", "timm_proj", "timm_proj_bias", "timm_drop", "timm_drop_path",
    "hf_model_pretrained", "tokenizer_mode", "proj", "pooler_type",
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
# OpenCLIP's SigLIP image towers are timm models named in `timm_model_name` (with timm_pool "map", timm_proj
# "none"); timm's registered sizes (timm/models/vision_transformer.py, timm 1.0.31): every LayerNorm eps 1e-6, exact
# GELU but where timm's model asks for "gelu_tanh". timm builds its own image size, whatever image_size says.
TIMM_SIGLIP = {
    f"vit_{size}_patch{patch}_siglip_{image}": {"image_size": image, "patch_size": patch, "width": width,
                                                "layers": layers, "heads": heads, "mlp_ratio": ratio,
                                                "approximate": "tanh" if image in tanh else "none"}
    for size, patch, width, layers, heads, ratio, images, tanh in (
        ("base", 16, 768, 12, 12, 4.0, (224, 256, 384, 512), ()),
        ("base", 32, 768, 12, 12, 4.0, (256,), (256,)),
        ("large", 16, 1024, 24, 16, 4.0, (256, 384, 512), (512,)),
        ("so400m", 14, 1152, 27, 16, 3.7362, (224, 378, 384), ()),
        ("so400m", 16, 1152, 27, 16, 3.7362, (256, 384, 512), (256, 384, 512)),
    )
    for image in images
}
_TIMM_KEYS = {"image_size", "timm_model_name", "timm_model_pretrained", "timm_pool", "timm_proj", "patch_dropout"}
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
    for key, schema in (("norm_kwargs", _NORM_KWARGS), ("act_kwargs", _ACT_KWARGS),
                        ("tokenizer_kwargs", _TOKENIZER_KWARGS)):
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


def _timm_siglip_from_open_clip(cfg: Mapping[str, Any], name: str) -> VisionConfig:
    """SigLIP's image tower from a vision_cfg naming a timm model: timm's registered sizes for that name."""
    where = f"model config {name!r}: vision_cfg"
    _check_types(cfg, {"image_size": "int", "timm_model_name": "str", "timm_pool": "str", "timm_proj": "str",
                       "patch_dropout": "float"}, where)
    timm_name = cfg["timm_model_name"]
    if timm_name not in TIMM_SIGLIP:
        raise InvalidInput(f"{where}.timm_model_name={timm_name!r}: timm image towers are not built, but for "
                           f"SigLIP's attention-pooled ViTs ({', '.join(sorted(TIMM_SIGLIP))})")
    sizes = TIMM_SIGLIP[timm_name]
    wrong = [f"{key}={cfg.get(key)!r} (SigLIP's: {want!r})" for key, want in (("timm_pool", "map"),
                                                                            ("timm_proj", "none"))
             if cfg.get(key) != want]
    if cfg.get("timm_model_pretrained"):
        wrong.append("timm_model_pretrained=true (clip_jax reads no weights from timm's hub: give --pretrained)")
    if cfg.get("image_size", sizes["image_size"]) != sizes["image_size"]:
        wrong.append(f"image_size={cfg['image_size']!r} (timm builds {timm_name} at {sizes['image_size']})")
    others = sorted(set(cfg) - _TIMM_KEYS)
    if others:
        wrong.append(f"{others} (OpenCLIP ignores them beside timm_model_name: leave them out)")
    if wrong:
        raise InvalidInput(f"{where}: {'; '.join(wrong)}")
    return VisionConfig(image_size=sizes["image_size"], patch_size=sizes["patch_size"], width=sizes["width"],
                        layers=sizes["layers"], heads=sizes["heads"],
                        mlp_width=_mlp_width(sizes["width"], sizes["mlp_ratio"]), no_ln_pre=True, pool_type="map",
                        patch_dropout=float(cfg.get("patch_dropout", 0.0)),
                        block=BlockConfig(norm_eps=1e-6, gelu_approximate=sizes["approximate"]))


def _timm_siglip_name(v: VisionConfig) -> str | None:
    """The timm model name of an attention-pooled tower built at one of timm's registered sizes, else None."""
    for timm_name in TIMM_SIGLIP:
        try:
            if _timm_siglip_from_open_clip({"timm_model_name": timm_name, "timm_pool": "map", "timm_proj": "none",
                                            "image_size": v.image_size}, timm_name) == dataclasses.replace(
                                                v, patch_dropout=0.0):
                return timm_name
        except InvalidInput:
            continue
    return None


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


def _tokenizer_from_open_clip(t: Mapping[str, Any], where: str) -> dict:
    """TextConfig's tokenizer fields: the folder or Hub name and its cleaning (OpenCLIP's default "whitespace")."""
    if not t.get("hf_tokenizer_name"):
        return {}
    from clip_jax.text.sentencepiece_tokenizer import CLEAN_MODES

    clean = (t.get("tokenizer_kwargs") or {}).get("clean", "whitespace")
    if clean not in CLEAN_MODES:
        raise InvalidInput(f"{where}.tokenizer_kwargs.clean={clean!r}: choose one of {CLEAN_MODES}")
    return {"tokenizer": t["hf_tokenizer_name"], "tokenizer_clean": clean}


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
        naflex=v.get("naflex", False),
    )


def config_from_open_clip(cfg: Mapping[str, Any], name: str = UNNAMED) -> CLIPConfig:
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
    timm = _timm_siglip_from_open_clip(v, name) if v.get("timm_model_name") is not None else None
    if resnet is None and timm is None:
        _check_tower(v, _VISION_KEYS, f"{name}: vision_cfg")
    _check_preprocessing(v, f"{name}: vision_cfg")
    _check_tower(t, _TEXT_KEYS, f"{name}: text_cfg")
    try:
        t_width = t["width"]
        vision = resnet or timm or _vit_from_open_clip(v)
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
            **_tokenizer_from_open_clip(t, f"{name}: text_cfg"),
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
    timm_name = _timm_siglip_name(v) if v.attention_pool and not v.naflex else None
    if timm_name is not None:  # OpenCLIP's SigLIP form; any other size keeps clip_jax's pool_type "map"
        out = {"image_size": v.image_size, "timm_model_name": timm_name, "timm_model_pretrained": False,
               "timm_pool": "map", "timm_proj": "none"}
        return out if v.patch_dropout == 0.0 else out | {"patch_dropout": v.patch_dropout}
    vision = {"image_size": v.image_size, "layers": v.layers, "width": v.width, "patch_size": v.patch_size}
    if v.width // v.heads != 64:
        vision["head_width"] = v.width // v.heads
    if v.mlp_width != _mlp_width(v.width, 4.0):
        vision["mlp_ratio"] = _ratio(v.width, v.mlp_width)
    optional = (("patch_dropout", v.patch_dropout, 0.0), ("no_ln_pre", v.no_ln_pre, False),
                ("pool_type", v.pool_type, "tok"), ("final_ln_after_pool", v.final_ln_after_pool, False),
                ("naflex", v.naflex, False))
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
    if t.tokenizer is not None:  # a cleaning OpenCLIP has no name for stays the folder's (its own files say it)
        text["hf_tokenizer_name"] = t.tokenizer
        if t.tokenizer_clean in _OPEN_CLIP_CLEAN:
            text["tokenizer_kwargs"] = {"clean": t.tokenizer_clean}

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
