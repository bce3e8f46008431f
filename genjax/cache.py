"""Key/value caches as immutable pytrees, preallocated to their final length.

A cache holds the keys and values of every layer for ``S`` sequence slots, and the index of the
next slot to write. Models read a layer's full ``[B, K, S, H]`` block and write the ``T`` new
slots of a call at ``index``; ``advance`` moves the index once every layer has written.

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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from genjax.typing import Array


@struct.dataclass
class KVCache:
    """Keys and values of all layers, with the next slot to write.

    Example:
        >>> cache = KVCache.create(num_layers=2, batch=1, length=16, num_kv_heads=2, head_dim=4)
        >>> cache.keys.shape
        (2, 1, 2, 16, 4)
    """

    keys: Array  # float[L, B, K, S, H]: heads before slots, as attention reads them
    values: Array  # float[L, B, K, S, H]
    index: Array  # int32[]: the first slot not yet written

    @classmethod
    def create(
        cls,
        num_layers: int,
        batch: int,
        length: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype = jnp.float32,
    ) -> KVCache:
        """Returns an empty cache of ``length`` slots, filled with zeros, index 0."""
        shape = (num_layers, batch, num_kv_heads, length, head_dim)
        return cls(
            keys=jnp.zeros(shape, dtype),
            values=jnp.zeros(shape, dtype),
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def length(self) -> int:
        """The number of slots ``S`` (static)."""
        return self.keys.shape[3]

    def update_layer(
        self, layer: int, new_keys: Array, new_values: Array
    ) -> tuple[Array, Array, KVCache]:
        """Writes ``T`` new slots of one layer at ``index``; does not advance the index.

        Args:
            layer: the layer number (a Python int).
            new_keys: float[B, T, K, H].
            new_values: float[B, T, K, H].

        Returns:
            ``(keys, values, cache)``: the layer's full float[B, K, S, H] keys and values after the
            write, and the cache holding them.
        """
        start = (layer, 0, 0, self.index, 0)
        keys = jax.lax.dynamic_update_slice(
            self.keys, heads_first(new_keys)[None].astype(self.keys.dtype), start
        )
        values = jax.lax.dynamic_update_slice(
            self.values, heads_first(new_values)[None].astype(self.values.dtype), start
        )
        return keys[layer], values[layer], self.replace(keys=keys, values=values)

    def advance(self, num_slots: int | Array) -> KVCache:
        """Returns the cache with ``index`` moved forward by ``num_slots``."""
        return self.replace(index=self.index + jnp.asarray(num_slots, jnp.int32))

    def gather_rows(self, rows: Array) -> KVCache:
        """Returns the cache with batch rows reordered or repeated by ``rows`` (int32[B'])."""
        return self.replace(keys=self.keys[:, rows], values=self.values[:, rows])

    def repeat_rows(self, count: int) -> KVCache:
        """Returns the cache with each row repeated ``count`` (static) times in place: row ``b``
        becomes rows ``b * count .. b * count + count - 1``. A broadcast and reshape, so rows
        sharded over devices stay where they are (unlike :meth:`gather_rows`)."""
        return self.replace(
            keys=repeat_rows(self.keys, count), values=repeat_rows(self.values, count)
        )

    def gather_beams(self, beams: Array) -> KVCache:
        """Reorders the rows of each prompt: row ``b * M + m`` takes row ``b * M + beams[b, m]``.

        Args:
            beams: int32[B, M]: for each prompt ``b``, the source beam of each new beam.

        The gather runs per prompt (``B`` is a batch dimension of it), so with rows sharded by
        prompt every device gathers its own rows and nothing moves between devices.
        """
        return self.replace(
            keys=gather_beams(self.keys, beams), values=gather_beams(self.values, beams)
        )


def repeat_rows(x: Array, count: int) -> Array:
    """Repeats each row of a per-layer cache array ``[L, B, ...]`` ``count`` (static) times in
    place: ``[L, B * count, ...]``, row ``b`` becoming rows ``b * count .. b * count + count - 1``.
    """
    return x if count == 1 else jnp.repeat(x, count, axis=1)


def gather_beams(x: Array, beams: Array) -> Array:
    """Reorders the rows of a per-layer cache array ``[L, B*M, ...]`` within each prompt.

    Args:
        x: any array whose axes 0 and 1 are layers and rows ``B*M`` (keys ``[L, B*M, K, S, H]``,
            or a quantized cache's scales ``[L, B*M, S, K]``).
        beams: int32[B, M]: row ``b * M + m`` takes row ``b * M + beams[b, m]``.
    """
    batch, num_beams = beams.shape
    x = x.reshape(x.shape[0], batch, num_beams, *x.shape[2:])  # [L, B, M, ...]
    x = jax.vmap(lambda xb, ib: xb[:, ib], in_axes=(1, 0), out_axes=1)(x, beams)
    return x.reshape(x.shape[0], batch * num_beams, *x.shape[3:])


def heads_first(x: Array) -> Array:
    """``[B, T, K, ...]`` -> ``[B, K, T, ...]``: new slots in the cache's axis order."""
    return jnp.swapaxes(x, 1, 2)


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
        cache_index: int32[], the slot of the first query.
        query_length: ``T`` (static).
        dtype: the dtype of the returned bias.
        sliding_window: the window ``W`` (static), or None for full attention.

    Returns:
        float[B, 1, T, S]: 0 where attention is allowed, the dtype's lowest finite value where it
        is not (finite, so rows that see nothing, like padding queries, give no NaN).
    """
    length = attention_mask.shape[-1]
    query_slots = cache_index + jnp.arange(query_length)[:, None]  # [T, 1]
    key_slots = jnp.arange(length)[None, :]  # [1, S]
    allowed = key_slots <= query_slots  # [T, S]
    if sliding_window is not None:
        allowed = allowed & (query_slots - key_slots < sliding_window)
    allowed = allowed[None, None] & (attention_mask[:, None, None, :] != 0)  # [B, 1, T, S]
    return jnp.where(allowed, 0.0, jnp.finfo(dtype).min).astype(dtype)
