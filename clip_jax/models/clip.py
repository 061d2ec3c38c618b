"""The two-tower CLIP model, with the text tower at the top of the parameter tree as in OpenCLIP's state_dict."""

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from clip_jax.errors import InvalidInput
from clip_jax.models.config import CLIPConfig, is_resnet
from clip_jax.models import mixed_precision, naflex
from clip_jax.models.fused_layer_norm import FUSED_KERNELS
from clip_jax.models.attention import ATTENTION_IMPLS
from clip_jax.models.layers import Dense, Dtype, Transformer, tower_norm
from clip_jax.models.remat import resolve_remat_policy
from clip_jax.models.registry import get_model_config
from clip_jax.models.resnet import ModifiedResNet
from clip_jax.models.vit import VisionTransformer


def l2_normalize(x):
    """Unit rows in float32 (a zero row stays zero rather than becoming NaN)."""
    x = x.astype(jnp.float32)
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def pool_text(x, tokens, pool_type: str, eos_id: int):
    """[B, L, W] -> [B, W], the token OpenCLIP's `text_pool_type` picks: "argmax" the largest id (OpenAI's EOT),
    "eos" the first `eos_id` (position 0 when a row has none), "first" / "last" a fixed position."""
    if pool_type == "first":
        return x[:, 0]
    if pool_type == "last":
        return x[:, -1]
    index = jnp.argmax(tokens, axis=-1) if pool_type == "argmax" else jnp.argmax(tokens == eos_id, axis=-1)  # [B]
    # take_along_axis keeps the batch a batch dimension of the gather, so it stays split over devices
    # (indexing x[arange(B), index] makes every device build, and all-reduce, the whole [B_global, W]).
    return jnp.take_along_axis(x, index[:, None, None], axis=1)[:, 0]


def embed_cls_mask(tokens, pad_id: int):
    """[B, 1, L + 1, L + 1] bool, True where a query may see a key, for a text tower with its class embedding
    appended: OpenCLIP 3.3.0's key mask, which (in its default, legacy order) lets key 0 through always and masks
    key j > 0 when token j - 1 is padding; the class token itself, at position L, is masked exactly when the last
    token is padding."""
    valid = tokens != pad_id  # [B, L]
    keys = jnp.concatenate([jnp.ones_like(valid[:, :1]), valid], axis=1)  # [B, L + 1]
    return jnp.broadcast_to(keys[:, None, None, :], (tokens.shape[0], 1, keys.shape[1], keys.shape[1]))


class TokenEmbedding(nn.Module):
    """`flax.linen.Embed`'s parameter (`embedding` [vocab, width]) and lookup, its gradient in `grad_dtype`."""

    vocab_size: int
    width: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    grad_dtype: Dtype | None = None

    @nn.compact
    def __call__(self, tokens):  # [B, L] int -> [B, L, width]
        table = self.param("embedding", nn.initializers.normal(0.02), (self.vocab_size, self.width), self.param_dtype)
        return mixed_precision.embed(table, tokens, self.dtype, self.grad_dtype)


class CLIP(nn.Module):
    """`apply({"params": p}, images, tokens) -> (image_features, text_features, exp(logit_scale))`, features
    L2-normalised in float32, and `logit_bias` after them when the config has `init_logit_bias` (a SigLIP model,
    as OpenCLIP's forward returns it). `method="encode_image"` / `"encode_text"` run one tower.

    `layer_params_hook`: see `Transformer`; passed to both towers' residual stacks (None: parameters as stored).
    `kept_patches` ([B, K] patch indices, the train step's patch dropout; see `VisionTransformer`): None runs
    every patch, as eval does.
    """

    config: CLIPConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    remat_policy: str = "none"
    attention_impl: str | None = None
    layer_params_hook: Callable | None = None
    grad_dtype: Dtype | None = None  # parameter gradients computed and summed in this dtype (see `mixed_precision`)
    residual_dtype: Dtype | None = None  # the residual stream's dtype in both towers (None: the compute dtype)
    fp8: bool = False  # both towers' residual blocks' matmuls in FP8 (`mixed_precision.fp8_dense`)
    fused_kernels: str = "off"  # both towers' residual adds and LayerNorms as Pallas kernels (see `Transformer`)
    unroll_layers: bool = False  # both towers' block stacks unrolled (see `Transformer`)

    def setup(self):
        cfg, text = self.config, self.config.text
        if is_resnet(cfg):  # its BatchNorm statistics are the `batch_stats` collection
            self.visual = ModifiedResNet(cfg.vision, cfg.embed_dim, self.dtype, self.param_dtype, self.remat_policy)
        else:
            self.visual = VisionTransformer(cfg.vision, cfg.embed_dim, cfg.quick_gelu, self.dtype,
                                            self.param_dtype, self.remat_policy, self.attention_impl,
                                            self.layer_params_hook, self.grad_dtype, self.residual_dtype, self.fp8,
                                            self.fused_kernels, self.unroll_layers)
        self.token_embedding = TokenEmbedding(text.vocab_size, text.width, self.dtype, self.param_dtype,
                                              self.grad_dtype)
        if text.embed_cls:
            self.cls_emb = self.param("cls_emb", nn.initializers.normal(0.01), (text.width,), self.param_dtype)
        self.positional_embedding = self.param("positional_embedding", nn.initializers.normal(0.01),
                                               (text.num_tokens, text.width), self.param_dtype)
        self.transformer = Transformer(text.width, text.layers, text.heads, text.mlp_width,
                                       causal=not text.no_causal_mask, quick_gelu=cfg.quick_gelu, dtype=self.dtype,
                                       param_dtype=self.param_dtype, remat_policy=self.remat_policy,
                                       attention_impl=self.attention_impl, layer_params_hook=self.layer_params_hook,
                                       block=text.block, grad_dtype=self.grad_dtype,
                                       residual_dtype=self.residual_dtype, fp8=self.fp8,
                                       fused_kernels=self.fused_kernels, unroll_layers=self.unroll_layers)
        self.ln_final = tower_norm(text.block, self.dtype, self.param_dtype)
        if text.proj_bias:
            self.text_projection = Dense(cfg.embed_dim, nn.initializers.normal(text.width**-0.5), self.dtype,
                                         self.param_dtype, self.grad_dtype)
        elif text.proj_type != "none":
            self.text_projection = self.param("text_projection", nn.initializers.normal(text.width**-0.5),
                                              (text.width, cfg.embed_dim), self.param_dtype)
        self.logit_scale = self.param("logit_scale", nn.initializers.constant(cfg.init_logit_scale), (),
                                      self.param_dtype)
        if cfg.init_logit_bias is not None:
            self.logit_bias = self.param("logit_bias", nn.initializers.constant(cfg.init_logit_bias), (),
                                         self.param_dtype)

    def encode_image(self, images, normalize: bool = True, kept_patches=None, train: bool = False):
        """[B, H, W, 3] -> [B, E]; a NaFlex tower (`VisionConfig.naflex`) takes NaFlex rows [B, N, P * P * 3 + 2]
        (`clip_jax.models.naflex`) instead, any budget N. `train`: a ResNet tower's BatchNorm runs on batch
        statistics (and updates the running ones when `batch_stats` is mutable); a ViT has no train-only path
        here."""
        features = self.visual(images, kept_patches, train) if is_resnet(self.config) else \
            self.visual(images, kept_patches)
        return l2_normalize(features) if normalize else features.astype(jnp.float32)

    def encode_text(self, tokens, normalize: bool = True):  # [B, L] int -> [B, E]
        features, _ = self._text(tokens, emit_states=False)
        return l2_normalize(features) if normalize else features.astype(jnp.float32)

    def encode_text_states(self, tokens, final_norm: bool = False, after_block: int | None = None):
        """(states, embedding) of tokens [B, L]: the text tower's residual stream per token, float32
        [layers + 1, B, L, W] (states[0] entering the first block, states[k] leaving block k: transformers'
        `hidden_states` order), with `final_norm` ln_final applied to each (OpenCLIP's normalize_intermediates); or
        `after_block`'s alone [B, L, W]. `embedding`: the pooled, projected text embedding [B, E], not normalised.
        Stable Diffusion 2's conditioning is `after_block=layers - 1, final_norm=True`; SDXL's, the same block
        without the norm, beside the embedding."""
        features, (states, normed) = self._text(tokens, emit_states=True)
        return (_block_states(normed if final_norm else states, after_block, "text", self.config.text.layers),
                features.astype(jnp.float32))

    def encode_image_states(self, images, final_norm: bool = False, after_block: int | None = None):
        """(states, embedding) of images [B, H, W, 3], as `encode_text_states` for the image tower: states[0] after
        ln_pre, each with ln_post under `final_norm`, [layers + 1, B, T, W] (T: the class token, then the patches
        in row-major order; a NaFlex tower's: its N rows, padding included), or `after_block`'s alone; the embedding
        [B, E], not normalised. ViT towers only."""
        if is_resnet(self.config):
            raise ValueError("a ResNet image tower has no per-token states: encode_image_states takes a ViT tower")
        features, states, normed = self.visual(images, emit_states=True)
        return (_block_states(normed if final_norm else states, after_block, "image", self.config.vision.layers),
                features.astype(jnp.float32))

    def _text(self, tokens, emit_states: bool):
        """(features [B, E] in the compute dtype; with `emit_states`, (states, states under ln_final))."""
        context_length = self.config.text.context_length
        if tokens.ndim != 2 or tokens.shape[1] != context_length:
            raise ValueError(f"text tower expects tokens of shape [B, {context_length}], got {tuple(tokens.shape)}")
        text = self.config.text
        x = self.token_embedding(tokens)  # [B, L, W]
        mask = None
        if text.embed_cls:  # CoCa's class embedding after the tokens, and OpenCLIP's key mask for padding
            cls = mixed_precision.broadcast(self.cls_emb, (x.shape[0], 1, text.width), self.dtype, self.grad_dtype)
            x = jnp.concatenate([x, cls], axis=1)  # [B, L + 1, W]
            mask = embed_cls_mask(tokens, text.pad_id)
        x = mixed_precision.add(x, self.positional_embedding, self.grad_dtype)
        entering = x
        x = self.transformer(x, mask, emit_states=emit_states)
        x, states = x if emit_states else (x, None)
        if text.embed_cls:  # the class token, whatever pool_type says, normalised after pooling
            x = self.ln_final(x[:, -1])  # [B, W]
        elif text.final_ln_after_pool:
            x = self.ln_final(pool_text(x, tokens, text.pool_type, text.eos_id))
        else:
            x = pool_text(self.ln_final(x), tokens, text.pool_type, text.eos_id)  # [B, W]
        if text.proj_bias:
            features = self.text_projection(x)
        elif text.proj_type == "none":
            features = x
        else:
            features = mixed_precision.dense(x, self.text_projection, None, self.dtype, self.grad_dtype)
        if not emit_states:
            return features, None
        states = jnp.concatenate([entering[None].astype(states.dtype), states])
        return features, (states, self.ln_final(states))

    def __call__(self, images, tokens, kept_patches=None, train: bool = False):
        outputs = (self.encode_image(images, kept_patches=kept_patches, train=train), self.encode_text(tokens),
                   jnp.exp(self.logit_scale.astype(jnp.float32)))
        if self.config.init_logit_bias is None:
            return outputs
        return (*outputs, self.logit_bias.astype(jnp.float32))


def _block_states(states, after_block: int | None, tower: str, layers: int):
    """Every block's states float32 [layers + 1, ...], or those after block `after_block` (0: entering block 1)."""
    if after_block is None:
        return states.astype(jnp.float32)
    if not isinstance(after_block, int) or not -layers - 1 <= after_block <= layers:
        raise ValueError(f"after_block={after_block!r}: the {tower} tower has {layers} blocks; give 0 (entering the "
                         f"first) to {layers} (leaving the last), or -1 for the last")
    return states[after_block].astype(jnp.float32)


def create_model(name_or_config: "str | Mapping[str, Any] | CLIPConfig", *, dtype: Dtype = jnp.float32,
                 param_dtype: Dtype = jnp.float32, remat_policy: str = "none",
                 attention_impl: str | None = None, grad_dtype: Dtype | None = None,
                 residual_dtype: Dtype | None = None, fp8: bool = False, fused_kernels: str = "off",
                 unroll_layers: bool = False) -> CLIP:
    """A CLIP module for a registered name, an OpenCLIP model-config dict or .json path, or a `CLIPConfig`.

    `dtype` is the compute dtype; `param_dtype` the dtype of stored parameters. Neither changes the parameter tree,
    so one checkpoint runs under any of them. `remat_policy` names a `jax.checkpoint_policies` policy applied to
    every residual block ("none" keeps all activations); `attention_impl` is passed to
    `jax.nn.dot_product_attention` (None lets JAX choose, "cudnn" asks for cuDNN's fused attention on GPU). Every
    tower option keeps the fused kernel but one: a text tower with `embed_cls` masks padding keys, a mask the fused
    kernel does not take, so its attention runs XLA's whatever is asked (see `attention.attention`). `grad_dtype`:
    the dtype parameter gradients are computed and summed over the batch in (`mixed_precision`; None: autodiff's,
    the compute dtype). `residual_dtype`: the residual stream's through the blocks (None: the compute dtype).
    `fp8`: the residual blocks' four matmuls in FP8 (the `fp8` precision policy). `fused_kernels`: "pallas" runs
    the residual blocks' adds and LayerNorms as Pallas kernels for a GPU (`fused_layer_norm`; off by default until a
    GPU has timed them), "pallas_interpret" the same kernels through Pallas's interpreter, "off" XLA's fusions.
    `unroll_layers`: both towers' residual blocks compiled one after another instead of as a loop (the same
    parameters and results; fewer memory-bound passes, a larger program: see `Transformer`).
    """
    config = get_model_config(name_or_config)
    resolve_remat_policy(remat_policy)  # fail on a bad name now, not at the first trace
    if attention_impl not in ATTENTION_IMPLS:
        raise InvalidInput(f"unknown attention_impl {attention_impl!r}; choose one of {ATTENTION_IMPLS}")
    if fused_kernels not in FUSED_KERNELS:
        raise InvalidInput(f"unknown fused_kernels {fused_kernels!r}; choose one of {FUSED_KERNELS}")
    as_dtype = lambda d: None if d is None else jnp.dtype(d)  # noqa: E731
    return CLIP(config, jnp.dtype(dtype), jnp.dtype(param_dtype), remat_policy, attention_impl,
                grad_dtype=as_dtype(grad_dtype), residual_dtype=as_dtype(residual_dtype), fp8=fp8,
                fused_kernels=fused_kernels, unroll_layers=unroll_layers)


def dummy_inputs(config: CLIPConfig, batch_size: int = 1):
    """Zero images and tokens of the shapes the model expects (a NaFlex tower's: zero images of its square grid,
    as NaFlex rows under a budget of that grid)."""
    v, t = config.vision, config.text
    tokens = jnp.zeros((batch_size, t.context_length), jnp.int32)
    if not is_resnet(config) and v.naflex:
        return jnp.asarray(naflex.blank_rows(batch_size, v.patch_size, (v.grid_size,) * 2, v.grid_size**2)), tokens
    return jnp.zeros((batch_size, v.image_size, v.image_size, 3), jnp.float32), tokens


def init_params(model: CLIP, rng: jax.Array) -> dict:
    """Freshly initialised parameters (leaves in the model's `param_dtype`)."""
    return init_variables(model, rng)["params"]


def init_variables(model: CLIP, rng: jax.Array) -> dict:
    """Every variable collection of a fresh model: `params`, and `batch_stats` (BatchNorm's running statistics)
    for a ResNet image tower; what `model.apply` takes."""
    return dict(jax.jit(model.init)(rng, *dummy_inputs(model.config)))


def param_shapes(model: CLIP) -> dict:
    """The parameter tree as `jax.ShapeDtypeStruct`s: nothing is computed or allocated."""
    return jax.eval_shape(lambda rng: init_params(model, rng), jax.random.key(0))


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
