"""Key/value caches as immutable pytrees, preallocated to their final length.

A cache holds the keys and values of every layer for ``S`` sequence slots, and the index of the
next slot to write. Models write the ``T`` new slots of a call at ``index`` and read the layer's
full blocks back (keys ``[B, K, H, S]``, values ``[B, K, S, H]``); ``advance`` moves the index
once every layer has written.

Keys are stored with the slots last, ``[B, K, H, S]``, so that both attention sums over the
cache run along an axis that is not the minor one: the scores ``q . k`` sum over ``H`` of the
keys ``[H, S]`` and the weighted sum over ``S`` of the values ``[S, H]``, each as a multiply and
a sum that reads the block once, in place (:func:`genjax.models.attention.attention`). With keys
``[B, K, S, H]`` the one-token scores are a product XLA:CPU takes with the slots minor, so at
batch 1 it transposes every layer's keys and copies them on each decode step; that costs most
where the model is small and the copies are a large share of a step (figures in
``bench/README.md``).

Each layer has its own arrays (a tuple of ``L`` blocks, not one stacked ``[L, ...]`` array): a
layer's block is then a whole buffer that attention reads in place after the write. Slicing a
layer out of a stacked array copies it on XLA:CPU, every layer of every step, and at large
batches those copies cost about as much as the attention itself.

Static or traced:
    Static: the number of layers, the batch size, the cache length ``S``, the number of key/value
    heads, the head dimension and the dtype (they are array shapes).
    Traced: the contents and ``index``.

Slot bookkeeping for a left-padded batch of two prompts (``.`` = padding, ``S = 8``)::

    slot   0 1 2 3 4 5 6 7
    row 0  . . a b c | | |      prefill writes slots 0..4, index -> 5
    row 1  d e f g h | | |      decoding writes slot 5, then 6, then 7

Every row writes the same slot on each call, so an update is one ``dynamic_update_slice``; the
attention mask tells models which slots hold real tokens.

Sliding-window layers: a cache created with the model's per-layer ``windows`` keeps a layer of
window ``W`` as a ring of ``R = W + margin`` slots when ``R < S`` (:mod:`genjax.cache.ring`:
logical slot ``p`` at ring slot ``p mod R``); its other layers keep ``S``. ``index``, ``length``
and the attention mask stay logical (``S`` slots), so callers see the same cache either way;
only the layer blocks differ, and :func:`genjax.cache.ring.ring_bias` gives those layers' bias.
Which layers are rings is static (the windows, ``S`` and the margin); the write position
``index mod R`` is traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from genjax.cache.ring import relayout, ring_size, ring_update
from genjax.kernels import cache_writes
from genjax.typing import Array


@struct.dataclass
class KVCache:
    """Keys and values of all layers, with the next slot to write.

    Example:
        >>> cache = KVCache.create(num_layers=2, batch=1, length=16, num_kv_heads=2, head_dim=4)
        >>> len(cache.keys), cache.keys[0].shape, cache.values[0].shape
        (2, (1, 2, 4, 16), (1, 2, 16, 4))
        >>> ring = KVCache.create(2, 1, 16, 2, 4, windows=(4, None))  # layer 0: a 4-slot ring
        >>> ring.keys[0].shape, ring.keys[1].shape, ring.length, ring.ring_slots(0)
        ((1, 2, 4, 4), (1, 2, 4, 16), 16, 4)
    """

    keys: tuple[Array, ...]  # L x float[B, K, H, S or R]: slots last (see the module docstring)
    values: tuple[Array, ...]  # L x float[B, K, S or R, H]
    index: Array  # int32[]: the first slot not yet written
    # Static: per layer the sliding window W or None (empty: no windows); what with_length
    # turns into rings.
    windows: tuple[int | None, ...] = struct.field(pytree_node=False, default=())
    # Static: the logical length S when some layer is a ring (its blocks are shorter), else 0.
    span: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def create(
        cls,
        num_layers: int,
        batch: int,
        length: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype = jnp.float32,
        windows: tuple[int | None, ...] = (),
        margin: int = 0,
    ) -> KVCache:
        """Returns an empty cache of ``length`` slots, filled with zeros, index 0.

        Args:
            windows: per layer the sliding window ``W`` or None (static; empty: none). A layer
                with ``W + margin < length`` gets a ring of ``W + margin`` slots.
            margin: extra ring slots for slots written and then taken back (static, see
                :mod:`genjax.cache.ring`).
        """
        windows = tuple(windows)
        rings = _rings(windows, num_layers, length, margin)
        sizes = [length if ring is None else ring for ring in rings]
        return cls(
            keys=tuple(jnp.zeros((batch, num_kv_heads, head_dim, n), dtype) for n in sizes),
            values=tuple(jnp.zeros((batch, num_kv_heads, n, head_dim), dtype) for n in sizes),
            index=jnp.zeros((), jnp.int32),
            windows=windows,
            span=length if any(rings) else 0,
        )

    @property
    def length(self) -> int:
        """The number of logical slots ``S`` (static); ring layers hold fewer."""
        return self.span or self.values[0].shape[2]

    def ring_slots(self, layer: int) -> int | None:
        """The ring size ``R`` of ``layer`` (a Python int), or None for the full layout; static.
        A ring layer's blocks hold ``R`` slots (:mod:`genjax.cache.ring`)."""
        slots = self.values[layer].shape[2]
        return slots if self.span and slots < self.span else None

    @property
    def batch(self) -> int:
        """The number of rows ``B`` (static)."""
        return self.keys[0].shape[0]

    def update_layer(
        self, layer: int, new_keys: Array, new_values: Array
    ) -> tuple[Array, Array, KVCache]:
        """Writes ``T`` new slots of one layer at ``index``; does not advance the index.

        Args:
            layer: the layer number (a Python int).
            new_keys: float[B, T, K, H].
            new_values: float[B, T, K, H].

        Returns:
            ``(keys, values, cache)``: the layer's full keys float[B, K, H, S] and values
            float[B, K, S, H] after the write, and the cache holding them. For a ring layer
            the slot axis is that of :func:`genjax.cache.ring.ring_update` (``R`` or
            ``R + T``), the order :func:`genjax.cache.ring.ring_bias` masks.
        """
        keys, values = self.keys[layer], self.values[layer]
        new_keys = slots_last(new_keys).astype(keys.dtype)
        new_values = heads_first(new_values).astype(values.dtype)
        if self.ring_slots(layer) is None:
            keys = write_slots(keys, new_keys, self.index, axis=3)
            values = write_slots(values, new_values, self.index, axis=2)
            read_keys, read_values = keys, values
        else:
            read_keys, keys = ring_update(keys, new_keys, self.index, axis=3)
            read_values, values = ring_update(values, new_values, self.index, axis=2)
        cache = self.replace(
            keys=replace_layer(self.keys, layer, keys),
            values=replace_layer(self.values, layer, values),
        )
        return read_keys, read_values, cache

    def with_length(self, length: int, margin: int = 0, ring: bool = True) -> KVCache:
        """Returns the cache grown to ``length`` (static) slots: the same slots and index, then
        empty (zero) slots. ``generate`` prefills a prompt into a cache of the prompt's own
        length, so that its attention reads only those slots, and grows it for decoding.

        Layers with a window ``W`` become rings of ``W + margin`` slots where that is less than
        ``length`` (all static; ``ring=False``: every layer full), holding the ``W + margin``
        slots before ``index`` (a gather, once); other layers get zero slots appended.
        """
        rings = _rings(self.windows if ring else (), len(self.values), length, margin)
        if not any(rings) and not self.span:
            return self.replace(
                keys=tuple(grow_slots(x, length, axis=3) for x in self.keys),
                values=tuple(grow_slots(x, length) for x in self.values),
            )
        keys, values = [], []
        for layer, target in enumerate(rings):
            source = self.ring_slots(layer)
            for blocks, out, axis in ((self.keys, keys, 3), (self.values, values, 2)):
                block = blocks[layer]
                if source is None and target is None:
                    block = grow_slots(block, length, axis=axis)
                elif source != target:
                    block = relayout(block, axis, self.index, length, source, target)
                out.append(block)
        span = length if any(rings) else 0
        return self.replace(keys=tuple(keys), values=tuple(values), span=span)

    def advance(self, num_slots: int | Array) -> KVCache:
        """Returns the cache with ``index`` moved forward by ``num_slots``."""
        return self.replace(index=self.index + jnp.asarray(num_slots, jnp.int32))

    def gather_rows(self, rows: Array) -> KVCache:
        """Returns the cache with batch rows reordered or repeated by ``rows`` (int32[B'])."""
        return self.replace(
            keys=tuple(x[rows] for x in self.keys), values=tuple(x[rows] for x in self.values)
        )

    def repeat_rows(self, count: int) -> KVCache:
        """Returns the cache with each row repeated ``count`` (static) times in place: row ``b``
        becomes rows ``b * count .. b * count + count - 1``. A broadcast and reshape, so rows
        sharded over devices stay where they are (unlike :meth:`gather_rows`)."""
        return self.replace(
            keys=tuple(repeat_rows(x, count) for x in self.keys),
            values=tuple(repeat_rows(x, count) for x in self.values),
        )

    def gather_beams(self, beams: Array) -> KVCache:
        """Reorders the rows of each prompt: row ``b * M + m`` takes row ``b * M + beams[b, m]``.

        Args:
            beams: int32[B, M]: for each prompt ``b``, the source beam of each new beam.

        The gather runs per prompt (``B`` is a batch dimension of it), so with rows sharded by
        prompt every device gathers its own rows and nothing moves between devices.
        """
        return self.replace(
            keys=tuple(gather_beams(x, beams) for x in self.keys),
            values=tuple(gather_beams(x, beams) for x in self.values),
        )


def _rings(windows, num_layers: int, length: int, margin: int) -> tuple[int | None, ...]:
    """Per layer the ring size or None (:func:`genjax.cache.ring.ring_size`); static."""
    windows = tuple(windows) or (None,) * num_layers
    if len(windows) != num_layers:
        raise ValueError(f"windows has {len(windows)} entries for {num_layers} layers.")
    return tuple(ring_size(w, length, margin) for w in windows)


def grow_slots(block: Array, length: int, axis: int = 2) -> Array:
    """``block`` with zero slots appended on its slot axis (``[B, K, S, ...]``: 2; keys
    ``[B, K, H, S]``: 3) up to ``length`` slots."""
    extra = length - block.shape[axis]
    if extra < 0:
        raise ValueError(f"cannot shrink a cache of {block.shape[axis]} slots to {length}.")
    widths = [(0, 0)] * block.ndim
    widths[axis] = (0, extra)
    return jnp.pad(block, widths)


def write_slots(block: Array, new: Array, index: Array, axis: int) -> Array:
    """``block`` with ``new`` written at slot ``index`` of ``axis`` (static), as
    ``dynamic_update_slice`` writes it (the index clamped so that ``new`` fits).

    XLA:CPU computes a bfloat16 or float16 update in float32: it widens the whole block,
    writes the slots and narrows it back, four passes over each layer's cache per decode step
    where float32 writes in place. On the CPU genjax's kernel writes 16-bit blocks in place
    (:mod:`genjax.kernels.cache_writes`); elsewhere the 16-bit integer bits are written, which
    XLA copies once but never widens. Same values on every path.
    """
    if cache_writes.applies(block):
        return cache_writes.write_slots(block, new, index, axis)
    starts = tuple(index if d == axis else 0 for d in range(block.ndim))
    if not jnp.issubdtype(block.dtype, jnp.floating) or jnp.finfo(block.dtype).bits != 16:
        return jax.lax.dynamic_update_slice(block, new.astype(block.dtype), starts)
    bits = jax.lax.bitcast_convert_type(block, jnp.uint16)
    new_bits = jax.lax.bitcast_convert_type(new.astype(block.dtype), jnp.uint16)
    bits = jax.lax.dynamic_update_slice(bits, new_bits, starts)
    return jax.lax.bitcast_convert_type(bits, block.dtype)


def replace_layer(blocks: tuple[Array, ...], layer: int, block: Array) -> tuple[Array, ...]:
    """``blocks`` with entry ``layer`` (a Python int) replaced by ``block``."""
    return (*blocks[:layer], block, *blocks[layer + 1 :])


def repeat_rows(x: Array, count: int) -> Array:
    """Repeats each row of one layer's cache array ``[B, ...]`` ``count`` (static) times in
    place: ``[B * count, ...]``, row ``b`` becoming rows ``b * count .. b * count + count - 1``.
    """
    return x if count == 1 else jnp.repeat(x, count, axis=0)


def gather_beams(x: Array, beams: Array) -> Array:
    """Reorders the rows of one layer's cache array ``[B*M, ...]`` within each prompt.

    Args:
        x: any array whose axis 0 is the rows ``B*M`` (keys ``[B*M, K, H, S]``, values
            ``[B*M, K, S, H]``, or a quantized cache's scales ``[B*M, K, S]``).
        beams: int32[B, M]: row ``b * M + m`` takes row ``b * M + beams[b, m]``.
    """
    batch, num_beams = beams.shape
    x = x.reshape(batch, num_beams, *x.shape[1:])  # [B, M, ...]
    x = jax.vmap(lambda xb, ib: xb[ib])(x, beams)
    return x.reshape(batch * num_beams, *x.shape[2:])


def heads_first(x: Array) -> Array:
    """``[B, T, K, ...]`` -> ``[B, K, T, ...]``: new slots in the values' axis order."""
    return jnp.swapaxes(x, 1, 2)


def slots_last(x: Array) -> Array:
    """``[B, T, K, H]`` -> ``[B, K, H, T]``: new slots in the keys' axis order."""
    return x.transpose(0, 2, 3, 1)


def attention_bias(
    attention_mask: Array,
    cache_index: Array,
    query_length: int,
    dtype: jnp.dtype = jnp.float32,
    sliding_window: int | None = None,
) -> Array:
    """Builds the additive attention bias for ``T`` queries written at ``cache_index``.

    Query ``i`` sits in slot ``cache_index + i`` and may attend to slot ``j`` when slot ``j`` holds
    a real token (``attention_mask[b, j]``), ``j <= cache_index + i`` (causal), and, with a
    sliding window ``W``, ``cache_index + i - j < W`` (as Mistral and Qwen2 define it).

    Args:
        attention_mask: int or bool[B, S], nonzero where a slot holds a real token.
        cache_index: int32[], the slot of the first query; or int32[B], one per row (a paged
            cache, :class:`genjax.cache.PagedKVCache`, whose rows hold different lengths).
        query_length: ``T`` (static).
        dtype: the dtype of the returned bias.
        sliding_window: the window ``W`` (static), or None for full attention.

    Returns:
        float[B, 1, T, S]: 0 where attention is allowed, the dtype's lowest finite value where it
        is not (finite, so rows that see nothing, like padding queries, give no NaN).
    """
    length = attention_mask.shape[-1]
    cache_index = jnp.asarray(cache_index)
    per_row = cache_index.ndim == 1
    start = cache_index[:, None, None] if per_row else cache_index  # int32[B, 1, 1] or []
    query_slots = start + jnp.arange(query_length)[:, None]  # [T, 1] or [B, T, 1]
    key_slots = jnp.arange(length)[None, :]  # [1, S]
    allowed = key_slots <= query_slots  # [T, S] or [B, T, S]
    if sliding_window is not None:
        allowed = allowed & (query_slots - key_slots < sliding_window)
    allowed = allowed[:, None] if per_row else allowed[None, None]  # [B or 1, 1, T, S]
    allowed = allowed & (attention_mask[:, None, None, :] != 0)  # [B, 1, T, S]
    return jnp.where(allowed, 0.0, jnp.finfo(dtype).min).astype(dtype)
