"""Hugging Face transformers' `CLIPModel` <-> clip_jax: its `config.json` and its state_dict.

`hf_config(config)` is the CLIPConfig dict (`config.json`) of a clip_jax model and `config_from_hf(dict, name)` its
inverse; `to_hf_state_dict(state_dict, config)` renames an OpenCLIP state_dict (numpy values) into CLIPModel's
(q, k and v split out of `in_proj`, the projections transposed into Linear weights) and `from_hf_state_dict` goes
back. Both are exact: slicing, concatenating and transposing only. `hf_unsupported(config)` says why a model has no
CLIPModel counterpart (None when it has one): CLIPModel is a ViT image tower and a causal text tower of pre-LN
blocks with biased LayerNorms, pooling the class token and the end-of-text token, with no logit bias.
"""

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from clip_jax.errors import InvalidInput
from clip_jax.models.config import BlockConfig, CLIPConfig, TextConfig, VisionConfig, is_resnet
from clip_jax.text.clip_tokenizer import EOT_ID, SOT_ID, VOCAB_SIZE

MODEL_TYPE = "clip"  # config.json's `model_type` of a CLIPModel folder
# transformers' names of the activations clip_jax builds: OpenAI's QuickGELU, torch's exact and tanh GELU.
QUICK_GELU, ACTIVATIONS = "quick_gelu", {"none": "gelu", "tanh": "gelu_pytorch_tanh"}
_DEFAULT_LOGIT_SCALE = math.log(1 / 0.07)
_HF_LOGIT_SCALE = 2.6592  # CLIPConfig's default logit_scale_init_value: ln(1/0.07) rounded
# CLIPConfig's defaults for the keys a config.json may leave out (transformers' CLIPTextConfig / CLIPVisionConfig).
_TEXT_DEFAULTS = {"vocab_size": 49408, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12,
                  "num_attention_heads": 8, "max_position_embeddings": 77, "hidden_act": QUICK_GELU,
                  "layer_norm_eps": 1e-5, "eos_token_id": 2}
_VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                    "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": QUICK_GELU,
                    "layer_norm_eps": 1e-5}
# Keys of a CLIPModel state_dict that hold no weights (older transformers saved the position ids buffers).
_BUFFERS = ("text_model.embeddings.position_ids", "vision_model.embeddings.position_ids")


def block_unsupported(block: BlockConfig, tower: str) -> str | None:
    if block.custom or block.ls_init_value is not None:
        options = block.custom_options() + (["ls_init_value"] if block.ls_init_value is not None else [])
        return f"its {tower} blocks use OpenCLIP's custom-block options {options or ['block_type=custom']}"
    if not (block.norm_scale and block.norm_bias):
        return f"its {tower} LayerNorms have no scale or no bias"
    return None


def hf_unsupported(config: CLIPConfig) -> str | None:
    """Why transformers' CLIPModel cannot hold `config` (one clause), or None when it can."""
    if is_resnet(config):
        return "its image tower is a ResNet (CLIPModel's is a ViT)"
    v, t = config.vision, config.text
    reasons = [
        block_unsupported(v.block, "image"), block_unsupported(t.block, "text"),
        "it has no LayerNorm before the image blocks (no_ln_pre)" if v.no_ln_pre else None,
        f"its image tower pools {v.pool_type!r} (CLIPModel: the class token)" if v.pool_type != "tok" else None,
        "it has a logit_bias (a SigLIP head)" if config.init_logit_bias is not None else None,
        "its text tower has a class embedding (embed_cls)" if t.embed_cls else None,
        "its text tower is not causal (no_causal_mask)" if t.no_causal_mask else None,
        f"its text tower pools {t.pool_type!r} (CLIPModel: the end-of-text token)"
        if t.pool_type not in ("argmax", "eos") else None,
        "its text tower pools token id 2, which CLIPModel reads as the largest id"
        if t.pool_type == "eos" and t.eos_id == 2 else None,
        f"its text projection is not a plain matrix (proj_type {t.proj_type!r}, proj_bias {t.proj_bias})"
        if t.proj_type != "linear" or t.proj_bias else None,
        f"its text vocabulary has {t.vocab_size} tokens, not the {VOCAB_SIZE} of the tokenizer the folder ships"
        if t.vocab_size != VOCAB_SIZE else None,
    ]
    return next((r for r in reasons if r is not None), None)


def _activation(config: CLIPConfig, block: BlockConfig) -> str:
    return QUICK_GELU if config.quick_gelu else ACTIVATIONS[block.gelu_approximate]


def hf_config(config: CLIPConfig) -> dict:
    """The `config.json` transformers' `CLIPModel.from_pretrained` reads for `config` (see `hf_unsupported`)."""
    reason = hf_unsupported(config)
    if reason is not None:
        raise InvalidInput(f"{config.name} has no transformers CLIPModel counterpart: {reason}")
    v, t = config.vision, config.text
    # CLIPModel pools the first `eos_token_id`; the largest id, OpenAI's end of text, is where argmax pools too
    eos = EOT_ID if t.pool_type == "argmax" else t.eos_id
    text = {"model_type": "clip_text_model", "vocab_size": t.vocab_size, "hidden_size": t.width,
            "intermediate_size": t.mlp_width, "projection_dim": config.embed_dim, "num_hidden_layers": t.layers,
            "num_attention_heads": t.heads, "max_position_embeddings": t.context_length,
            "hidden_act": _activation(config, t.block), "layer_norm_eps": t.block.norm_eps,
            "bos_token_id": SOT_ID, "eos_token_id": eos, "pad_token_id": EOT_ID}
    vision = {"model_type": "clip_vision_model", "hidden_size": v.width, "intermediate_size": v.mlp_width,
              "projection_dim": config.embed_dim, "num_hidden_layers": v.layers, "num_attention_heads": v.heads,
              "num_channels": 3, "image_size": v.image_size, "patch_size": v.patch_size,
              "hidden_act": _activation(config, v.block), "layer_norm_eps": v.block.norm_eps}
    return {"architectures": ["CLIPModel"], "model_type": MODEL_TYPE, "projection_dim": config.embed_dim,
            "logit_scale_init_value": config.init_logit_scale, "initializer_factor": 1.0, "dtype": "float32",
            "text_config": text, "vision_config": vision}


def _sub_config(cfg: Mapping[str, Any], key: str, defaults: dict, where: str) -> dict:
    """A sub-config with CLIPConfig's defaults filled in (`{key}_dict`, written by older transformers, wins)."""
    sub = cfg.get(key) or {}
    legacy = cfg.get(f"{key}_dict") or {}
    if not isinstance(sub, Mapping) or not isinstance(legacy, Mapping):
        raise InvalidInput(f"{where}: {key} must be an object")
    merged = {**defaults, **sub, **legacy}
    for name in defaults:
        value = merged[name]
        wanted = str if name == "hidden_act" else (float if name == "layer_norm_eps" else int)
        if not isinstance(value, (int, float) if wanted is float else wanted) or isinstance(value, bool):
            raise InvalidInput(f"{where}: {key}.{name}={value!r} must be {'a string' if wanted is str else 'a number'}")
    return merged


def block_from_act(act: str, eps: float, where: str) -> tuple[BlockConfig, bool]:
    """(the block, whether it is QuickGELU) of a tower whose `hidden_act` is `act`."""
    if act == QUICK_GELU:
        return BlockConfig(norm_eps=float(eps)), True
    approximate = {name: key for key, name in ACTIVATIONS.items()}.get(act)
    if approximate is None:
        raise InvalidInput(f"{where}: hidden_act={act!r} is not built by clip_jax (it builds "
                           f"{sorted([QUICK_GELU, *ACTIVATIONS.values()])})")
    return BlockConfig(norm_eps=float(eps), gelu_approximate=approximate), False


def config_from_hf(cfg: Mapping[str, Any], name: str = "custom", where: str = "config.json") -> CLIPConfig:
    """The clip_jax model of a transformers CLIPConfig dict (a CLIPModel folder's `config.json`)."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise InvalidInput(f"{where} is a transformers {cfg.get('model_type')!r} model; clip_jax reads CLIPModel "
                           f"folders (model_type {MODEL_TYPE!r})")
    t = _sub_config(cfg, "text_config", _TEXT_DEFAULTS, where)
    v = _sub_config(cfg, "vision_config", _VISION_DEFAULTS, where)
    if v["num_channels"] != 3:
        raise InvalidInput(f"{where}: vision_config.num_channels={v['num_channels']}; clip_jax's models take RGB")
    if not isinstance(v["image_size"], int) or not isinstance(v["patch_size"], int):
        raise InvalidInput(f"{where}: non-square image_size / patch_size are not supported")
    v_block, v_quick = block_from_act(v["hidden_act"], v["layer_norm_eps"], f"{where}: vision_config")
    t_block, t_quick = block_from_act(t["hidden_act"], t["layer_norm_eps"], f"{where}: text_config")
    if v_quick != t_quick:
        raise InvalidInput(f"{where}: one tower is QuickGELU and the other not ({v['hidden_act']!r} / "
                           f"{t['hidden_act']!r}); clip_jax's quick_gelu is the whole model's")
    eos = t["eos_token_id"]
    # transformers pools the argmax for eos_token_id 2 (its old configs), else the first eos_token_id, which is
    # the argmax where the end of text is the vocabulary's largest id
    argmax = eos == 2 or eos == t["vocab_size"] - 1
    scale = float(cfg.get("logit_scale_init_value", _HF_LOGIT_SCALE))
    try:
        return CLIPConfig(
            embed_dim=int(cfg.get("projection_dim", 512)),
            vision=VisionConfig(image_size=v["image_size"], patch_size=v["patch_size"], width=v["hidden_size"],
                                layers=v["num_hidden_layers"], heads=v["num_attention_heads"],
                                mlp_width=v["intermediate_size"], block=v_block),
            text=TextConfig(context_length=t["max_position_embeddings"], vocab_size=t["vocab_size"],
                            width=t["hidden_size"], heads=t["num_attention_heads"], layers=t["num_hidden_layers"],
                            mlp_width=t["intermediate_size"], block=t_block,
                            pool_type="argmax" if argmax else "eos", eos_id=2 if argmax else int(eos)),
            quick_gelu=v_quick, name=name,
            init_logit_scale=_DEFAULT_LOGIT_SCALE if abs(scale - _DEFAULT_LOGIT_SCALE) < 1e-4 else scale)
    except InvalidInput as e:
        raise InvalidInput(f"{where}: {e}") from None


def _block_pairs(ours: str, theirs: str, layers: int) -> list[tuple[str, str]]:
    """(OpenCLIP key, CLIPModel key) of each block's tensors but the attention's input projection."""
    pairs = []
    for i in range(layers):
        a, b = f"{ours}transformer.resblocks.{i}.", f"{theirs}encoder.layers.{i}."
        for name, hf_name in (("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"), ("attn.out_proj", "self_attn.out_proj"),
                              ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
            pairs += [(f"{a}{name}.weight", f"{b}{hf_name}.weight"), (f"{a}{name}.bias", f"{b}{hf_name}.bias")]
    return pairs


def _renamed(config: CLIPConfig) -> list[tuple[str, str]]:
    """(OpenCLIP key, CLIPModel key) of every tensor both keep in the same layout."""
    t = "text." if config.custom_text else ""
    v, tm = "vision_model.", "text_model."
    norm = lambda a, b: [(f"{a}.weight", f"{b}.weight"), (f"{a}.bias", f"{b}.bias")]  # noqa: E731
    return [
        ("visual.conv1.weight", f"{v}embeddings.patch_embedding.weight"),
        ("visual.class_embedding", f"{v}embeddings.class_embedding"),
        ("visual.positional_embedding", f"{v}embeddings.position_embedding.weight"),
        *norm("visual.ln_pre", f"{v}pre_layrnorm"),
        *_block_pairs("visual.", v, config.vision.layers),
        *norm("visual.ln_post", f"{v}post_layernorm"),
        (f"{t}token_embedding.weight", f"{tm}embeddings.token_embedding.weight"),
        (f"{t}positional_embedding", f"{tm}embeddings.position_embedding.weight"),
        *_block_pairs(t, tm, config.text.layers),
        *norm(f"{t}ln_final", f"{tm}final_layer_norm"),
        ("logit_scale", "logit_scale"),
    ]


def _in_projections(config: CLIPConfig) -> list[tuple[str, str]]:
    """(OpenCLIP block prefix, CLIPModel attention prefix): `in_proj_*` rows q, k, v are `{q,k,v}_proj`."""
    t = "text." if config.custom_text else ""
    return [(f"{ours}transformer.resblocks.{i}.attn.", f"{theirs}encoder.layers.{i}.self_attn.")
            for ours, theirs, layers in (("visual.", "vision_model.", config.vision.layers),
                                         (t, "text_model.", config.text.layers))
            for i in range(layers)]


def _projections(config: CLIPConfig) -> list[tuple[str, str]]:
    """(OpenCLIP key [width, embed], CLIPModel Linear weight [embed, width])."""
    return [("visual.proj", "visual_projection.weight"),
            (f"{'text.' if config.custom_text else ''}text_projection", "text_projection.weight")]


def to_hf_state_dict(state_dict: Mapping[str, np.ndarray], config: CLIPConfig) -> dict[str, np.ndarray]:
    """CLIPModel's state_dict from an OpenCLIP one of `config` (numpy values; q, k, v are views of `in_proj`)."""
    reason = hf_unsupported(config)
    if reason is not None:
        raise InvalidInput(f"{config.name} has no transformers CLIPModel counterpart: {reason}")
    out = {theirs: state_dict[ours] for ours, theirs in _renamed(config)}
    for ours, theirs in _in_projections(config):
        weight, bias = state_dict[f"{ours}in_proj_weight"], state_dict[f"{ours}in_proj_bias"]
        for name, w, b in zip("qkv", np.split(weight, 3), np.split(bias, 3)):
            out[f"{theirs}{name}_proj.weight"], out[f"{theirs}{name}_proj.bias"] = w, b
    for ours, theirs in _projections(config):
        out[theirs] = np.ascontiguousarray(np.asarray(state_dict[ours]).T)
    return out


def check_keys(state_dict: Mapping[str, Any], expected: set[str], what: str) -> None:
    """Refuses a transformers state_dict whose keys are not `expected`, naming the missing and unexpected ones after
    `what` (the file and the model it should hold)."""
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        shown = lambda keys: ", ".join(keys[:6]) + (f", ... ({len(keys) - 6} more)" if len(keys) > 6 else "")  # noqa
        problems = [f"{len(k)} {kind}: {shown(k)}" for kind, k in (("missing", missing), ("unexpected", unexpected))
                    if k]
        raise InvalidInput(f"{what}: {'; '.join(problems)}")


def from_hf_state_dict(state_dict: Mapping[str, Any], config: CLIPConfig, where: str) -> dict[str, np.ndarray]:
    """The OpenCLIP state_dict of `config` from a CLIPModel one (numpy values); a key missing or left over is
    named (the shapes are checked when the OpenCLIP state_dict is converted)."""
    state_dict = {k: v for k, v in state_dict.items() if k not in _BUFFERS}
    expected = {theirs for _, theirs in _renamed(config) + _projections(config)}
    expected |= {f"{p}{n}_proj.{w}" for _, p in _in_projections(config) for n in "qkv" for w in ("weight", "bias")}
    check_keys(state_dict, expected, f"{where} does not hold the CLIPModel its config.json describes ({config.name})")
    out = {ours: np.asarray(state_dict[theirs]) for ours, theirs in _renamed(config)}
    for ours, theirs in _in_projections(config):
        for kind in ("weight", "bias"):
            out[f"{ours}in_proj_{kind}"] = np.concatenate([np.asarray(state_dict[f"{theirs}{n}_proj.{kind}"])
                                                           for n in "qkv"])
    for ours, theirs in _projections(config):
        out[ours] = np.ascontiguousarray(np.asarray(state_dict[theirs]).T)
    return out
