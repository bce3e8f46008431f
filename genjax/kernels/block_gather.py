"""Rows of a paged KV pool's blocks copied into logical order, on the CPU through genjax's kernel.

The serving engine gathers each decoding row's blocks (:meth:`genjax.cache.PagedKVCache.gather`)
before a run of decode steps, and its prefill reads a row's blocks the same way. XLA:CPU's
gather, then the transpose into logical slot order, copied SmolLM-135M's 30 layers of 8 rows of
44 blocks (260 MB) in 68 ms on the 2-core Intel Xeon, under 4 GB/s: more than a whole decode
iteration. :func:`gather` runs ``block_gather.h``: one ``memcpy`` per (row, part, block) run, the
runs shared out on XLA's intra-op threads. The bits are copied as they are.

Where it runs: on the CPU where :mod:`genjax.kernels.gate` allows the ``block_gather`` kernel.
Elsewhere, and for gradients (a custom JVP), XLA's gather.

Static or traced: the choice of path and the shapes are static; the pool and the tables traced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from genjax.kernels import gate
from genjax.typing import Array, vary_like

_TARGET = "genjax_block_gather"


def applies() -> bool:
    """Whether gathers traced now run the kernel (static: context)."""
    return gate.allowed("block_gather") and _kernel_registered()


def gather(pool: Array, tables: Array) -> Array:
    """``[B, P, M, R]``: ``out[b, p, m] = pool[tables[b, m], p]`` for a pool ``[N, P, R]`` and
    int32 ``tables`` ``[B, M]`` (an entry counts from the end when negative and is clamped into
    ``[0, N)``, as a JAX gather's index); call only where :func:`applies`."""
    tables = tables.astype(jnp.int32)
    return jax.lax.platform_dependent(pool, tables, cpu=_gather, default=_xla_gather)


def logical(pool: Array, tables: Array, keys: bool) -> Array:
    """A paged pool's rows in logical slot order: keys ``[B, K, H, S]`` from a keys pool
    ``[N, K, H, bs]`` (``keys``), else values ``[B, K, S, H]`` from ``[N, K, bs, H]``;
    ``S = M * bs`` for tables int32 ``[B, M]``. Through the kernel where it :func:`applies`,
    else XLA's gather."""
    blocks, heads, a, b = pool.shape
    batch, per_row = tables.shape
    # keys: runs of bs slots [N, K*H, bs]; values: runs of bs*H values [N, K, bs*H]
    runs = pool.reshape(blocks, heads * a, b) if keys else pool.reshape(blocks, heads, a * b)
    out = gather(runs, tables) if applies() else _xla_gather(runs, tables)  # [B, P, M, R]
    shape = (batch, heads, a, per_row * b) if keys else (batch, heads, per_row * a, b)
    return out.reshape(shape)


def _xla_gather(pool: Array, tables: Array) -> Array:
    if pool.ndim == 2:
        return pool[tables][:, None]  # [B, M, R] -> [B, 1, M, R]
    return pool[tables].transpose(0, 2, 1, 3)  # [B, M, P, R] -> [B, P, M, R]


def take_rows(table: Array, ids: Array) -> Array:
    """``table[ids]`` for a table ``[N, R]`` and int32 ids ``[n]`` already in ``[0, N)``:
    ``[n, R]``; call only where :func:`applies`. The table goes to the kernel as it is (a
    reshape of it would be copied by XLA, once per call of a program that loops over it)."""
    rows = jax.lax.platform_dependent(table, ids[:, None], cpu=_gather, default=_xla_gather)
    return rows.reshape(ids.shape[0], table.shape[1])


@jax.custom_jvp
def _gather(pool: Array, tables: Array) -> Array:
    """``[B, P, M, R]`` for a pool ``[N, P, R]``; ``[B, 1, M, R]`` for a table ``[N, R]``."""
    batch, blocks = tables.shape
    parts, run = (1, pool.shape[1]) if pool.ndim == 2 else pool.shape[1:]
    out = jax.ShapeDtypeStruct((batch, parts, blocks, run), pool.dtype)
    call = jax.ffi.ffi_call(_TARGET, out, vmap_method="sequential")
    return vary_like(call(pool, tables), (pool, tables))


@_gather.defjvp
def _gather_jvp(primals, tangents):
    pool, tables = primals
    return _gather(pool, tables), _xla_gather(tangents[0], tables)


@functools.cache
def _kernel_registered() -> bool:
    """Registers the kernel once per process; False without the library."""
    return gate.register({_TARGET: "GenjaxBlockGather"})
