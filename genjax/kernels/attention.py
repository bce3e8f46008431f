"""One-token attention's two sums over the KV cache, on the CPU through genjax's kernel.

A decode step's attention reads the whole cache twice per layer: the scores ``q . k`` over the
keys and the weighted sum over the values. XLA:CPU runs both (as a multiply and a sum over the
cache, or as batched products) well below the speed at which it reads memory elsewhere, and it
reads every slot of the cache buffer, the ones no token has reached yet included. On the 2-core
Intel Xeon, SmolLM's shape at batch 32 spent about 30 ms of an 80 ms float32 step there
(``bench/run.py``; figures in ``bench/README.md``).

:func:`scores` and :func:`weighted_values` run ``decode_attention.h`` as XLA FFI custom calls:
each (row, KV head) block streams its keys and values once, and only over the row's span of
unmasked slots (from the first to the last slot whose bias is above ``-1e30``; outside it every
softmax weight is exactly 0, so nothing changes but the work). The softmax between the two sums
stays in XLA, with its roundings (:func:`genjax.models.attention.attention`). Each output's sum runs
in one fixed order, independent of the other rows, of the cache buffer's length and of where the
span starts.

Where it runs: on the CPU, keys and values in float32 or bfloat16 (both the same), a head width
that is a multiple of 16, where :mod:`genjax.kernels.gate` allows (not on meshes with automatic
axes, not under ``disabled(kernels=("attention",))``, not with ``GENJAX_KERNELS_OFF=attention``).
Elsewhere the callers take XLA's sums.

Gradients: a custom JVP takes the tangents through XLA's sums over every slot.

Static or traced: the choice of path is static (backend, dtypes, shapes, context); queries,
keys, values, weights and the bias are traced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from genjax.kernels import block_gather, gate
from genjax.typing import Array, vary_like

HEAD_MULTIPLE = 16
"""The head width must be a multiple of this (the kernel's vector width, in floats)."""

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_SUFFIX = {jnp.dtype(jnp.float32): "F32", jnp.dtype(jnp.bfloat16): "BF16"}
_TARGETS = {
    f"genjax_{kind.lower()}attention_{part.lower()}_{suffix.lower()}": (
        f"Genjax{kind}Attention{part}{suffix}"
    )
    for kind in ("", "Paged")
    for part in ("Scores", "Values")
    for suffix in _SUFFIX.values()
}


def applies(keys: Array, values: Array) -> bool:
    """Whether a decode step over ``keys`` [B, K, H, S] and ``values`` [B, K, S, H] runs the
    kernel (static)."""
    dtype = jnp.dtype(keys.dtype)
    return (
        dtype in _DTYPES
        and jnp.dtype(values.dtype) == dtype
        and keys.ndim == 4
        and keys.shape[2] % HEAD_MULTIPLE == 0
        and gate.allowed("attention")
        and _kernel_registered()
    )


def scores(queries: Array, keys: Array, bias: Array) -> Array:
    """float32[B, K, G, S]: ``sum_h queries[b, k, g, h] * keys[b, k, h, s]`` over each row's span
    of unmasked slots, 0 outside it (where ``bias`` masks the slot anyway).

    Args:
        queries: float[B, K, G, H] (taken in float32).
        keys: float32 or bfloat16[B, K, H, S].
        bias: float[B, S], the additive mask (``<= -1e30``: masked).
    """
    q, b = queries.astype(jnp.float32), bias.astype(jnp.float32)
    return jax.lax.platform_dependent(q, keys, b, cpu=_scores, default=_xla_scores)


def weighted_values(weights: Array, values: Array, bias: Array) -> Array:
    """float32[B, K, G, H]: ``sum_s weights[b, k, g, s] * values[b, k, s, h]`` over each row's
    span of unmasked slots (the weights outside it are 0).

    Args:
        weights: float[B, K, G, S], the softmax weights (taken in float32).
        values: float32 or bfloat16[B, K, S, H].
        bias: float[B, S], the same bias the weights were computed with.
    """
    w, b = weights.astype(jnp.float32), bias.astype(jnp.float32)
    return jax.lax.platform_dependent(
        w, values, b, cpu=_weighted_values, default=_xla_weighted_values
    )


def paged_scores(queries: Array, pool_keys: Array, tables: Array, bias: Array) -> Array:
    """:func:`scores` over a paged pool: row ``b``'s slot ``s`` is at offset ``s % bs`` of
    block ``tables[b, s // bs]``. The same bits as :func:`scores` over the rows' blocks
    gathered into logical order (:meth:`genjax.cache.PagedKVCache.gather`), without the copy.

    Args:
        queries: float[B, K, G, H] (taken in float32).
        pool_keys: float32 or bfloat16[N, K, H, bs].
        tables: int32[B, M], ``M * bs = S``.
        bias: float[B, S].
    """
    q, b = queries.astype(jnp.float32), bias.astype(jnp.float32)
    operands = (q, pool_keys, tables.astype(jnp.int32), b)
    return jax.lax.platform_dependent(*operands, cpu=_paged_scores, default=_xla_paged_scores)


def paged_weighted_values(weights: Array, pool_values: Array, tables: Array, bias: Array) -> Array:
    """:func:`weighted_values` over a paged pool's values [N, K, bs, H] (as
    :func:`paged_scores`); weights float[B, K, G, S]."""
    w, b = weights.astype(jnp.float32), bias.astype(jnp.float32)
    operands = (w, pool_values, tables.astype(jnp.int32), b)
    return jax.lax.platform_dependent(*operands, cpu=_paged_values, default=_xla_paged_values)


def kernel_available() -> bool:
    """Whether this CPU can run the kernel (building it on first call)."""
    return _kernel_registered()


def _call(target: str, shape: tuple, *operands: Array) -> Array:
    out = jax.ShapeDtypeStruct(shape, jnp.float32)
    y = jax.ffi.ffi_call(target, out, vmap_method="sequential")(*operands)
    return vary_like(y, operands)  # in shard_map: typed as XLA's sums would be


def _xla_scores(q: Array, keys: Array, bias: Array) -> Array:
    return jnp.einsum("bkgh,bkhs->bkgs", q, keys.astype(jnp.float32))


def _xla_weighted_values(w: Array, values: Array, bias: Array) -> Array:
    return jnp.einsum("bkgs,bksh->bkgh", w, values.astype(jnp.float32))


def _kernel_sum(part: str, xla_sum):
    """The kernel's ``part`` ("scores" or "values") as a function of (rows [B, K, G, X], cache
    [B, K, X, Y], bias [B, S]) -> float32[B, K, G, Y], its tangents taken through ``xla_sum``."""

    @jax.custom_jvp
    def kernel_sum(rows: Array, cache: Array, bias: Array) -> Array:
        target = f"genjax_attention_{part}_{_SUFFIX[jnp.dtype(cache.dtype)].lower()}"
        return _call(target, (*rows.shape[:3], cache.shape[3]), rows, cache, bias)

    @kernel_sum.defjvp
    def kernel_sum_jvp(primals, tangents):
        return kernel_sum(*primals), jax.jvp(xla_sum, primals, tangents)[1]

    return kernel_sum


_scores = _kernel_sum("scores", _xla_scores)
_weighted_values = _kernel_sum("values", _xla_weighted_values)


def _xla_paged_scores(q: Array, pool_keys: Array, tables: Array, bias: Array) -> Array:
    return _xla_scores(q, block_gather.logical(pool_keys, tables, keys=True), bias)


def _xla_paged_values(w: Array, pool_values: Array, tables: Array, bias: Array) -> Array:
    return _xla_weighted_values(w, block_gather.logical(pool_values, tables, keys=False), bias)


def _paged_sum(part: str, xla_sum):
    """The paged kernel's ``part`` as a function of (rows [B, K, G, X], pool, tables [B, M],
    bias [B, S]), its tangents taken through ``xla_sum``."""

    @jax.custom_jvp
    def paged_sum(rows: Array, pool: Array, tables: Array, bias: Array) -> Array:
        target = f"genjax_pagedattention_{part}_{_SUFFIX[jnp.dtype(pool.dtype)].lower()}"
        # scores: S = M * bs of a keys pool [N, K, H, bs]; values: H of [N, K, bs, H]
        last = tables.shape[1] * pool.shape[3] if part == "scores" else pool.shape[3]
        return _call(target, (*rows.shape[:3], last), rows, pool, tables, bias)

    @paged_sum.defjvp
    def paged_sum_jvp(primals, tangents):
        rows, pool, tables, bias = primals
        d_rows, d_pool, _, d_bias = tangents
        tangent = jax.jvp(
            lambda r, p, b: xla_sum(r, p, tables, b), (rows, pool, bias), (d_rows, d_pool, d_bias)
        )[1]
        return paged_sum(*primals), tangent

    return paged_sum


_paged_scores = _paged_sum("scores", _xla_paged_scores)
_paged_values = _paged_sum("values", _xla_paged_values)


@functools.cache
def _kernel_registered() -> bool:
    """Registers the kernels once per process; False without the library
    (:func:`genjax.kernels.gate.library`)."""
    return gate.register(_TARGETS)
