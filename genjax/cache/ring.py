"""Ring blocks: the sliding-window layers of a :class:`~genjax.cache.KVCache` keep ``R`` slots.

A layer whose attention window is ``W`` only ever reads the ``W`` slots before and at a query,
so when the cache is longer than that it keeps ``R = W + margin`` slots and writes logical slot
``p`` (the cache's own slot numbering, the one ``index`` and the attention mask use) to ring
slot ``p mod R``. ``margin`` is 0 except where a call writes slots that a later call takes back
(assisted decoding: the rejected draft tokens of a verification pass, see below).

Bookkeeping for ``W = R = 4``, eleven slots written (``index = 11``)::

    logical slot   0 1 2 3 4 5 6 7 8 9 10
    ring slot      0 1 2 3 0 1 2 3 0 1 2      the ring holds logical slots 7, 8, 9, 10
    ring           [8, 9, 10, 7]              ring slot j holds the newest p < 11, p = j mod 4

Which logical slot a ring slot holds is computed from ``index`` (traced) alone,
``p_j = last - ((last - j) mod R)`` with ``last`` the newest slot written, and the attention bias
looks up the cache's ``[B, S]`` mask at ``p_j`` (:func:`ring_bias`): the mask, causality and the
window mean what they mean in the full layout, so a ring layer attends to the same keys.

One query (a decode step) writes its slot, then reads the ring in place: ``R`` slots instead of
``S``. ``T > 1`` queries (a prompt chunk, a verification block) may span more than the ring, so
they read the ring as it was before the call, followed by the call's own ``T`` new slots
(``R + T`` slots, a temporary), and the last ``min(T, R)`` new slots are then written: any chunk
length attends to the right keys.

Slots written after ``index`` and taken back (assisted decoding moves ``index`` past the accepted
tokens only, so up to ``F`` rejected slots stay ahead of it): the next calls map a ring slot
holding one of them to ``p - R``, and overwrote slots of logical slots up to ``index + F - 1 - R``.
Both lie outside every later query's window when ``R >= W + F - 1``, so assisted decoding
allocates ``margin = G + 1`` (``G`` draft tokens, ``F <= G + 1``).

Static or traced:
    Static: ``W``, ``R`` and which layers are rings (the model's windows, the cache length and
    the margin); the number of new slots ``T``. Traced: ``index``, hence the write position
    ``index mod R`` and the logical slot of every ring slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from genjax.typing import Array


def ring_size(window: int | None, length: int, margin: int = 0) -> int | None:
    """The slots ``R = W + margin`` of a layer with window ``W`` in a cache of ``length`` slots,
    or None when the layer keeps the full ``length`` (no window, or ``R >= length``); static."""
    if window is None or window + margin >= length:
        return None
    return window + margin


def ring_positions(index: Array, ring: int, query_length: int) -> Array:
    """int32[R] (``T == 1``) or int32[R + T]: the logical slot each slot of the block a call of
    ``T`` queries at ``index`` reads holds (negative: never written). See :func:`ring_update`."""
    last = index if query_length == 1 else index - 1  # the newest slot already in the ring
    held = last - (last - jnp.arange(ring, dtype=jnp.int32)) % ring
    if query_length == 1:
        return held
    return jnp.concatenate([held, index + jnp.arange(query_length, dtype=jnp.int32)])


def ring_to_slots(values: Array, index: Array, ring: int, length: int) -> Array:
    """Values over the slots a ring layer read, moved to the logical slots they hold.

    Attention weights of a ring layer are over the block :func:`ring_update` returns (``R``
    slots, or ``R + T``, in :func:`ring_positions`' order); this lays them out over the cache's
    ``S`` logical slots, as a layer in the full layout gives them, with 0 on the slots the ring
    no longer holds (outside every query's window, so their weight is 0 anyway).

    Args:
        values: [..., T, R] (``T == 1``) or [..., T, R + T].
        index: int32[], the logical slot of the first of the ``T`` queries.
        ring: ``R`` (static).
        length: ``S`` (static).

    Returns:
        [..., T, S] of ``values``' dtype.

    Example:
        >>> ring_to_slots(jnp.array([[1, 2, 3, 4]]), jnp.int32(5), 4, 6).tolist()
        [[0, 0, 3, 4, 1, 2]]
    """
    held = ring_positions(jnp.asarray(index, jnp.int32), ring, values.shape[-2])
    target = jnp.where(held >= 0, held, length)  # never written: out of range, dropped
    out = jnp.zeros((*values.shape[:-1], length), values.dtype)
    return out.at[..., target].set(values, mode="drop")


def ring_update(block: Array, new: Array, index: Array, axis: int) -> tuple[Array, Array]:
    """Writes ``T`` new slots (logical ``index .. index + T - 1``) into one ring block.

    Args:
        block: one layer's ring, ``R`` slots on ``axis`` (keys ``[B, K, H, R]``: 3; values
            ``[B, K, R, H]``: 2).
        new: the new slots in the block's axis order, ``T`` on ``axis``.
        index: int32[], the logical slot of the first new one.
        axis: the slot axis (static).

    Returns:
        ``(read, block)``: what attention reads (the written ring for ``T == 1``; the ring as
        it was, then the ``T`` new slots, for ``T > 1``; slot order :func:`ring_positions`),
        and the ring after the write.
    """
    ring, count = block.shape[axis], new.shape[axis]
    new = new.astype(block.dtype)
    if count == 1:
        start = [0] * block.ndim
        start[axis] = index % ring
        block = jax.lax.dynamic_update_slice(block, new, start)
        return block, block
    keep = min(count, ring)  # only the last R new slots survive the write
    kept = jax.lax.slice_in_dim(new, count - keep, count, axis=axis)
    slots = (index + count - keep + jnp.arange(keep, dtype=jnp.int32)) % ring
    where = (slice(None),) * axis + (slots,)
    written = block.at[where].set(kept, unique_indices=True)
    return jnp.concatenate([block, new], axis=axis), written


def ring_bias(
    attention_mask: Array,
    cache_index: Array,
    query_length: int,
    window: int,
    ring: int,
    dtype: jnp.dtype = jnp.float32,
) -> Array:
    """The additive attention bias of ``T`` queries at ``cache_index`` over a ring's slots.

    As :func:`genjax.cache.attention_bias` with a sliding window ``W``, over the slots
    :func:`ring_update` returns: query ``i`` (logical slot ``cache_index + i``) may read the
    slot holding logical slot ``p`` when ``p >= 0``, ``attention_mask[b, p]`` is nonzero,
    ``p <= cache_index + i`` and ``cache_index + i - p < W``.

    Args:
        attention_mask: int or bool[B, S], over the cache's logical slots.
        cache_index: int32[], the logical slot of the first query.
        query_length: ``T`` (static).
        window: ``W`` (static).
        ring: ``R`` (static), at least ``W``.
        dtype: the dtype of the returned bias.

    Returns:
        float[B, 1, T, R] for ``T == 1``, float[B, 1, T, R + T] otherwise: 0 where attention
        is allowed, the dtype's lowest finite value where it is not.

    Example:
        >>> bias = ring_bias(jnp.ones((1, 8)), jnp.int32(5), 1, window=3, ring=4)
        >>> (bias[0, 0, 0] == 0).tolist()  # ring slots hold logical slots 4, 5, 2, 3
        [True, True, False, True]
    """
    held = ring_positions(jnp.asarray(cache_index, jnp.int32), ring, query_length)  # [S']
    queries = cache_index + jnp.arange(query_length, dtype=jnp.int32)[:, None]  # [T, 1]
    allowed = (held >= 0) & (held <= queries) & (queries - held < window)  # [T, S']
    real = jnp.take(attention_mask, jnp.maximum(held, 0), axis=1) != 0  # [B, S']
    allowed = allowed[None, None] & real[:, None, None, :]  # [B, 1, T, S']
    return jnp.where(allowed, 0.0, jnp.finfo(dtype).min).astype(dtype)


def relayout(
    block: Array, axis: int, index: Array, length: int, source: int | None, target: int | None
) -> Array:
    """One layer's block moved between the full layout and rings (a gather, run once).

    Args:
        block: the layer's keys or values, its slots on ``axis``.
        axis: the slot axis (static).
        index: int32[], the cache's next slot: a target ring takes the ``R`` logical slots
            before it.
        length: the logical length of a full target (static).
        source: the ring size of ``block``, or None for the full layout (slot ``p`` at ``p``).
        target: the ring size wanted, or None for the full layout of ``length`` slots.

    Returns:
        The block in the target layout; slots whose logical slot the source does not hold
        are zero (they are never read unmasked).
    """
    size = block.shape[axis]
    if target is None:
        wanted = jnp.arange(length, dtype=jnp.int32)
    else:
        wanted = ring_positions(index - 1, target, 1)  # the target ring of slots < index
    if source is None:
        valid = (wanted >= 0) & (wanted < size)
        slot = wanted
    else:
        valid = (wanted >= 0) & (wanted >= index - source) & (wanted < index)
        slot = wanted % source
    taken = jnp.take(block, jnp.clip(slot, 0, size - 1), axis=axis)
    shape = [1] * block.ndim
    shape[axis] = valid.shape[0]
    return jnp.where(valid.reshape(shape), taken, jnp.zeros((), block.dtype))
