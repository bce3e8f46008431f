"""A few rows of a paged cache, gathered once into contiguous slots for a run of decode steps.

The serving engine's decode loop runs up to ``K`` one-token steps per call for the same rows.
Reading their keys and values straight from the block pool (:class:`~genjax.cache.PagedKVCache`)
gathers every row's blocks into logical order on every step and layer: a copy written, then
read again by the attention. On a CPU that copy cost about a fifth of a SmolLM-135M decode
step at 8 rows of 512 slots. :meth:`PagedKVCache.gather` makes the copy once, before the loop;
the loop then writes each new slot in place here (one scatter of ``B`` slots per layer) and the
attention reads the blocks where they are; :meth:`PagedKVCache.scatter` writes the new slots
back into the pool after the loop.

Rows write at their own ``index`` (int32[B]) as in the paged cache, so the same attention bias
(:func:`~genjax.cache.attention_bias` with a per-row index) applies. Writes past the ``S``
slots are dropped, as the paged cache sends them to its scratch block.

From an int8 pool the blocks are gathered dequantized, and the view carries the pool
(``codes``): each call quantizes its new slot into the pool as the paged cache does, keeps it
exact in the view for its own attention, and turns the previous call's slot into its
dequantized codes, so every call sees what the paged cache's ``update_layer`` returns (earlier
slots dequantized, its own exact), one call of one token at a time.

Static or traced:
    Static: the number of layers, ``B``, ``S`` (the span of blocks gathered times the block
    size), the KV heads, the head size and the dtype. Traced: the contents and ``index``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import struct

from genjax.cache.kv import replace_layer
from genjax.typing import Array


@struct.dataclass
class GatheredKVCache:
    """Keys and values of ``B`` rows in logical slot order, with one write index per row.

    Example:
        >>> import jax.numpy as jnp
        >>> cache = GatheredKVCache(
        ...     keys=(jnp.zeros((2, 1, 4, 8)),), values=(jnp.zeros((2, 1, 8, 4)),),
        ...     index=jnp.array([3, 5]))
        >>> k, v, cache = cache.update_layer(0, jnp.ones((2, 1, 1, 4)), jnp.ones((2, 1, 1, 4)))
        >>> v[:, 0, :, 0].astype(int).tolist()
        [[0, 0, 0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1, 0, 0]]
    """

    keys: tuple[Array, ...]  # L x float[B, K, H, S]: slots last, as KVCache
    values: tuple[Array, ...]  # L x float[B, K, S, H]
    index: Array  # int32[B]: per row, the first slot not yet written
    codes: Any = None  # an int8 pool's PagedKVCache (codes, scales, the rows' tables); None:
    #   a float pool's view, written back by PagedKVCache.scatter

    @property
    def length(self) -> int:
        """``S``, the slots of a row (static)."""
        return self.values[0].shape[2]

    @property
    def batch(self) -> int:
        """The number of rows ``B`` (static)."""
        return self.values[0].shape[0]

    def ring_slots(self, layer: int) -> None:
        """None: no layer is a ring (windows are applied by the mask, as in the paged cache)."""
        return None

    def update_layer(
        self, layer: int, new_keys: Array, new_values: Array
    ) -> tuple[Array, Array, GatheredKVCache]:
        """Writes ``T`` new slots of one layer at each row's ``index``; does not advance it.

        Args:
            layer: the layer number (a Python int).
            new_keys: float[B, T, K, H].
            new_values: float[B, T, K, H].

        Returns:
            ``(keys, values, cache)``: the layer's keys float[B, K, H, S] and values
            float[B, K, S, H] after the write, and the cache holding them.
        """
        count = new_keys.shape[1]
        rows = jnp.arange(self.batch)[:, None]  # [B, 1]
        slots = self.index[:, None] + jnp.arange(count)[None, :]  # [B, T]
        view = self
        if self.codes is not None:
            view = self._requantized(layer, new_keys, new_values)
        # The indexed axes come first in a scatter's updates: [B, T, K, H] at (row, slot).
        new_keys = new_keys.astype(self.keys[layer].dtype)
        new_values = new_values.astype(self.values[layer].dtype)
        keys = view.keys[layer].at[rows, :, :, slots].set(new_keys, mode="drop")
        values = view.values[layer].at[rows, :, slots, :].set(new_values, mode="drop")
        cache = view.replace(
            keys=replace_layer(view.keys, layer, keys),
            values=replace_layer(view.values, layer, values),
        )
        return keys, values, cache

    def _requantized(self, layer: int, new_keys: Array, new_values: Array) -> GatheredKVCache:
        """An int8 pool's view before a one-token call writes ``layer``: the call's slot
        quantized into the pool, and the slot before it (the previous call's, exact until now)
        replaced by its dequantized codes."""
        if new_keys.shape[1] != 1:
            raise ValueError("an int8 pool's gathered view takes one token per call")
        codes = self.codes.replace(index=self.index).write_codes(layer, new_keys, new_values)
        before = jnp.where(self.index > 0, self.index - 1, self.length)[:, None]  # [B, 1]
        old_keys, old_values = codes.read_slots(layer, jnp.minimum(before, self.length - 1))
        rows = jnp.arange(self.batch)[:, None]
        keys = self.keys[layer].at[rows, :, :, before].set(old_keys, mode="drop")
        values = self.values[layer].at[rows, :, before, :].set(old_values, mode="drop")
        return self.replace(
            keys=replace_layer(self.keys, layer, keys),
            values=replace_layer(self.values, layer, values),
            codes=codes.replace(index=self.codes.index),
        )

    def advance(self, num_slots: int | Array) -> GatheredKVCache:
        """Returns the cache with every row's ``index`` moved forward by ``num_slots``."""
        return self.replace(index=self.index + jnp.asarray(num_slots, jnp.int32))

    def with_pools(self, other: GatheredKVCache) -> GatheredKVCache:
        """This cache's index (and its pool's tables) with the keys, values and pool codes of
        ``other`` (as the paged cache's)."""
        codes = None if self.codes is None else self.codes.with_pools(other.codes)
        return self.replace(keys=other.keys, values=other.values, codes=codes)
