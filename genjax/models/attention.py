"""Grouped-query dot-product attention over a KV cache, in transformers' numerics.

The softmax runs in float32 and the scores are scaled after the ``Q K^T`` product, rounded to
the input dtype where transformers' eager attention rounds them. A prompt (several query
tokens) and a decode step (one) take different layouts, see :func:`attention`; on the CPU a
decode step's sums over the cache run genjax's kernel (:mod:`genjax.kernels.attention`).

Shapes use the axis letters of :mod:`genjax.typing`. Static or traced: the layout (query
tokens, dtypes, softcap, whether the weights are returned) is static; every array is traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from genjax.cache.paged_blocks import PagedBlocks
from genjax.kernels import attention as attention_kernel
from genjax.typing import Array


def attention(
    queries: Array,
    keys: Array,
    values: Array,
    bias: Array,
    scale: float,
    upcast_scores: bool = False,
    softcap: float | None = None,
    return_weights: bool = False,
) -> Array | tuple[Array, Array]:
    """Grouped-query dot-product attention over the full cache.

    Query head ``n`` reads key/value head ``n // (N // K)``, as HF's ``repeat_kv`` arranges them.
    Scores are ``(Q K^T) * scale`` in the input dtype (float32 with ``upcast_scores``), the bias
    is added in float32, the softmax runs in float32, and the weights are cast back to the value
    dtype before the weighted sum.

    Two layouts, chosen by the (static) number of query tokens ``T``:

    * ``T > 1`` (a prompt, a verified draft block): each KV head's ``G * T`` queries form one
      block of rows, so both products are plain [G*T, H] x [H, S] and [G*T, S] x [S, H] matrix
      products and the softmax runs over the last axis of their result. Written with the group
      axis beside the slots instead (as the one-token path is), XLA on CPU computes the scores
      transposed and copies the [T, S] weights twice per layer, which makes a long prefill
      spend much of its attention time in copies.
    * ``T = 1`` (a decode step): both sums are a multiply and a sum over an axis that is not the
      minor one, reading the cache once in place (:func:`_decode_attention`); on the CPU,
      genjax's kernel over the unmasked slots.

    Args:
        queries: dtype[B, T, N, H].
        keys: dtype[B, K, H, S], the cache's axis order (slots last, see :mod:`genjax.cache`),
            or a paged pool's :class:`~genjax.cache.paged_blocks.PagedBlocks` standing for it
            (read in place by the CPU kernel for one query token, gathered otherwise).
        values: dtype[B, K, S, H], or :class:`~genjax.cache.paged_blocks.PagedBlocks`.
        bias: float32[B, 1, T, S], from :func:`genjax.cache.attention_bias`.
        scale: the score multiplier (static), usually ``H ** -0.5``.
        upcast_scores: compute ``Q K^T`` in float32 (GPT-2's ``reorder_and_upcast_attn``).
        softcap: static; when set, the scaled scores become ``softcap * tanh(scores / softcap)``
            before the bias (Gemma 2's ``attn_logit_softcapping``).
        return_weights: static; also return the softmax weights (``output_attentions``). False
            compiles the same program as before: the weights are an output the caller keeps.

    Returns:
        dtype[B, T, N * H]; with ``return_weights``, ``(out, weights)``, the weights dtype[B, N,
        T, S] in ``values``' dtype (as transformers' eager attention returns them): 0 on masked
        slots, uniform over all ``S`` slots for a query that may attend to none.
    """
    dtype = queries.dtype
    batch, length, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    groups = num_heads // num_kv_heads
    grouped = queries.reshape(batch, length, num_kv_heads, groups, head_dim)
    if isinstance(keys, PagedBlocks) and (length > 1 or upcast_scores):
        keys, values = keys.logical(), values.logical()
    if upcast_scores:
        grouped, keys = grouped.astype(jnp.float32), keys.astype(jnp.float32)
    if length > 1:
        out, weights = _prompt_attention(grouped, keys, values, bias, scale, softcap)
    else:
        out, weights = _decode_attention(grouped[:, 0], keys, values, bias[:, :, 0], scale, softcap)
    out = out.reshape(batch, length, num_heads * head_dim).astype(dtype)
    if not return_weights:
        return out
    return out, weights.reshape(batch, num_heads, length, -1).astype(values.dtype)


def _decode_attention(
    grouped: Array, keys: Array, values: Array, bias: Array, scale: float, softcap: float | None
) -> Array:
    """Attention for one query token per row, each sum a multiply and a sum over the cache.

    The scores ``q . k`` sum the keys ``[H, S]`` over ``H`` and the output sums the values
    ``[S, H]`` over ``S``: neither is the minor axis, so XLA:CPU emits each as one loop over the
    block that reads it once, vectorized along the minor axis, with no copy. As matrix products
    they would be a few-row product per KV head (XLA's slow small-matrix kernel, see ``Dense``)
    that XLA:CPU wants with other operand layouts: at batch 1 it transposes each layer's keys and
    copies them on every step, and with values ``[S, H]`` the G-row product is several times
    slower than the sum.

    On the CPU, with a float32 or bfloat16 cache, both sums run genjax's kernel instead
    (:mod:`genjax.kernels.attention`: each block read once, over the row's unmasked slots only;
    XLA:CPU's sums above ran at about a third of its memory speed and over every slot); the
    softmax between them stays here.

    Sums accumulate in float32 and are rounded where the matrix products round (the scores after
    the product and after the scale, the softmax weights, the output), explicitly, as in
    :func:`_prompt_attention`, so one device and a mesh round alike.

    Args:
        grouped: dtype[B, K, G, H], the query by KV head.
        keys: dtype[B, K, H, S].
        values: dtype[B, K, S, H].
        bias: float32[B, 1, S].
        scale: the score multiplier.
        softcap: the score soft cap, or None.

    Returns:
        ``(out, weights)``: dtype[B, K, G, H] of ``values``' dtype and the softmax weights
        [B, K, G, S], rounded to ``values``' dtype (unused by most callers: XLA drops them).
    """
    batch, num_kv_heads, groups, head_dim = grouped.shape
    slots = values.shape[2]
    wide = jnp.promote_types(jnp.promote_types(grouped.dtype, keys.dtype), jnp.float32)
    # No size-1 batch or group axis: XLA:CPU's library fusions run these sums far slower with
    # the size-1 axes of B = 1 and G = 1 left in. (B and K stay separate axes, so rows sharded
    # on one mesh axis and KV heads on another need no gather.)
    heads = (num_kv_heads,) if batch == 1 else (batch, num_kv_heads)
    queries = heads if groups == 1 else (*heads, groups)

    def per_query(block: Array) -> Array:  # a KV head's [X, Y] block, once per query if G > 1
        return block if groups == 1 else block[..., None, :, :]

    kernel = wide == jnp.float32 and attention_kernel.applies(keys, values)
    if isinstance(keys, PagedBlocks) and not kernel:
        keys, values = keys.logical(), values.logical()
    if not kernel:
        q = grouped.astype(wide).reshape(*queries, head_dim)
        k = keys.astype(wide).reshape(*heads, head_dim, slots)
        v = values.astype(wide).reshape(*heads, slots, head_dim)
        scores = jnp.sum(q[..., None] * per_query(k), axis=-2)  # [.., S]
    elif isinstance(keys, PagedBlocks):  # the kernel reads the pool in place (bits as gathered)
        scores = attention_kernel.paged_scores(grouped, keys.pool, keys.tables, bias[:, 0])
    else:  # on the CPU: genjax's kernel, over the unmasked slots only
        scores = attention_kernel.scores(grouped, keys, bias[:, 0])
    scores = _rounded(scores.reshape(*queries, slots), grouped.dtype)
    scores = _rounded(scores * jnp.asarray(scale, grouped.dtype).astype(wide), grouped.dtype)
    scores = _capped(scores, softcap, grouped.dtype)
    scores = scores.astype(jnp.float32).reshape(batch, num_kv_heads, groups, slots)
    weights = jax.nn.softmax(scores + bias[:, :, None], axis=-1)
    weights = _rounded(weights, values.dtype)
    if not kernel:
        flat = weights.astype(wide).reshape(*queries, slots)
        out = jnp.sum(flat[..., None] * per_query(v), axis=-2)  # [..., H]
    elif isinstance(values, PagedBlocks):
        out = attention_kernel.paged_weighted_values(
            weights, values.pool, values.tables, bias[:, 0]
        )
    else:
        out = attention_kernel.weighted_values(weights, values, bias[:, 0])
    return out.reshape(batch, num_kv_heads, groups, head_dim).astype(values.dtype), weights


def _prompt_attention(
    grouped: Array, keys: Array, values: Array, bias: Array, scale: float, softcap: float | None
) -> Array:
    """Attention for ``T > 1`` query tokens, each KV head's ``G * T`` queries as one block of rows.

    Both products accumulate in float32 and the results are rounded to the input dtype where the
    one-token path (and transformers) round them: the scores after the product and after the
    scale, the softmax weights, the output. The roundings are explicit (``reduce_precision``)
    because XLA may drop a float32 -> bfloat16 -> float32 conversion pair ("excess precision"),
    and whether it does depends on fusion, which differs between one device and a mesh; explicit
    rounding keeps the two bit-identical. In float32 every rounding is a no-op.

    Args:
        grouped: dtype[B, T, K, G, H], the queries by KV head.
        keys: dtype[B, K, H, S].
        values: dtype[B, K, S, H].
        bias: float32[B, 1, T, S].
        scale: the score multiplier.
        softcap: the score soft cap, or None.

    Returns:
        ``(out, weights)``: dtype[B, T, K * G * H] of ``values``' dtype and the softmax weights
        [B, K, G, T, S], rounded to ``values``' dtype (unused by most callers: XLA drops them).
    """
    batch, length, num_kv_heads, groups, head_dim = grouped.shape
    slots = values.shape[2]
    rows = grouped.transpose(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, -1, head_dim)
    scores = jnp.einsum("bkqh,bkhs->bkqs", rows, keys, preferred_element_type=jnp.float32)
    scores = _rounded(scores, rows.dtype) * jnp.asarray(scale, rows.dtype).astype(jnp.float32)
    scores = _capped(_rounded(scores, rows.dtype), softcap, rows.dtype)
    scores = scores.reshape(batch, num_kv_heads, groups, length, slots)
    weights = jax.nn.softmax(scores + bias[:, :, None], axis=-1)  # float32[B, K, G, T, S]
    weights = _rounded(weights, values.dtype)
    rows = weights.reshape(batch, num_kv_heads, -1, slots).astype(values.dtype)
    out = jnp.einsum(
        "bkqs,bksh->bkqh", rows, values, preferred_element_type=jnp.float32
    )  # [B, K, G*T, H]
    out = _rounded(out, values.dtype).reshape(batch, num_kv_heads, groups, length, head_dim)
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, length, -1).astype(values.dtype)
    return out, weights


def _capped(scores: Array, softcap: float | None, dtype: jnp.dtype) -> Array:
    """``softcap * tanh(scores / softcap)`` on wide scores, each step rounded to ``dtype`` as
    transformers computes it in the query dtype; ``scores`` unchanged when ``softcap`` is None."""
    if softcap is None:
        return scores
    cap = jnp.asarray(softcap, dtype).astype(scores.dtype)
    capped = jnp.tanh(_rounded(scores / cap, dtype))
    return _rounded(_rounded(capped, dtype) * cap, dtype)


def _rounded(x: Array, dtype: jnp.dtype) -> Array:
    """float32 ``x`` rounded to the precision of ``dtype`` (unchanged for float32 and wider)."""
    info = jnp.finfo(dtype)
    if info.bits >= jnp.finfo(x.dtype).bits:
        return x
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
