"""Attention padded to a kernel-friendly length: cuDNN's fused attention needs lengths that are multiples of 8, and
ViT-L/14 (257 tokens) and the text tower (77) have none. The padding must change nothing: checked here with XLA's
attention, on the CPU, against the unpadded computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clip_jax.models.attention import CUDNN_SEQ_MULTIPLE, attention, choose_attention_impl


def _qkv(length: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(key, (2, length, 4, 16), jnp.float32) for key in keys]  # [B, T, N, H]


def _loss(q, k, v, causal, pad_to_multiple):
    out = attention(q, k, v, causal, "xla", pad_to_multiple)
    return jnp.sum(jnp.sin(out))  # a non-linear read of every output, so every gradient entry matters


@pytest.mark.slow
@pytest.mark.parametrize("causal,length", [(False, 257), (True, 77), (False, 5), (True, 9)])
@pytest.mark.parametrize("multiple", [CUDNN_SEQ_MULTIPLE, 64])
def test_padded_attention_equals_unpadded_in_value_and_gradients(causal, length, multiple):
    assert length % multiple  # the padded path is really taken
    q, k, v = _qkv(length)
    np.testing.assert_allclose(attention(q, k, v, causal, "xla", multiple), attention(q, k, v, causal, "xla", 1),
                               atol=2e-6)
    grads = jax.grad(_loss, argnums=(0, 1, 2))
    for padded, plain in zip(grads(q, k, v, causal, multiple), grads(q, k, v, causal, 1)):
        np.testing.assert_allclose(padded, plain, atol=1e-5)


@pytest.mark.slow
def test_unpadded_attention_matches_a_float64_reference():
    q, k, v = _qkv(6, seed=1)
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("bqnh,bknh->bnqk", q64, k64) / np.sqrt(q.shape[-1])
    scores = np.where(np.tril(np.ones((6, 6), bool)), scores, -np.inf)  # causal
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = np.einsum("bnqk,bknh->bqnh", weights, v64)
    np.testing.assert_allclose(attention(q, k, v, True, "xla", CUDNN_SEQ_MULTIPLE), expected, atol=1e-5)


def test_only_cudnn_pads_by_default():
    q, k, v = _qkv(5)
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: attention(q, k, v, False, "xla"))(q, k, v))
    assert "pad" not in jaxpr


def test_auto_attention_is_cudnn_on_a_gpu_in_16_bits_and_xla_elsewhere():
    assert choose_attention_impl("auto", "gpu", jnp.bfloat16) == "cudnn"
    assert choose_attention_impl("auto", "gpu", jnp.float16) == "cudnn"
    assert choose_attention_impl("auto", "gpu", jnp.float32) == "xla"  # cuDNN's kernel takes no float32
    assert choose_attention_impl("auto", "gpu", jnp.float16, (8, 0)) == "cudnn"
    assert choose_attention_impl("auto", "gpu", jnp.float16, (7, 5)) == "xla"  # a T4: no fused kernel before Ampere
    assert choose_attention_impl("auto", "cpu", jnp.bfloat16) == "xla"
    assert choose_attention_impl("cudnn", "cpu", jnp.float32) == "cudnn"  # what is asked for explicitly, as is
    with pytest.raises(ValueError, match=r"attention_impl='flash': choose one of \('auto', 'xla', 'cudnn'\)"):
        choose_attention_impl("flash", "gpu", jnp.bfloat16)
