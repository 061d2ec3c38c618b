"""Hugging Face transformers' `SiglipModel` <-> clip_jax: its `config.json` and its state_dict.

`hf_config(config)` is the SiglipConfig dict (`config.json`) of a clip_jax SigLIP model and `config_from_hf(dict,
name)` its inverse (transformers' defaults for the keys a file leaves out); `to_hf_state_dict(state_dict, config)`
renames an OpenCLIP state_dict (numpy values; the image tower under `visual.trunk.` in timm's names) into
SiglipModel's and `from_hf_state_dict` goes back. Both are exact: slicing, concatenating and reshaping only (the
blocks' q, k, v are split out of OpenCLIP's `qkv` / `in_proj`; the pooling head's `attention.in_proj` is OpenCLIP's
`q` and `kv` one above the other; the image positional embedding and the logit scale and bias lose or gain a leading
axis). `hf_unsupported(config)` says why a model has no SiglipModel counterpart (None when it has one): SiglipModel
is a ViT image tower with a biased patch convolution, no class token and no LayerNorm before its pre-LN blocks,
pooled by multi-head attention from a learned probe (no projection), and a bidirectional text tower pooling its last
token through a biased Linear, with a logit scale and a logit bias. A fixed-resolution SigLIP 2 is a SiglipModel;
transformers' SigLIP 2 with NaFlex (model_type `siglip2`, variable resolution) is `hf_siglip2`'s, which shares the
pieces here (`tower_configs`, `towers`, `clip_config`, `unsupported`, `hf_state_dict`, `open_clip_state_dict`).
"""

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from clip_jax.errors import InvalidInput
from clip_jax.interop.hf_clip import ACTIVATIONS, QUICK_GELU, block_from_act, block_unsupported, check_keys
from clip_jax.models.config import SIGLIP_INIT_LOGIT_BIAS, CLIPConfig, TextConfig, VisionConfig, is_resnet

MODEL_TYPE = "siglip"  # config.json's `model_type` of a SiglipModel folder
_DEFAULT_LOGIT_SCALE = math.log(1 / 0.07)  # OpenCLIP's SigLIP model configs set init_logit_bias only
# transformers' SiglipTextConfig / SiglipVisionConfig defaults (google/siglip-base-patch16-224) for the keys a
# config.json may leave out; the text projection_size defaults to the text hidden_size.
_TEXT_DEFAULTS = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                  "num_attention_heads": 12, "max_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh",
                  "layer_norm_eps": 1e-6, "projection_size": None}
VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                    "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                    "layer_norm_eps": 1e-6, "vision_use_head": True}
_KINDS = {"hidden_act": str, "layer_norm_eps": float, "vision_use_head": bool, "projection_size": (int, type(None)),
          "image_size": (int, list), "patch_size": (int, list)}  # the others are ints
# Keys of a SiglipModel state_dict that hold no weights (older transformers saved the position ids buffers).
_BUFFERS = ("text_model.embeddings.position_ids", "vision_model.embeddings.position_ids")


def hf_unsupported(config: CLIPConfig) -> str | None:
    """Why transformers' SiglipModel cannot hold `config` (one clause), or None when it can."""
    reason = unsupported(config, "SiglipModel")
    if reason is None and config.vision.naflex:
        return "its image tower is NaFlex (SigLIP 2's variable resolution: a Siglip2Model holds it)"
    return reason


def unsupported(config: CLIPConfig, model: str) -> str | None:
    """Why `model` (SiglipModel or Siglip2Model: the same towers but the image tower's input) cannot hold `config`
    (one clause), or None when it can, whatever the image tower's input."""
    if is_resnet(config):
        return f"its image tower is a ResNet ({model}'s is a ViT)"
    v, t = config.vision, config.text
    reasons = [
        f"its image tower pools {v.pool_type!r} ({model}'s: attention from a learned probe, 'map')"
        if not v.attention_pool else None,
        block_unsupported(v.block, "image"), block_unsupported(t.block, "text"),
        f"it has a LayerNorm before the image blocks (ln_pre; {model} has none)" if not v.no_ln_pre else None,
        f"it has no logit_bias ({model}'s head has one)" if config.init_logit_bias is None else None,
        "its text tower has a class embedding (embed_cls)" if t.embed_cls else None,
        f"its text tower is causal ({model}'s attends both ways: no_causal_mask)" if not t.no_causal_mask else None,
        f"its text tower pools {t.pool_type!r} ({model}: the last token)" if t.pool_type != "last" else None,
        f"its text projection is not a Linear with a bias (proj_type {t.proj_type!r}, proj_bias {t.proj_bias})"
        if t.proj_type != "linear" or not t.proj_bias else None,
    ]
    return next((r for r in reasons if r is not None), None)


def refuse(config: CLIPConfig, reason: str | None, model: str) -> None:
    """Raise the one line saying `config` has no `model` counterpart, when there is a `reason`."""
    if reason is not None:
        raise InvalidInput(f"{config.name} has no transformers {model} counterpart: {reason}")


def _activation(config: CLIPConfig, approximate: str) -> str:
    return QUICK_GELU if config.quick_gelu else ACTIVATIONS[approximate]


def hf_config(config: CLIPConfig) -> dict:
    """The `config.json` transformers' `SiglipModel.from_pretrained` reads for `config` (see `hf_unsupported`). The
    token ids are left to the tokenizer's files (SiglipModel pools the last position, whatever token it holds)."""
    refuse(config, hf_unsupported(config), "SiglipModel")
    text, vision = tower_configs(config)
    return {"architectures": ["SiglipModel"], "model_type": MODEL_TYPE, "initializer_factor": 1.0, "dtype": "float32",
            "text_config": text, "vision_config": vision}


def tower_configs(config: CLIPConfig) -> tuple[dict, dict]:
    """(text_config, vision_config) of SiglipModel's `config.json` for `config`."""
    v, t = config.vision, config.text
    text = {"model_type": "siglip_text_model", "vocab_size": t.vocab_size, "hidden_size": t.width,
            "intermediate_size": t.mlp_width, "num_hidden_layers": t.layers, "num_attention_heads": t.heads,
            "max_position_embeddings": t.context_length, "hidden_act": _activation(config, t.block.gelu_approximate),
            "layer_norm_eps": t.block.norm_eps, "projection_size": config.embed_dim,
            "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    vision = {"model_type": "siglip_vision_model", "hidden_size": v.width, "intermediate_size": v.mlp_width,
              "num_hidden_layers": v.layers, "num_attention_heads": v.heads, "num_channels": 3,
              "image_size": v.image_size, "patch_size": v.patch_size,
              "hidden_act": _activation(config, v.block.gelu_approximate), "layer_norm_eps": v.block.norm_eps,
              "vision_use_head": True}
    return text, vision


def _is_kind(value, kind) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is bool:
        return isinstance(value, bool)
    return isinstance(value, kind) and not isinstance(value, bool)


def _sub_config(cfg: Mapping[str, Any], key: str, defaults: dict, where: str) -> dict:
    """A sub-config with SiglipConfig's defaults filled in (`{key}_dict`, written by older transformers, wins)."""
    sub, legacy = cfg.get(key) or {}, cfg.get(f"{key}_dict") or {}
    if not isinstance(sub, Mapping) or not isinstance(legacy, Mapping):
        raise InvalidInput(f"{where}: {key} must be an object")
    merged = {**defaults, **sub, **legacy}
    for name in defaults:
        kind = _KINDS.get(name, int)
        if not _is_kind(merged[name], kind):
            wanted = {str: "a string", bool: "true or false"}.get(kind, "a number")
            raise InvalidInput(f"{where}: {key}.{name}={merged[name]!r} must be {wanted}")
    return merged


def square(value, key: str, where: str) -> int:
    """An image or patch size: an int, or a [height, width] pair of equal ints."""
    if isinstance(value, int):
        return value
    if len(value) == 2 and all(_is_kind(x, int) for x in value) and value[0] == value[1]:
        return value[0]
    raise InvalidInput(f"{where}: vision_config.{key}={value!r}: clip_jax builds square images and patches only")


def _check_model_type(cfg: Mapping[str, Any], where: str) -> None:
    if cfg.get("model_type") != MODEL_TYPE:
        raise InvalidInput(f"{where} is a transformers {cfg.get('model_type')!r} model; this reads SiglipModel "
                           f"folders (model_type {MODEL_TYPE!r})")


def towers(cfg: Mapping[str, Any], where: str, vision_defaults: dict = VISION_DEFAULTS) -> tuple[dict, dict]:
    """(text, vision) sub-configs, their defaults filled in (the vision tower's: `vision_defaults`), checked for
    what SiglipModel's image embedding and logits need."""
    t = _sub_config(cfg, "text_config", _TEXT_DEFAULTS, where)
    v = _sub_config(cfg, "vision_config", vision_defaults, where)
    if not v["vision_use_head"]:
        raise InvalidInput(f"{where}: vision_config.vision_use_head=false: its image tower has no attention-pooling "
                           "head (a vision backbone, as PaliGemma's), so no image embedding; clip_jax reads a "
                           "SiglipModel with its head (vision_use_head true)")
    if v["num_channels"] != 3:
        raise InvalidInput(f"{where}: vision_config.num_channels={v['num_channels']}; clip_jax's models take RGB")
    projection = t["hidden_size"] if t["projection_size"] is None else t["projection_size"]
    if projection != v["hidden_size"]:
        raise InvalidInput(f"{where}: text_config.projection_size={projection} is not vision_config.hidden_size="
                           f"{v['hidden_size']}: SiglipModel compares the text embedding with the image tower's "
                           "output, so the two must be as wide")
    return t, v


def config_from_hf(cfg: Mapping[str, Any], name: str = "custom", where: str = "config.json") -> CLIPConfig:
    """The clip_jax model of a transformers SiglipConfig dict (a SiglipModel folder's `config.json`), its head
    initialised as OpenCLIP's SigLIP model configs say (logit_bias -10)."""
    _check_model_type(cfg, where)
    t, v = towers(cfg, where)
    return clip_config(t, v, square(v["image_size"], "image_size", where), False, name, where)


def clip_config(t: dict, v: dict, image_size: int, naflex: bool, name: str, where: str) -> CLIPConfig:
    """The clip_jax model of checked sub-configs `t`, `v` (see `towers`), its image tower of `image_size` (a
    NaFlex tower when `naflex`)."""
    v_block, v_quick = block_from_act(v["hidden_act"], v["layer_norm_eps"], f"{where}: vision_config")
    t_block, t_quick = block_from_act(t["hidden_act"], t["layer_norm_eps"], f"{where}: text_config")
    if v_quick != t_quick:
        raise InvalidInput(f"{where}: one tower is QuickGELU and the other not ({v['hidden_act']!r} / "
                           f"{t['hidden_act']!r}); clip_jax's quick_gelu is the whole model's")
    try:
        return CLIPConfig(
            embed_dim=v["hidden_size"],
            vision=VisionConfig(image_size=image_size, patch_size=square(v["patch_size"], "patch_size", where),
                                width=v["hidden_size"], layers=v["num_hidden_layers"],
                                heads=v["num_attention_heads"], mlp_width=v["intermediate_size"], block=v_block,
                                no_ln_pre=True, pool_type="map", naflex=naflex),
            text=TextConfig(context_length=t["max_position_embeddings"], vocab_size=t["vocab_size"],
                            width=t["hidden_size"], heads=t["num_attention_heads"], layers=t["num_hidden_layers"],
                            mlp_width=t["intermediate_size"], block=t_block, no_causal_mask=True, pool_type="last",
                            proj_bias=True),
            quick_gelu=v_quick, name=name, init_logit_scale=_DEFAULT_LOGIT_SCALE,
            init_logit_bias=SIGLIP_INIT_LOGIT_BIAS, custom_text=True)
    except InvalidInput as e:
        raise InvalidInput(f"{where}: {e}") from None


# How a tensor's layout differs between the two: (OpenCLIP -> SiglipModel, SiglipModel -> OpenCLIP).
_SAME = (lambda x: x, lambda x: x)
_LEADING = (lambda x: x.reshape(x.shape[1:]), lambda x: x.reshape((1,) + x.shape))  # timm's [1, N, W] pos_embed
_SCALAR = (lambda x: x.reshape((1,)), lambda x: x.reshape(()))  # OpenCLIP's scalar logit scale and bias, [1] in HF


def _weight_and_bias(ours: str, theirs: str) -> list[tuple[str, str, tuple]]:
    return [(f"{ours}.{w}", f"{theirs}.{w}", _SAME) for w in ("weight", "bias")]


_HF_BLOCK = ("layer_norm1", "layer_norm2", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
_TIMM_BLOCK = ("norm1", "norm2", "attn.proj", "mlp.fc1", "mlp.fc2")  # OpenCLIP's image tower: timm's names
_OPEN_CLIP_BLOCK = ("ln_1", "ln_2", "attn.out_proj", "mlp.c_fc", "mlp.c_proj")


def _blocks(layers: int, ours: str, names: tuple[str, ...], theirs: str) -> list[tuple[str, str, tuple]]:
    """Every residual block's norms, attention output projection and MLP, ours `{ours}{i}.` as `names`, SiglipModel's
    `{theirs}{i}.`."""
    return [pair for i in range(layers) for name, hf_name in zip(names, _HF_BLOCK)
            for pair in _weight_and_bias(f"{ours}{i}.{name}", f"{theirs}{i}.{hf_name}")]


def _vision_blocks(config: CLIPConfig) -> list[tuple[str, str, tuple]]:
    return _blocks(config.vision.layers, "visual.trunk.blocks.", _TIMM_BLOCK, "vision_model.encoder.layers.")


def _text_blocks(config: CLIPConfig, t: str) -> list[tuple[str, str, tuple]]:
    return _blocks(config.text.layers, f"{t}transformer.resblocks.", _OPEN_CLIP_BLOCK, "text_model.encoder.layers.")


def _renamed(config: CLIPConfig, patch_layout: tuple = _SAME) -> list[tuple[str, str, tuple]]:
    """(OpenCLIP key, SiglipModel key, layouts) of every tensor that is one tensor in both; the patch embedding's
    weight in `patch_layout` (SiglipModel's convolution: OpenCLIP's)."""
    t = "text." if config.custom_text else ""
    v, pool, head = "vision_model.", "visual.trunk.attn_pool.", "vision_model.head."
    return [
        ("visual.trunk.patch_embed.proj.weight", f"{v}embeddings.patch_embedding.weight", patch_layout),
        ("visual.trunk.patch_embed.proj.bias", f"{v}embeddings.patch_embedding.bias", _SAME),
        ("visual.trunk.pos_embed", f"{v}embeddings.position_embedding.weight", _LEADING),
        *_vision_blocks(config),
        *_weight_and_bias("visual.trunk.norm", f"{v}post_layernorm"),
        (f"{pool}latent", f"{head}probe", _SAME),
        *_weight_and_bias(f"{pool}proj", f"{head}attention.out_proj"),
        *_weight_and_bias(f"{pool}norm", f"{head}layernorm"),
        *_weight_and_bias(f"{pool}mlp.fc1", f"{head}mlp.fc1"),
        *_weight_and_bias(f"{pool}mlp.fc2", f"{head}mlp.fc2"),
        (f"{t}token_embedding.weight", "text_model.embeddings.token_embedding.weight", _SAME),
        (f"{t}positional_embedding", "text_model.embeddings.position_embedding.weight", _SAME),
        *_text_blocks(config, t),
        *_weight_and_bias(f"{t}ln_final", "text_model.final_layer_norm"),
        *_weight_and_bias(f"{t}text_projection", "text_model.head"),
        ("logit_scale", "logit_scale", _SCALAR),
        ("logit_bias", "logit_bias", _SCALAR),
    ]


def _qkv(ours: str, theirs: str, layers: int, w: str) -> list[tuple]:
    """A tower's blocks: OpenCLIP's input projection `ours` (`{i}`: the block) is SiglipModel's q, k and v."""
    return [((ours.format(i=i),), (1,), tuple(f"{theirs.format(i=i)}.{n}_proj.{w}" for n in "qkv"), (1, 1, 1))
            for i in range(layers)]


def _stacked(config: CLIPConfig) -> list[tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...], tuple[int, ...]]]:
    """Tensors stacked on their first axis in one library and apart in the other: (OpenCLIP keys, their relative
    row counts, SiglipModel keys, theirs). The blocks' q, k, v; the pooling head's q and kv (keys then values)."""
    t = "text." if config.custom_text else ""
    groups = []
    for w in ("weight", "bias"):
        groups += _qkv(f"visual.trunk.blocks.{{i}}.attn.qkv.{w}", "vision_model.encoder.layers.{i}.self_attn",
                       config.vision.layers, w)
        groups += _qkv(f"{t}transformer.resblocks.{{i}}.attn.in_proj_{w}", "text_model.encoder.layers.{i}.self_attn",
                       config.text.layers, w)
        groups.append(((f"visual.trunk.attn_pool.q.{w}", f"visual.trunk.attn_pool.kv.{w}"), (1, 2),
                       (f"vision_model.head.attention.in_proj_{w}",), (1,)))
    return groups


def _regroup(tensors: list, sizes: tuple[int, ...], where: str, key: str) -> list[np.ndarray]:
    """`tensors` one above the other, cut into parts of relative row counts `sizes`."""
    whole = np.concatenate([np.asarray(x) for x in tensors]) if len(tensors) > 1 else np.asarray(tensors[0])
    unit, rest = divmod(whole.shape[0] if whole.ndim else 0, sum(sizes))
    if rest or not unit:
        raise InvalidInput(f"{where}: {key} has {whole.shape[0] if whole.ndim else 0} rows, which do not split "
                           f"into {len(sizes)} parts of relative sizes {sizes}")
    if len(sizes) == 1:
        return [whole]
    return np.split(whole, np.cumsum([unit * s for s in sizes[:-1]]))


def to_hf_state_dict(state_dict: Mapping[str, np.ndarray], config: CLIPConfig) -> dict[str, np.ndarray]:
    """SiglipModel's state_dict from an OpenCLIP one of `config` (numpy values)."""
    refuse(config, hf_unsupported(config), "SiglipModel")
    return hf_state_dict(state_dict, config)


def hf_state_dict(state_dict: Mapping[str, np.ndarray], config: CLIPConfig,
                  patch_layout: tuple = _SAME) -> dict[str, np.ndarray]:
    """The transformers state_dict (SiglipModel's names) of an OpenCLIP one of `config`, the patch embedding's
    weight in `patch_layout` ((OpenCLIP -> transformers, back))."""
    out = {theirs: layout[0](np.asarray(state_dict[ours])) for ours, theirs, layout in _renamed(config, patch_layout)}
    for ours, our_sizes, theirs, their_sizes in _stacked(config):
        out.update(zip(theirs, _regroup([state_dict[k] for k in ours], their_sizes, "the state_dict", ours[0])))
    return out


def from_hf_state_dict(state_dict: Mapping[str, Any], config: CLIPConfig, where: str) -> dict[str, np.ndarray]:
    """The OpenCLIP state_dict of `config` from a SiglipModel one (numpy values); a key missing or left over is
    named (the shapes are checked when the OpenCLIP state_dict is converted)."""
    return open_clip_state_dict(state_dict, config, where, "SiglipModel")


def open_clip_state_dict(state_dict: Mapping[str, Any], config: CLIPConfig, where: str, model: str,
                         patch_layout: tuple = _SAME) -> dict[str, np.ndarray]:
    """`hf_state_dict`'s inverse: the OpenCLIP state_dict of `config` from a transformers `model`'s (numpy values),
    a key missing or left over named."""
    state_dict = {k: v for k, v in state_dict.items() if k not in _BUFFERS}
    renamed = _renamed(config, patch_layout)
    expected = {theirs for _, theirs, _ in renamed} | {k for g in _stacked(config) for k in g[2]}
    check_keys(state_dict, expected, f"{where} does not hold the {model} its config.json describes ({config.name})")
    out = {ours: layout[1](np.asarray(state_dict[theirs])) for ours, theirs, layout in renamed}
    for ours, our_sizes, theirs, their_sizes in _stacked(config):
        out.update(zip(ours, _regroup([state_dict[k] for k in theirs], our_sizes, where, theirs[0])))
    return out
