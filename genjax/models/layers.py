"""Layers shared by the built-in architectures: activations, norms, embeddings, attention.

Every layer computes in the model dtype and follows transformers' numerics where they matter:
norms reduce in float32, attention softmax runs in float32, and scores are scaled after the
``Q K^T`` product. Parameter names follow flax (``kernel``, ``bias``, ``scale``, ``embedding``)
so that a parameter path maps to an HF state-dict name mechanically (see ``loading.py``).

Shapes use the axis letters of :mod:`genjax.typing`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from genjax.errors import UnsupportedError
from genjax.typing import Array


def _gelu_tanh(x: Array) -> Array:
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _gelu_fast(x: Array) -> Array:
    return 0.5 * x * (1.0 + jnp.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _gelu_exact(x: Array) -> Array:
    return jax.nn.gelu(x, approximate=False)


# The transformers ``ACT2FN`` names whose math genjax reproduces exactly.
ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu": _gelu_exact,
    "gelu_python": _gelu_exact,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_python_tanh": _gelu_tanh,
    "gelu_fast": _gelu_fast,
    "gelu_10": lambda x: jnp.clip(_gelu_exact(x), -10.0, 10.0),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
    "relu6": jax.nn.relu6,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "linear": lambda x: x,
}


def check_activation(name: str, key: str) -> str:
    """Returns ``name`` if genjax implements it, else raises naming the config key."""
    if name not in ACTIVATIONS:
        raise UnsupportedError(
            f"{key}={name!r} is not supported; supported activations: {', '.join(ACTIVATIONS)}."
        )
    return name


class RMSNorm(nn.Module):
    """Root-mean-square norm (Llama): reduces in float32, scales in the model dtype."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * normed.astype(self.dtype)


class LayerNorm(nn.Module):
    """Layer norm with bias (GPT-2): statistics in float32, output in the model dtype."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: Array) -> Array:
        width = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (width,), self.dtype)
        bias = self.param("bias", nn.initializers.zeros, (width,), self.dtype)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        normed = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


class Embed(nn.Module):
    """A lookup table ``embedding`` dtype[num, D]; indices are clipped into range.

    Clipping keeps out-of-range ids (say, position ids of padding) finite: a NaN in a padding
    slot's key or value would reach real tokens through ``0 * NaN`` in attention.
    """

    num_embeddings: int
    features: int
    dtype: jnp.dtype

    def setup(self):
        self.embedding = self.param(
            "embedding",
            nn.initializers.normal(stddev=0.02),
            (self.num_embeddings, self.features),
            self.dtype,
        )

    def __call__(self, ids: Array) -> Array:
        """Returns dtype[..., D] rows for int ids[...]."""
        return jnp.take(self.embedding, ids, axis=0, mode="clip").astype(self.dtype)

    def attend(self, x: Array) -> Array:
        """Returns ``x @ embedding.T`` (tied output head), dtype[..., num]."""
        return jnp.einsum("...d,vd->...v", x, self.embedding.astype(self.dtype))


def dense(features: int, use_bias: bool, dtype: jnp.dtype, name: str) -> nn.Dense:
    """An ``nn.Dense`` with kernel dtype[in, out] (HF Linear weights transposed once at load)."""
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name)


def attention(
    queries: Array,
    keys: Array,
    values: Array,
    bias: Array,
    scale: float,
    upcast_scores: bool = False,
) -> Array:
    """Grouped-query dot-product attention over the full cache.

    Query head ``n`` reads key/value head ``n // (N // K)``, as HF's ``repeat_kv`` arranges them.
    Scores are ``(Q K^T) * scale`` in the input dtype (float32 with ``upcast_scores``), the bias
    is added in float32, the softmax runs in float32, and the weights are cast back to the value
    dtype before the weighted sum.

    Args:
        queries: dtype[B, T, N, H].
        keys: dtype[B, S, K, H].
        values: dtype[B, S, K, H].
        bias: float32[B, 1, T, S], from :func:`genjax.cache.attention_bias`.
        scale: the score multiplier (static), usually ``H ** -0.5``.
        upcast_scores: compute ``Q K^T`` in float32 (GPT-2's ``reorder_and_upcast_attn``).

    Returns:
        dtype[B, T, N * H].
    """
    batch, length, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[2]
    grouped = queries.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if upcast_scores:
        grouped, keys = grouped.astype(jnp.float32), keys.astype(jnp.float32)
    scores = jnp.einsum("btkgh,bskh->bkgts", grouped, keys) * jnp.asarray(scale, grouped.dtype)
    scores = scores.astype(jnp.float32) + bias[:, :, None]  # [B, K, G, T, S]
    weights = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", weights, values)
    return out.reshape(batch, length, num_heads * head_dim).astype(queries.dtype)
