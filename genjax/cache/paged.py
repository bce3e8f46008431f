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

An int8 pool (``create(..., quantized=True)``; the engine's ``kv_cache_dtype="int8"``) stores
each layer's keys and values as int8 codes in the same layouts, with one symmetric absmax scale
per head vector of one slot (``key_scales`` and ``value_scales`` float[num_blocks, K,
block_size], in the float dtype; :func:`genjax.cache.quantized.quantize`): a block costs
``2 * K * block_size * (H + itemsize)`` bytes per layer against ``2 * K * block_size * H *
itemsize``, about half of bfloat16 and a quarter of float32 (``H = 64``: 51.6% and 26.6%).
``update_layer`` quantizes the ``T`` new slots as it writes them and returns the rows' blocks
dequantized, except those ``T`` slots, which hold the exact new keys and values: the tokens of
one call attend to themselves in full precision, as in :class:`~genjax.cache.QuantizedKVCache`,
whose numbers it reproduces slot for slot.

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
    batch, the head count and size, the dtype and whether the pool is int8 (array shapes and
    dtypes). Traced: the pool contents (codes and scales), the block tables and ``index``.

References:
    Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
    PagedAttention", arXiv:2309.06180.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from genjax.cache.gathered import GatheredKVCache
from genjax.cache.kv import replace_layer
from genjax.cache.paged_blocks import PagedBlocks
from genjax.cache.quantized import dequantize, quantize
from genjax.kernels import attention as attention_kernel
from genjax.kernels import cache_writes
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
        >>> int8 = PagedKVCache.create(2, 8, 4, 3, 2, 1, 2, quantized=True)
        >>> int8.keys[0].dtype, int8.key_scales[0].shape, int8.dtype
        (dtype('int8'), (8, 1, 4), dtype('float32'))
    """

    keys: tuple[Array, ...]  # L x float[num_blocks, K, H, block_size]: slots last, as KVCache
    #   (int8 codes in an int8 pool)
    values: tuple[Array, ...]  # L x float[num_blocks, K, block_size, H] (int8 codes likewise)
    block_tables: Array  # int32[B, max_blocks_per_row]: pool block of each logical block
    index: Array  # int32[B]: per row, the first logical slot not yet written
    key_scales: tuple[Array, ...] = ()  # int8 pool: L x float[num_blocks, K, block_size],
    #   max |key| / 127 per slot and KV head (0 never written); float pool: ()
    value_scales: tuple[Array, ...] = ()  # int8 pool: L x float[num_blocks, K, block_size]

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
        quantized: bool = False,
    ) -> PagedKVCache:
        """Returns an empty cache: zero pools, every table entry the scratch block, index 0.

        ``dtype`` is the float dtype of the pools, or with ``quantized`` (static) of the scales
        and of the blocks ``update_layer`` returns, the codes being int8."""
        key_shape = (num_blocks, num_kv_heads, head_dim, block_size)
        value_shape = (num_blocks, num_kv_heads, block_size, head_dim)
        layers = range(num_layers)
        pool = jnp.int8 if quantized else dtype
        scales = tuple(jnp.zeros(value_shape[:-1], dtype) for _ in layers) if quantized else ()
        return cls(
            keys=tuple(jnp.zeros(key_shape, pool) for _ in layers),
            values=tuple(jnp.zeros(value_shape, pool) for _ in layers),
            block_tables=jnp.full((batch, max_blocks_per_row), SCRATCH_BLOCK, jnp.int32),
            index=jnp.zeros((batch,), jnp.int32),
            key_scales=scales,
            value_scales=tuple(jnp.zeros_like(x) for x in scales),
        )

    @property
    def quantized(self) -> bool:
        """Whether the pools hold int8 codes with scales (static)."""
        return bool(self.key_scales)

    @property
    def dtype(self) -> jnp.dtype:
        """The float dtype of the blocks ``update_layer`` returns: the pools', or in an int8
        pool the scales' (static)."""
        return (self.value_scales if self.quantized else self.values)[0].dtype

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
        return self._pool_slots(slots, jnp.ones(slots.shape, bool))

    def _pool_slots(self, slots: Array, write: Array) -> tuple[Array, Array]:
        """Pool block and offset of logical ``slots`` int32[B, T]; slots past the table, and
        those where ``write`` bool[B, T] is False, go to the scratch block.

        Returns:
            ``(block, offset)``, int32[B * T] each.
        """
        logical = slots // self.block_size
        inside = (logical < self.max_blocks_per_row) & write
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
            float[B, K, S, H] in logical slot order after the write (in an int8 pool
            dequantized, except the ``T`` new slots of each row, which hold ``new_keys`` and
            ``new_values`` exactly), and the cache holding them.
        """
        batch, count, heads, dim = new_keys.shape
        if not self.quantized:
            block, offset = self._write_slots(count)
            flat_k = new_keys.reshape(batch * count, heads, dim).astype(self.dtype)
            flat_v = new_values.reshape(batch * count, heads, dim).astype(self.dtype)
            pool_k, pool_v = self.keys[layer], self.values[layer]
            if cache_writes.applies(pool_k):  # 16-bit: in place (XLA:CPU copies the pool)
                pool_k = cache_writes.write_pages(pool_k, flat_k, block, offset, keys=True)
                pool_v = cache_writes.write_pages(pool_v, flat_v, block, offset, keys=False)
            else:
                pool_k = pool_k.at[block, :, :, offset].set(flat_k)  # [B*T, K, H] at
                pool_v = pool_v.at[block, :, offset, :].set(flat_v)  # (block, :, :, off)
            if count == 1 and attention_kernel.applies(pool_k, pool_v):  # read in place
                tables = self.block_tables
                keys = PagedBlocks(pool_k, tables, keys=True)
                values = PagedBlocks(pool_v, tables, keys=False)
            else:
                keys, values = self._gather(pool_k, pool_v)
            cache = self.replace(
                keys=replace_layer(self.keys, layer, pool_k),
                values=replace_layer(self.values, layer, pool_v),
            )
            return keys, values, cache
        cache = self.write_codes(layer, new_keys, new_values)
        pool_k, pool_v = cache.keys[layer], cache.values[layer]
        keys, values = self._gather(
            pool_k, pool_v, cache.key_scales[layer], cache.value_scales[layer]
        )
        # The call's own slots: exact (mode="drop": slots past S exist only in the scratch block).
        rows = jnp.arange(batch)[:, None]  # [B, 1]
        slots = self.index[:, None] + jnp.arange(count)[None, :]  # [B, T]
        exact_k, exact_v = new_keys.astype(self.dtype), new_values.astype(self.dtype)
        keys = keys.at[rows, :, :, slots].set(exact_k, mode="drop")  # [B, T, K, H] at (b, s)
        values = values.at[rows, :, slots, :].set(exact_v, mode="drop")
        return keys, values, cache

    def write_codes(self, layer: int, new_keys: Array, new_values: Array) -> PagedKVCache:
        """An int8 pool with ``T`` new slots of one layer quantized and written at each row's
        ``index`` (not advanced); new_keys and new_values float[B, T, K, H]."""
        batch, count, heads, dim = new_keys.shape
        block, offset = self._write_slots(count)
        flat_k = new_keys.reshape(batch * count, heads, dim).astype(self.dtype)
        flat_v = new_values.reshape(batch * count, heads, dim).astype(self.dtype)
        codes_k, scales_k = quantize(flat_k, self.dtype)  # int8[B*T, K, H], float[B*T, K]
        codes_v, scales_v = quantize(flat_v, self.dtype)
        return self.replace(
            keys=replace_layer(
                self.keys, layer, self.keys[layer].at[block, :, :, offset].set(codes_k)
            ),
            values=replace_layer(
                self.values, layer, self.values[layer].at[block, :, offset, :].set(codes_v)
            ),
            key_scales=replace_layer(
                self.key_scales, layer, self.key_scales[layer].at[block, :, offset].set(scales_k)
            ),
            value_scales=replace_layer(
                self.value_scales,
                layer,
                self.value_scales[layer].at[block, :, offset].set(scales_v),
            ),
        )

    def read_slots(self, layer: int, slots: Array) -> tuple[Array, Array]:
        """An int8 pool's keys and values at logical ``slots`` int32[B, T] of each row,
        dequantized as :meth:`update_layer` returns them: float[B, T, K, H] each."""
        block, offset = self._pool_slots(slots, jnp.ones(slots.shape, bool))
        # Codes [B*T, K, H] times scales [B*T, K] in float32, the products _gather takes.
        keys = dequantize(
            self.keys[layer][block, :, :, offset],
            self.key_scales[layer][block, :, offset],
            self.dtype,
        )
        values = dequantize(
            self.values[layer][block, :, offset, :],
            self.value_scales[layer][block, :, offset],
            self.dtype,
        )
        shape = (*slots.shape, *keys.shape[1:])  # [B, T, K, H]
        return keys.reshape(shape), values.reshape(shape)

    def _gather(self, pool_k, pool_v, key_scales=None, value_scales=None) -> tuple[Array, Array]:
        """Every row's blocks in logical order: keys float[B, K, H, S] and values
        float[B, K, S, H] (codes times their scales when scales are given)."""
        if key_scales is None:
            tables = self.block_tables
            keys = PagedBlocks(pool_k, tables, keys=True).logical()
            return keys, PagedBlocks(pool_v, tables, keys=False).logical()
        batch, heads, dim = self.batch, pool_v.shape[1], pool_v.shape[3]
        keys = pool_k[self.block_tables]  # [B, M, K, H, bs]
        values = pool_v[self.block_tables]  # [B, M, K, bs, H]
        if key_scales is not None:
            key_scales = key_scales[self.block_tables][:, :, :, None, :]  # [B, M, K, 1, bs]
            keys = (keys.astype(jnp.float32) * key_scales.astype(jnp.float32)).astype(self.dtype)
            values = dequantize(values, value_scales[self.block_tables], self.dtype)
        keys = keys.transpose(0, 2, 3, 1, 4).reshape(batch, heads, dim, self.length)
        values = values.transpose(0, 2, 1, 3, 4).reshape(batch, heads, self.length, dim)
        return keys, values

    def gather(self) -> GatheredKVCache:
        """Every row's blocks copied into logical order (an int8 pool's dequantized), with the
        rows' indices: the cache a run of decode steps writes and reads in place
        (:mod:`genjax.cache.gathered`). :meth:`scatter` takes its new slots back."""
        if self.quantized:
            scales = zip(self.key_scales, self.value_scales, strict=True)
            layers = zip(self.keys, self.values, scales, strict=True)
            blocks = [self._gather(k, v, ks, vs) for k, v, (ks, vs) in layers]
        else:
            blocks = [self._gather(k, v) for k, v in zip(self.keys, self.values, strict=True)]
        return GatheredKVCache(
            keys=tuple(k for k, _ in blocks),
            values=tuple(v for _, v in blocks),
            index=self.index,
            codes=self if self.quantized else None,
        )

    def scatter(self, view: GatheredKVCache, start: Array, count: int) -> PagedKVCache:
        """Writes the slots each row of ``view`` (made by :meth:`gather`) wrote since ``start``
        back into the pools (an int8 pool: takes the codes the view wrote), and takes the view's
        indices.

        Args:
            view: the gathered cache, its ``index`` int32[B] advanced past the slots written.
            start: int32[B], each row's index when the view was gathered.
            count: the most slots a row wrote (static), ``K`` decode steps.
        """
        if self.quantized:  # the view wrote its codes into the pool as it went
            return self.with_pools(view.codes).replace(index=view.index)
        slots = start[:, None] + jnp.arange(count)[None, :]  # [B, count]
        block, offset = self._pool_slots(slots, slots < view.index[:, None])
        rows = jnp.arange(self.batch)[:, None]
        keys, values = [], []
        for layer in range(len(self.keys)):
            # [B, count, K, H] at (row, slot); slots past S read the last one and go to scratch.
            new_k = view.keys[layer].at[rows, :, :, slots].get(mode="clip")
            new_v = view.values[layer].at[rows, :, slots, :].get(mode="clip")
            flat_k, flat_v = (x.reshape(-1, *x.shape[2:]) for x in (new_k, new_v))  # [B*count,..]
            keys.append(self.keys[layer].at[block, :, :, offset].set(flat_k))
            values.append(self.values[layer].at[block, :, offset, :].set(flat_v))
        return self.replace(keys=tuple(keys), values=tuple(values), index=view.index)

    def advance(self, num_slots: int | Array) -> PagedKVCache:
        """Returns the cache with every row's ``index`` moved forward by ``num_slots``."""
        return self.replace(index=self.index + jnp.asarray(num_slots, jnp.int32))

    def with_pools(self, other: PagedKVCache) -> PagedKVCache:
        """This cache's tables and indices with the pools (codes and scales) of ``other``."""
        return self.replace(
            keys=other.keys,
            values=other.values,
            key_scales=other.key_scales,
            value_scales=other.value_scales,
        )

    def select_rows(self, rows: Array) -> PagedKVCache:
        """The cache seen by rows ``rows`` (int32[B']) alone: the same pools, their tables and
        indices. Write into it, then hand the pools back with :meth:`merge_rows`."""
        return self.replace(block_tables=self.block_tables[rows], index=self.index[rows])

    def merge_rows(self, rows: Array, part: PagedKVCache) -> PagedKVCache:
        """Takes the pools of ``part`` (made by :meth:`select_rows`) and its rows' indices; a
        row number past the batch (a part's row that stands for none) keeps no index."""
        index = self.index.at[rows].set(part.index, mode="drop")
        return self.with_pools(part).replace(index=index)
