"""Writing new slots into a 16-bit KV cache block in place, on the CPU through genjax's kernel.

A decode step writes one slot per row into each layer's keys and values. For a float32 block
XLA:CPU does that in place. For a bfloat16 or float16 block it does not: it computes the update
in float32 (widening the whole block and narrowing it back), and written on the bits as uint16
the bit casts around the update keep its fusion from working in place. Either way every step
copies every layer's cache: on the 2-core Intel Xeon about 6 ms of SmolLM's 53 ms bfloat16 step
at batch 32 (``bench/README.md``).

:func:`write_slots` runs ``cache_writes.h`` as an XLA FFI custom call whose result aliases the
block (``input_output_aliases``), so XLA passes the block's own buffer and the kernel copies only
the new slots' bits: the same values as ``jax.lax.dynamic_update_slice``, its start index
wrapped and clamped the same way. :func:`write_pages` does the same for the serving engine's
16-bit paged pools (a scatter of one slot per row, which XLA:CPU also widens and copies).

Where it runs: on the CPU, 16-bit float blocks, where :mod:`genjax.kernels.gate` allows the
``cache_writes`` kernel. Elsewhere :func:`genjax.cache.kv.write_slots` writes through XLA.

Gradients: a custom JVP takes the tangents through ``dynamic_update_slice``.

Static or traced: the choice of path and the slot axis are static; the block, the new slots and
the index are traced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from genjax.kernels import gate
from genjax.typing import Array, vary_like

_TARGET = "genjax_write_slots_16"
_PAGES_TARGET = "genjax_write_pages_16"
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def applies(block: Array) -> bool:
    """Whether writes into ``block`` run the kernel (static: dtype and context)."""
    return (
        jnp.dtype(block.dtype) in _DTYPES and gate.allowed("cache_writes") and _kernel_registered()
    )


def write_slots(block: Array, new: Array, index: Array, axis: int) -> Array:
    """``block`` with ``new`` written at slot ``index`` of axis ``axis`` (static); call only
    where :func:`applies`.

    Args:
        block: bfloat16 or float16[..., S, ...], one layer's keys or values.
        new: [..., T, ...], the block's shape but ``T <= S`` along ``axis`` (cast to its dtype).
        index: int32[], the first slot written (negative: from the end), clamped to
            ``[0, S - T]`` as ``jax.lax.dynamic_update_slice`` does.
        axis: the slot axis.
    """
    index = jnp.asarray(index, jnp.int32)
    new = new.astype(block.dtype)
    write = functools.partial(_write, axis=axis)
    xla = functools.partial(_xla_write, axis=axis)
    return jax.lax.platform_dependent(block, new, index, cpu=write, default=xla)


def write_pages(pool: Array, new: Array, blocks: Array, offsets: Array, keys: bool) -> Array:
    """``pool`` with ``new`` written at slots ``(blocks[r], offsets[r])``, as
    ``pool.at[blocks, :, :, offsets].set(new)`` (``keys``: a pool [N, K, H, bs]) or
    ``pool.at[blocks, :, offsets, :].set(new)`` (values: [N, K, bs, H]) writes it (out-of-range
    writes dropped); call only where :func:`applies`.

    Args:
        pool: bfloat16 or float16, one layer's paged pool.
        new: [R, K, H] (cast to the pool's dtype).
        blocks, offsets: int32[R].
        keys: static, the pool's layout.
    """
    new = new.astype(pool.dtype)
    blocks, offsets = blocks.astype(jnp.int32), offsets.astype(jnp.int32)
    write = functools.partial(_write_pages, keys=keys)
    xla = functools.partial(_xla_write_pages, keys=keys)
    return jax.lax.platform_dependent(pool, new, blocks, offsets, cpu=write, default=xla)


def _xla_write_pages(pool, new, blocks, offsets, keys: bool) -> Array:
    if keys:
        return pool.at[blocks, :, :, offsets].set(new)
    return pool.at[blocks, :, offsets, :].set(new)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _write_pages(pool, new, blocks, offsets, keys: bool) -> Array:
    call = jax.ffi.ffi_call(
        _PAGES_TARGET,
        jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        vmap_method="sequential",
        input_output_aliases={0: 0},
    )
    operands = (pool, new, blocks, offsets)
    return vary_like(call(*operands, keys=keys), operands)


@_write_pages.defjvp
def _write_pages_jvp(keys, primals, tangents):
    pool, new, blocks, offsets = primals
    d_pool, d_new = tangents[:2]
    tangent = _xla_write_pages(d_pool, d_new, blocks, offsets, keys)
    return _write_pages(pool, new, blocks, offsets, keys), tangent


def _xla_write(block: Array, new: Array, index: Array, axis: int) -> Array:
    starts = tuple(index if d == axis else 0 for d in range(block.ndim))
    return jax.lax.dynamic_update_slice(block, new, starts)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _write(block: Array, new: Array, index: Array, axis: int) -> Array:
    call = jax.ffi.ffi_call(
        _TARGET,
        jax.ShapeDtypeStruct(block.shape, block.dtype),
        vmap_method="sequential",
        input_output_aliases={0: 0},
    )
    return vary_like(call(block, new, index, axis=np.int64(axis)), (block, new, index))


@_write.defjvp
def _write_jvp(axis, primals, tangents):
    block, new, index = primals
    d_block, d_new, _ = tangents
    return _write(block, new, index, axis), _xla_write(d_block, d_new, index, axis)


@functools.cache
def _kernel_registered() -> bool:
    """Registers the kernel once per process; False without the library."""
    return gate.register({_TARGET: "GenjaxWriteSlots16", _PAGES_TARGET: "GenjaxWritePages16"})
