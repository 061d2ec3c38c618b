"""OpenCLIP <-> clip_jax weights.

`from_open_clip(state_dict, model)` turns an OpenCLIP state_dict (numpy values) into clip_jax params;
`to_open_clip(params, model)` goes back. Both are exact: transposes and stacking only. The command line

    python -m clip_jax.convert SRC DST --model ViT-L-14

reads an OpenCLIP checkpoint (`.pt`/`.pth`/`.bin` through torch when installed, `.safetensors`, `.npz`) and writes
clip_jax params (`.npz`), or, when SRC holds clip_jax params, writes an OpenCLIP state_dict (`.safetensors`, `.npz`,
or `.pt` through torch).
"""

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from clip_jax.errors import InvalidInput, MissingInput, UserError
from clip_jax.models.config import BlockConfig, CLIPConfig, get_model_config

# Layouts: a clip_jax leaf is the OpenCLIP tensor with its axes permuted.
_SAME = None
_LINEAR = (1, 0)  # torch Linear weight [out, in] -> Flax kernel [in, out]
_CONV = (2, 3, 1, 0)  # torch conv weight OIHW -> Flax kernel HWIO

# Keys OpenAI's original (JIT) checkpoints carry besides the weights; they describe, they hold no parameters.
_METADATA_KEYS = {"input_resolution", "context_length", "vocab_size"}


@dataclasses.dataclass(frozen=True)
class _Entry:
    key: str  # OpenCLIP name; per-layer names hold "{i}"
    path: tuple[str, ...]  # clip_jax path
    axes: tuple[int, ...] | None  # permutation from OpenCLIP's layout to ours
    layers: int = 0  # > 0: one OpenCLIP tensor per layer, stacked on a leading axis in clip_jax

    def open_clip_keys(self) -> list[str]:
        return [self.key.format(i=i) for i in range(self.layers)] if self.layers else [self.key]


def _norm_entries(key: str, path: tuple[str, ...], block: BlockConfig, layers: int = 0) -> list[_Entry]:
    """A LayerNorm's weight and bias, those the tower's norm_kwargs give it."""
    return ([_Entry(f"{key}.weight", path + ("scale",), _SAME, layers)] if block.norm_scale else []) + \
        ([_Entry(f"{key}.bias", path + ("bias",), _SAME, layers)] if block.norm_bias else [])


def _block_entries(prefix: str, path: tuple[str, ...], layers: int, block: BlockConfig) -> list[_Entry]:
    key = f"{prefix}transformer.resblocks.{{i}}."
    path = path + ("transformer", "resblocks")
    norm = lambda name, sub: _norm_entries(key + name, path + sub, block, layers)  # noqa: E731
    one = lambda name, sub, axes: [_Entry(key + name, path + sub, axes, layers)]  # noqa: E731
    return [
        *norm("ln_1", ("ln_1",)),
        *one("attn.in_proj_weight", ("attn", "in_proj", "kernel"), _LINEAR),
        *one("attn.in_proj_bias", ("attn", "in_proj", "bias"), _SAME),
        *(norm("attn.ln_q", ("attn", "ln_q")) + norm("attn.ln_k", ("attn", "ln_k")) if block.qk_norm else []),
        *(one("attn.logit_scale", ("attn", "logit_scale"), _SAME) if block.scaled_cosine_attn else []),
        *(one("attn.head_scale", ("attn", "head_scale"), _SAME) if block.scale_heads else []),
        *(norm("attn.ln_inner", ("attn", "ln_inner")) if block.scale_attn_inner else []),
        *one("attn.out_proj.weight", ("attn", "out_proj", "kernel"), _LINEAR),
        *one("attn.out_proj.bias", ("attn", "out_proj", "bias"), _SAME),
        *(norm("ln_attn", ("ln_attn",)) if block.scale_attn else []),
        *(one("ls_1.gamma", ("ls_1", "gamma"), _SAME) if block.ls_init_value is not None else []),
        *norm("ln_2", ("ln_2",)),
        *one("mlp.c_fc.weight", ("mlp", "c_fc", "kernel"), _LINEAR),
        *one("mlp.c_fc.bias", ("mlp", "c_fc", "bias"), _SAME),
        *(norm("mlp.ln", ("mlp", "ln")) if block.scale_fc else []),
        *one("mlp.c_proj.weight", ("mlp", "c_proj", "kernel"), _LINEAR),
        *one("mlp.c_proj.bias", ("mlp", "c_proj", "bias"), _SAME),
        *(one("ls_2.gamma", ("ls_2", "gamma"), _SAME) if block.ls_init_value is not None else []),
    ]


def _text_projection_entries(config: CLIPConfig, prefix: str) -> list[_Entry]:
    text = config.text
    if text.proj_bias:  # an nn.Linear in OpenCLIP, a Dense here
        return [_Entry(f"{prefix}text_projection.weight", ("text_projection", "kernel"), _LINEAR),
                _Entry(f"{prefix}text_projection.bias", ("text_projection", "bias"), _SAME)]
    if text.proj_type == "none":
        return []
    return [_Entry(f"{prefix}text_projection", ("text_projection",), _SAME)]


def _entries(config: CLIPConfig) -> list[_Entry]:
    v, vb, tb = ("visual",), config.vision.block, config.text.block
    t = "text." if config.custom_text else ""  # OpenCLIP's CustomTextCLIP keeps the text tower under `text.`
    return [
        _Entry("visual.conv1.weight", v + ("conv1", "kernel"), _CONV),
        _Entry("visual.class_embedding", v + ("class_embedding",), _SAME),
        _Entry("visual.positional_embedding", v + ("positional_embedding",), _SAME),
        *([] if config.vision.no_ln_pre else _norm_entries("visual.ln_pre", v + ("ln_pre",), vb)),
        *_block_entries("visual.", v, config.vision.layers, vb),
        *_norm_entries("visual.ln_post", v + ("ln_post",), vb),
        _Entry("visual.proj", v + ("proj",), _SAME),
        _Entry(f"{t}token_embedding.weight", ("token_embedding", "embedding"), _SAME),
        *([_Entry(f"{t}cls_emb", ("cls_emb",), _SAME)] if config.text.embed_cls else []),
        _Entry(f"{t}positional_embedding", ("positional_embedding",), _SAME),
        *_block_entries(t, (), config.text.layers, tb),
        *_norm_entries(f"{t}ln_final", ("ln_final",), tb),
        *_text_projection_entries(config, t),
        _Entry("logit_scale", ("logit_scale",), _SAME),
        *([_Entry("logit_bias", ("logit_bias",), _SAME)] if config.init_logit_bias is not None else []),
    ]


def _params_shapes(config: CLIPConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """clip_jax parameter shapes by path, traced abstractly (nothing is allocated)."""
    import jax

    from clip_jax.models.clip import create_model, param_shapes

    tree = param_shapes(create_model(config))
    return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _inverse(axes):
    return None if axes is None else tuple(int(a) for a in np.argsort(axes))


def _permute_shape(shape, axes):
    return tuple(shape) if axes is None else tuple(shape[a] for a in axes)


def open_clip_shapes(name_or_config) -> dict[str, tuple[int, ...]]:
    """The state_dict an OpenCLIP model of this config has: key -> shape."""
    config = get_model_config(name_or_config)
    ours = _params_shapes(config)
    shapes = {}
    for entry in _entries(config):
        shape = ours[entry.path][1:] if entry.layers else ours[entry.path]
        for key in entry.open_clip_keys():
            shapes[key] = _permute_shape(shape, _inverse(entry.axes))
    return shapes


def _describe_mismatch(config: CLIPConfig, missing, unexpected, misshaped, what: str) -> str:
    lines = [f"{what} does not match model {config.name!r}:"]
    for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped)):
        if items:
            shown = ", ".join(items[:12]) + (f", ... ({len(items) - 12} more)" if len(items) > 12 else "")
            lines.append(f"  {len(items)} {title}: {shown}")
    if any(item.startswith("logit_bias") for item in missing + unexpected):
        lines.append("  logit_bias is there when the model config sets init_logit_bias (a SigLIP model): give an "
                     "OpenCLIP model-config .json with or without it, as the checkpoint was trained.")
    lines.append("  Check --model (the checkpoint may be of another architecture) and that the file is a CLIP "
                 "state_dict.")
    return "\n".join(lines)


def _strip_prefix(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    if state_dict and all(k.startswith("module.") for k in state_dict):  # saved from DistributedDataParallel
        return {k[len("module."):]: v for k, v in state_dict.items()}
    return dict(state_dict)


def from_open_clip(state_dict: Mapping[str, Any], name_or_config, dtype=np.float32) -> dict:
    """clip_jax params (nested dict of numpy arrays in `dtype`; None keeps the checkpoint's dtypes) from an
    OpenCLIP state_dict whose values are numpy arrays. A `module.` prefix is accepted."""
    config = get_model_config(name_or_config)
    state_dict = {k: _scalar_head(k, v) for k, v in _strip_prefix(state_dict).items() if k not in _METADATA_KEYS}
    expected = open_clip_shapes(config)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    misshaped = [f"{k} {tuple(np.shape(state_dict[k]))} (expected {expected[k]})"
                 for k in expected if k in state_dict and tuple(np.shape(state_dict[k])) != expected[k]]
    if missing or unexpected or misshaped:
        raise InvalidInput(_describe_mismatch(config, missing, unexpected, misshaped, "OpenCLIP state_dict"))

    params: dict = {}
    for entry in _entries(config):
        layers = [np.asarray(state_dict[k]) for k in entry.open_clip_keys()]
        layers = [x if entry.axes is None else np.transpose(x, entry.axes) for x in layers]
        leaf = np.stack(layers) if entry.layers else layers[0]
        leaf = np.array(leaf, dtype=dtype, order="C")  # a copy; np.ascontiguousarray would turn () into (1,)
        node = params
        for name in entry.path[:-1]:
            node = node.setdefault(name, {})
        node[entry.path[-1]] = leaf
    return params


def _scalar_head(key: str, value):
    """OpenCLIP's `logit_scale` and `logit_bias` are scalars, or [1] in a model built with `nonscalar_logit_scale`
    (its loader reshapes either into the other): ours are scalars."""
    return np.reshape(value, ()) if key in ("logit_scale", "logit_bias") and np.shape(value) == (1,) else value


def _flatten(params, prefix=()) -> dict[tuple[str, ...], Any]:
    if isinstance(params, Mapping):
        out = {}
        for k, v in params.items():
            out.update(_flatten(v, prefix + (str(k),)))
        return out
    return {prefix: params}


def to_open_clip(params, name_or_config) -> dict[str, np.ndarray]:
    """An OpenCLIP state_dict (numpy values, the params' dtypes) from clip_jax params."""
    config = get_model_config(name_or_config)
    flat = {path: np.asarray(leaf) for path, leaf in _flatten(params).items()}
    expected = _params_shapes(config)
    missing = ["/".join(p) for p in expected if p not in flat]
    unexpected = ["/".join(p) for p in flat if p not in expected]
    misshaped = [f"{'/'.join(p)} {flat[p].shape} (expected {expected[p]})"
                 for p in expected if p in flat and flat[p].shape != expected[p]]
    if missing or unexpected or misshaped:
        raise InvalidInput(_describe_mismatch(config, missing, unexpected, misshaped, "clip_jax params"))

    state_dict = {}
    for entry in _entries(config):
        leaf = flat[entry.path]
        pieces = list(leaf) if entry.layers else [leaf]
        for key, piece in zip(entry.open_clip_keys(), pieces):
            piece = piece if entry.axes is None else np.transpose(piece, _inverse(entry.axes))
            state_dict[key] = np.array(piece, order="C")
    return state_dict


# ---------------------------------------------------------------------------------------------------------------
# Files


def save_params(path: str, params) -> None:
    """clip_jax params as an `.npz` of '/'-joined paths."""
    if not path.endswith(".npz"):
        raise InvalidInput(f"clip_jax params are written as .npz; got {path}")
    np.savez(path, **{"/".join(p): np.asarray(v) for p, v in _flatten(params).items()})


def load_params(path: str, name_or_config=None) -> dict:
    """clip_jax params from an `.npz` written by `save_params`, or converted on the fly from an OpenCLIP checkpoint
    (which needs `name_or_config`)."""
    arrays = read_arrays(path)
    if _is_clip_jax(arrays):
        params: dict = {}
        for key, value in arrays.items():
            *parents, leaf = key.split("/")
            node = params
            for name in parents:
                node = node.setdefault(name, {})
            node[leaf] = value
        if name_or_config is not None:
            to_open_clip(params, name_or_config)  # validates the tree against the model, naming any bad key
        return params
    if name_or_config is None:
        raise InvalidInput(f"{path} holds an OpenCLIP state_dict; pass the model name to convert it")
    return from_open_clip(arrays, name_or_config)


def _is_clip_jax(arrays: Mapping[str, Any]) -> bool:
    return any("/" in k for k in arrays)


def _torch_state_dict(path: str) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise SystemExit(f"reading {path} needs PyTorch (pip install torch); or convert it to .safetensors first") \
            from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except RuntimeError:  # OpenAI's original checkpoints are TorchScript archives
        obj = torch.jit.load(path, map_location="cpu").state_dict()
    if isinstance(obj, Mapping) and "state_dict" in obj:  # an OpenCLIP training checkpoint
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise InvalidInput(f"{path} does not hold a state_dict (found {type(obj).__name__})")
    return {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in obj.items()
            if isinstance(v, torch.Tensor)}


def read_arrays(path: str) -> dict[str, np.ndarray]:
    """Name -> array from a `.pt`/`.pth`/`.bin` (torch), `.safetensors` or `.npz` file."""
    if not os.path.exists(path):
        raise MissingInput(f"checkpoint {path} does not exist")
    if path.endswith((".pt", ".pth", ".bin")):
        return _torch_state_dict(path)
    if path.endswith(".safetensors"):
        from safetensors.numpy import load_file

        return load_file(path)
    if path.endswith(".npz"):
        with np.load(path) as f:
            return {k: f[k] for k in f.files}
    raise InvalidInput(f"unknown checkpoint format {path}: expected .pt, .pth, .bin, .safetensors or .npz")


def write_open_clip(path: str, state_dict: Mapping[str, np.ndarray]) -> None:
    if path.endswith(".safetensors"):
        from safetensors.numpy import save_file

        save_file(dict(state_dict), path)
    elif path.endswith(".npz"):
        np.savez(path, **state_dict)
    elif path.endswith((".pt", ".pth", ".bin")):
        import torch

        torch.save({k: torch.from_numpy(np.array(v, order="C")) for k, v in state_dict.items()}, path)
    else:
        raise InvalidInput(f"unknown output format {path}: expected .safetensors, .npz, .pt, .pth or .bin")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clip_jax.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="OpenCLIP checkpoint (.pt/.pth/.bin/.safetensors/.npz) or clip_jax params .npz")
    parser.add_argument("dst", help="clip_jax params (.npz), or an OpenCLIP state_dict when SRC is clip_jax params")
    parser.add_argument("--model", required=True, help="model name (e.g. ViT-L-14) or OpenCLIP model-config .json")
    args = parser.parse_args(argv)
    try:
        arrays = read_arrays(args.src)
        if _is_clip_jax(arrays):
            write_open_clip(args.dst, to_open_clip(load_params(args.src), args.model))
            direction = "clip_jax -> OpenCLIP"
        else:
            save_params(args.dst, from_open_clip(arrays, args.model))
            direction = "OpenCLIP -> clip_jax"
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{direction}: {args.src} -> {args.dst} ({args.model})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
