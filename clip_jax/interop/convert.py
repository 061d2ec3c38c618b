"""OpenCLIP state_dict <-> clip_jax weights.

`from_open_clip(state_dict, model)` turns an OpenCLIP state_dict (numpy values) into clip_jax params;
`to_open_clip(params, model)` goes back. Both are exact: transposes and stacking only. A model with a ResNet image
tower also has BatchNorm statistics (`running_mean`, `running_var`, `num_batches_tracked`), which clip_jax keeps in
the `batch_stats` collection beside `params`: `variables_from_open_clip` / `variables_to_open_clip` convert both
collections (and work for any model). A tree or state_dict of another model is refused, naming the keys and shapes.
Reading and writing the files, and the `python -m clip_jax.convert` command: `clip_jax.interop.weight_files`.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from clip_jax.errors import InvalidInput
from clip_jax.models.config import BlockConfig, CLIPConfig, is_resnet
from clip_jax.models.registry import get_model_config

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
    collection: str = "params"  # the Flax variable collection the leaf lives in
    leading: int = 0  # OpenCLIP's tensor has this many more leading axes of size 1 (timm's [1, N, W] pos_embed)

    @property
    def full_path(self) -> tuple[str, ...]:
        return (self.collection,) + self.path

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


def _batch_norm_entries(key: str, path: tuple[str, ...]) -> list[_Entry]:
    """A BatchNorm2d: its affine params, and its running statistics in the `batch_stats` collection."""
    return [_Entry(f"{key}.weight", path + ("scale",), _SAME), _Entry(f"{key}.bias", path + ("bias",), _SAME),
            *(_Entry(f"{key}.{name}", path + (ours,), _SAME, collection="batch_stats")
              for name, ours in (("running_mean", "mean"), ("running_var", "var"),
                                 ("num_batches_tracked", "num_batches_tracked")))]


def _resnet_entries(config: CLIPConfig) -> list[_Entry]:
    """OpenCLIP's ModifiedResNet: stem, `layer{1-4}.{i}` bottlenecks (the first of each with a `downsample`
    shortcut: every stage changes the width), attention pool."""
    v = ("visual",)
    conv = lambda key, path: _Entry(f"{key}.weight", path + ("kernel",), _CONV)  # noqa: E731
    entries = []
    for i in (1, 2, 3):
        entries += [conv(f"visual.conv{i}", v + (f"conv{i}",)), *_batch_norm_entries(f"visual.bn{i}", v + (f"bn{i}",))]
    for stage, blocks in enumerate(config.vision.layers, start=1):
        for block in range(blocks):
            key, path = f"visual.layer{stage}.{block}", v + (f"layer{stage}", str(block))
            for i in (1, 2, 3):
                entries += [conv(f"{key}.conv{i}", path + (f"conv{i}",)),
                            *_batch_norm_entries(f"{key}.bn{i}", path + (f"bn{i}",))]
            if block == 0:
                entries += [conv(f"{key}.downsample.0", path + ("downsample_conv",)),
                            *_batch_norm_entries(f"{key}.downsample.1", path + ("downsample_bn",))]
    pool, pool_path = "visual.attnpool", v + ("attnpool",)
    entries.append(_Entry(f"{pool}.positional_embedding", pool_path + ("positional_embedding",), _SAME))
    for proj in ("q_proj", "k_proj", "v_proj", "c_proj"):
        entries += [_Entry(f"{pool}.{proj}.weight", pool_path + (proj, "kernel"), _LINEAR),
                    _Entry(f"{pool}.{proj}.bias", pool_path + (proj, "bias"), _SAME)]
    return entries


def _vit_entries(config: CLIPConfig) -> list[_Entry]:
    v, vb = ("visual",), config.vision.block
    return [
        _Entry("visual.conv1.weight", v + ("conv1", "kernel"), _CONV),
        _Entry("visual.class_embedding", v + ("class_embedding",), _SAME),
        _Entry("visual.positional_embedding", v + ("positional_embedding",), _SAME),
        *([] if config.vision.no_ln_pre else _norm_entries("visual.ln_pre", v + ("ln_pre",), vb)),
        *_block_entries("visual.", v, config.vision.layers, vb),
        *_norm_entries("visual.ln_post", v + ("ln_post",), vb),
        _Entry("visual.proj", v + ("proj",), _SAME),
    ]


def _timm_siglip_entries(config: CLIPConfig) -> list[_Entry]:
    """SigLIP's image tower as OpenCLIP holds it: timm's VisionTransformer under `visual.trunk.`."""
    v, vb, layers = ("visual",), config.vision.block, config.vision.layers
    trunk, blocks = "visual.trunk.", v + ("transformer", "resblocks")
    linear = lambda key, path, n=0: [_Entry(f"{key}.weight", path + ("kernel",), _LINEAR, n),  # noqa: E731
                                     _Entry(f"{key}.bias", path + ("bias",), _SAME, n)]
    block = f"{trunk}blocks.{{i}}."
    pool, pool_path = f"{trunk}attn_pool.", v + ("attn_pool",)
    return [
        _Entry(f"{trunk}patch_embed.proj.weight", v + ("conv1", "kernel"), _CONV),
        _Entry(f"{trunk}patch_embed.proj.bias", v + ("conv1", "bias"), _SAME),
        _Entry(f"{trunk}pos_embed", v + ("positional_embedding",), _SAME, leading=1),
        *([] if config.vision.no_ln_pre else _norm_entries(f"{trunk}norm_pre", v + ("ln_pre",), vb)),
        *_norm_entries(block + "norm1", blocks + ("ln_1",), vb, layers),
        *linear(block + "attn.qkv", blocks + ("attn", "in_proj"), layers),
        *linear(block + "attn.proj", blocks + ("attn", "out_proj"), layers),
        *_norm_entries(block + "norm2", blocks + ("ln_2",), vb, layers),
        *linear(block + "mlp.fc1", blocks + ("mlp", "c_fc"), layers),
        *linear(block + "mlp.fc2", blocks + ("mlp", "c_proj"), layers),
        *_norm_entries(f"{trunk}norm", v + ("ln_post",), vb),
        _Entry(f"{pool}latent", pool_path + ("probe",), _SAME, leading=1),
        *linear(f"{pool}q", pool_path + ("q",)),
        *linear(f"{pool}kv", pool_path + ("kv",)),
        *linear(f"{pool}proj", pool_path + ("out_proj",)),
        *_norm_entries(f"{pool}norm", pool_path + ("norm",), vb),
        *linear(f"{pool}mlp.fc1", pool_path + ("mlp", "c_fc")),
        *linear(f"{pool}mlp.fc2", pool_path + ("mlp", "c_proj")),
    ]


def _image_entries(config: CLIPConfig) -> list[_Entry]:
    if is_resnet(config):
        return _resnet_entries(config)
    return _timm_siglip_entries(config) if config.vision.attention_pool else _vit_entries(config)


def _entries(config: CLIPConfig) -> list[_Entry]:
    tb = config.text.block
    t = "text." if config.custom_text else ""  # OpenCLIP's CustomTextCLIP keeps the text tower under `text.`
    return [
        *_image_entries(config),
        _Entry(f"{t}token_embedding.weight", ("token_embedding", "embedding"), _SAME),
        *([_Entry(f"{t}cls_emb", ("cls_emb",), _SAME)] if config.text.embed_cls else []),
        _Entry(f"{t}positional_embedding", ("positional_embedding",), _SAME),
        *_block_entries(t, (), config.text.layers, tb),
        *_norm_entries(f"{t}ln_final", ("ln_final",), tb),
        *_text_projection_entries(config, t),
        _Entry("logit_scale", ("logit_scale",), _SAME),
        *([_Entry("logit_bias", ("logit_bias",), _SAME)] if config.init_logit_bias is not None else []),
    ]


def _variable_shapes(config: CLIPConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """clip_jax variable shapes by path, the collection first (`params`, `batch_stats`), traced abstractly
    (nothing is allocated)."""
    import jax

    from clip_jax.models.clip import create_model, init_variables

    model = create_model(config)
    tree = jax.eval_shape(lambda rng: init_variables(model, rng), jax.random.key(0))
    return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _inverse(axes):
    return None if axes is None else tuple(int(a) for a in np.argsort(axes))


def _permute_shape(shape, axes):
    return tuple(shape) if axes is None else tuple(shape[a] for a in axes)


def open_clip_shapes(name_or_config) -> dict[str, tuple[int, ...]]:
    """The state_dict an OpenCLIP model of this config has: key -> shape."""
    config = get_model_config(name_or_config)
    ours = _variable_shapes(config)
    shapes = {}
    for entry in _entries(config):
        shape = ours[entry.full_path][1:] if entry.layers else ours[entry.full_path]
        for key in entry.open_clip_keys():
            shapes[key] = (1,) * entry.leading + _permute_shape(shape, _inverse(entry.axes))
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
    OpenCLIP state_dict whose values are numpy arrays. A `module.` prefix is accepted. A ResNet model has
    BatchNorm statistics besides its params: `variables_from_open_clip` converts both."""
    config = get_model_config(name_or_config)
    _refuse_resnet(config, "from_open_clip", "variables_from_open_clip")
    return variables_from_open_clip(state_dict, config, dtype)["params"]


def _refuse_resnet(config: CLIPConfig, what: str, instead: str) -> None:
    if is_resnet(config):
        raise InvalidInput(f"{config.name} has a ResNet image tower, whose BatchNorm statistics are not params: "
                           f"{what} converts params only; use {instead} (both collections)")


def variables_from_open_clip(state_dict: Mapping[str, Any], name_or_config, dtype=np.float32) -> dict:
    """clip_jax variables from an OpenCLIP state_dict (numpy values): `{"params": ...}`, and `"batch_stats"` (each
    BatchNorm's `mean`, `var` and `num_batches_tracked`, the last int32) for a ResNet image tower. Floating leaves
    are cast to `dtype` (None keeps the checkpoint's dtypes); a `module.` prefix is accepted."""
    config = get_model_config(name_or_config)
    state_dict = {k: _scalar_head(k, v) for k, v in _strip_prefix(state_dict).items() if k not in _METADATA_KEYS}
    expected = open_clip_shapes(config)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    misshaped = [f"{k} {tuple(np.shape(state_dict[k]))} (expected {expected[k]})"
                 for k in expected if k in state_dict and tuple(np.shape(state_dict[k])) != expected[k]]
    if missing or unexpected or misshaped:
        raise InvalidInput(_describe_mismatch(config, missing, unexpected, misshaped, "OpenCLIP state_dict"))

    variables: dict = {}
    for entry in _entries(config):
        layers = [np.asarray(state_dict[k]) for k in entry.open_clip_keys()]
        layers = [x.reshape(x.shape[entry.leading:]) for x in layers]
        layers = [x if entry.axes is None else np.transpose(x, entry.axes) for x in layers]
        leaf = np.stack(layers) if entry.layers else layers[0]
        if np.issubdtype(leaf.dtype, np.integer):  # a BatchNorm's update counter (int64 in torch)
            leaf = np.array(leaf, dtype=np.int32)
        else:
            leaf = np.array(leaf, dtype=dtype, order="C")  # a copy; np.ascontiguousarray would turn () into (1,)
        node = variables
        for name in entry.full_path[:-1]:
            node = node.setdefault(name, {})
        node[entry.full_path[-1]] = leaf
    return variables


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
    """An OpenCLIP state_dict (numpy values, the params' dtypes) from clip_jax params (of a ViT model; a ResNet
    model's BatchNorm statistics need `variables_to_open_clip`)."""
    config = get_model_config(name_or_config)
    _refuse_resnet(config, "to_open_clip", "variables_to_open_clip")
    return variables_to_open_clip({"params": params}, config)


def variables_to_open_clip(variables, name_or_config) -> dict[str, np.ndarray]:
    """An OpenCLIP state_dict (numpy values) from clip_jax variables (`params`, and `batch_stats` for a ResNet image
    tower): the leaves' dtypes, but `num_batches_tracked` int64 as torch keeps it."""
    config = get_model_config(name_or_config)
    flat = {path: np.asarray(leaf) for path, leaf in _flatten(variables).items()}
    expected = _variable_shapes(config)
    # a ViT model has params only: its paths are named as in the params tree
    show = (lambda p: "/".join(p)) if is_resnet(config) else (lambda p: "/".join(p[1:] if p[0] == "params" else p))
    missing = [show(p) for p in expected if p not in flat]
    unexpected = [show(p) for p in flat if p not in expected]
    misshaped = [f"{show(p)} {flat[p].shape} (expected {expected[p]})"
                 for p in expected if p in flat and flat[p].shape != expected[p]]
    if missing or unexpected or misshaped:
        what = "clip_jax variables" if is_resnet(config) else "clip_jax params"
        raise InvalidInput(_describe_mismatch(config, missing, unexpected, misshaped, what))

    state_dict = {}
    for entry in _entries(config):
        leaf = flat[entry.full_path]
        pieces = list(leaf) if entry.layers else [leaf]
        for key, piece in zip(entry.open_clip_keys(), pieces):
            piece = piece if entry.axes is None else np.transpose(piece, _inverse(entry.axes))
            piece = piece.reshape((1,) * entry.leading + piece.shape)
            state_dict[key] = np.array(piece, dtype=np.int64 if np.issubdtype(piece.dtype, np.integer) else None,
                                       order="C")
    return state_dict
