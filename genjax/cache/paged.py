"""A paged KV cache: fixed-size blocks in one pool per layer, mapped to rows by block tables.

The serving engine (:mod:`genjax.serving`) keeps many requests of different lengths in one cache.
Each layer's keys and values live in a pool of ``num_blocks`` blocks of ``block_size`` slots;
a row owns a list of blocks, its block table, and its logical slot ``p`` lives in block
``table[p // block_size]`` at offset ``p % block_size``. Rows grow one block at a time, and a
finished row hands its blocks back, so memory follows the tokens actually held, not the longest
possible request (as in vLLM's PagedAttention).

:class:`PagedKVCache` is duck-typed like :class:`~genjax.cache.KVCache`, so the models run on it
unchanged: ``update_layer`` writes the ``T`` new slots of every row at the row's own ``index``
and returns the row's keys ``[B, K, H, S]`` and values ``[B, K, S, H]`` gathered in logical
order, ``S = max_blocks_per_row * block_size``; ``index`` is int32[B], one write position per
row, which :func:`~genjax.cache.attention_bias` accepts. Rows never hold padding: logical slot
``p`` holds the token at position ``p``, so the attention mask may be all ones and causality
alone hides the slots after a row's end.

Sliding windows are applied by the attention mask here: every layer keeps its rows' blocks
(no ring layers, unlike :mod:`genjax.cache.ring` in the float cache of ``generate``).

Block 0 is a scratch block: table entries of blocks not allocated (and every entry of an unused
row) are 0, so writes beyond a row's blocks land there and reads from there are hidden by the
causal mask. The allocator (:class:`genjax.serving.BlockAllocator`) never hands block 0 out.

Example: ``block_size = 4``, a row of 6 tokens owning blocks 3 and 1::

    table      [3, 1, 0, 0]                      (0: scratch, not allocated)
    logical    0 1 2 3 | 4 5 . . | . . . . | . . . .
    pool slot  3:0..3  | 1:0..1

Static or traced:
    Static: the number of layers, ``num_blocks``, ``block_size``, ``max_blocks_per_row``, the
    batch, the head count and size, the dtype (array shapes). Traced: the pool contents, the block
    tables and ``index``.

References:
    Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
    PagedAttention", arXiv:2309.06180.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from genjax.cache.kv import replace_layer
from genjax.typing import Array

SCRATCH_BLOCK = 0
"""The block that unallocated table entries point at; never handed to a request."""


@struct.dataclass
class PagedKVCache:
    """Block pools of all layers, with each row's block table and write index.

    Example:
        >>> cache = PagedKVCache.create(num_layers=2, num_blocks=8, block_size=4,
        ...                             max_blocks_per_row=3, batch=2, num_kv_heads=1, head_dim=2)
        >>> cache.keys[0].shape, cache.values[0].shape, cache.length, cache.batch
        ((8, 1, 2, 4), (8, 1, 4, 2), 12, 2)
    """

    keys: tuple[Array, ...]  # L x float[num_blocks, K, H, block_size]: slots last, as KVCache
    values: tuple[Array, ...]  # L x float[num_blocks, K, block_size, H]
    block_tables: Array  # int32[B, max_blocks_per_row]: pool block of each logical block
    index: Array  # int32[B]: per row, the first logical slot not yet written

    @classmethod
    def create(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        max_blocks_per_row: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype = jnp.float32,
    ) -> PagedKVCache:
        """Returns an empty cache: zero pools, every table entry the scratch block, index 0."""
        key_shape = (num_blocks, num_kv_heads, head_dim, block_size)
        value_shape = (num_blocks, num_kv_heads, block_size, head_dim)
        return cls(
            keys=tuple(jnp.zeros(key_shape, dtype) for _ in range(num_layers)),
            values=tuple(jnp.zeros(value_shape, dtype) for _ in range(num_layers)),
            block_tables=jnp.full((batch, max_blocks_per_row), SCRATCH_BLOCK, jnp.int32),
            index=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def block_size(self) -> int:
        """Slots per block (static)."""
        return self.values[0].shape[2]

    @property
    def num_blocks(self) -> int:
        """Blocks in each layer's pool, the scratch block included (static)."""
        return self.values[0].shape[0]

    @property
    def max_blocks_per_row(self) -> int:
        """The longest block table (static)."""
        return self.block_tables.shape[1]

    @property
    def length(self) -> int:
        """``S``: the logical slots of a row, ``max_blocks_per_row * block_size`` (static)."""
        return self.max_blocks_per_row * self.block_size

    @property
    def batch(self) -> int:
        """The number of rows ``B`` (static)."""
        return self.block_tables.shape[0]

    def ring_slots(self, layer: int) -> None:
        """None: no layer is a ring (see the module docstring)."""
        return None

    def _write_slots(self, count: int) -> tuple[Array, Array]:
        """Pool block and offset of each of the ``count`` slots from each row's index.

        Returns:
            ``(block, offset)``, int32[B * count] each; slots past the table go to the scratch
            block.
        """
        slots = self.index[:, None] + jnp.arange(count)[None, :]  # [B, T]
        logical = slots // self.block_size
        inside = logical < self.max_blocks_per_row
        clipped = jnp.minimum(logical, self.max_blocks_per_row - 1)
        block = jnp.take_along_axis(self.block_tables, clipped, axis=1)
        block = jnp.where(inside, block, SCRATCH_BLOCK)
        offset = jnp.where(inside, slots % self.block_size, 0)
        return block.reshape(-1), offset.reshape(-1)

    def update_layer(
        self, layer: int, new_keys: Array, new_values: Array
    ) -> tuple[Array, Array, PagedKVCache]:
        """Writes ``T`` new slots of one layer at each row's ``index``; does not advance it.

        Args:
            layer: the layer number (a Python int).
            new_keys: float[B, T, K, H].
            new_values: float[B, T, K, H].

        Returns:
            ``(keys, values, cache)``: the layer's keys float[B, K, H, S] and values
            float[B, K, S, H] in logical slot order after the write, and the cache holding them.
        """
        batch, count, heads, dim = new_keys.shape
        block, offset = self._write_slots(count)
        pool_k, pool_v = self.keys[layer], self.values[layer]
        flat_k = new_keys.reshape(batch * count, heads, dim).astype(pool_k.dtype)
        flat_v = new_values.reshape(batch * count, heads, dim).astype(pool_v.dtype)
        pool_k = pool_k.at[block, :, :, offset].set(flat_k)  # [B*T, K, H] at (block, :, :, off)
        pool_v = pool_v.at[block, :, offset, :].set(flat_v)
        keys = pool_k[self.block_tables]  # [B, M, K, H, bs]
        keys = keys.transpose(0, 2, 3, 1, 4).reshape(batch, heads, dim, self.length)
        values = pool_v[self.block_tables]  # [B, M, K, bs, H]
        values = values.transpose(0, 2, 1, 3, 4).reshape(batch, heads, self.length, dim)
        cache = self.replace(
            keys=replace_layer(self.keys, layer, pool_k),
            values=replace_layer(self.values, layer, pool_v),
        )
        return keys, values, cache

    def advance(self, num_slots: int | Array) -> PagedKVCache:
        """Returns the cache with every row's ``index`` moved forward by ``num_slots``."""
        return self.replace(index=self.index + jnp.asarray(num_slots, jnp.int32))

    def select_rows(self, rows: Array) -> PagedKVCache:
        """The cache seen by rows ``rows`` (int32[B']) alone: the same pools, their tables and
        indices. Write into it, then hand the pools back with :meth:`merge_rows`."""
        return self.replace(block_tables=self.block_tables[rows], index=self.index[rows])

    def merge_rows(self, rows: Array, part: PagedKVCache) -> PagedKVCache:
        """Takes the pools of ``part`` (made by :meth:`select_rows`) and its rows' indices."""
        return self.replace(
            keys=part.keys, values=part.values, index=self.index.at[rows].set(part.index)
        )
