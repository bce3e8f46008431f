"""The cache of an encoder-decoder model: decoder self-attention slots plus cross-attention blocks.

An encoder-decoder model (T5, BART, Marian) runs its encoder once over the source, then its
decoder step by step. The decoder's self-attention keys and values grow one slot per step, as in
a decoder-only model (:class:`~genjax.cache.KVCache`); the cross-attention keys and values are
projections of the encoder output, computed once after the encoder (by the model's
``init_cache``) and only read afterwards, with the encoder's padding mask beside them.

Rows and prompts (the hook for beams and ``num_return_sequences``)::

    prompts (encoder rows)  p0            p1
    decoder rows            r0 r1 r2      r3 r4 r5      rows_per_prompt = 3

The cross blocks hold one entry per prompt (``B / R`` rows), never one per decoder row: decoder
row ``b`` reads prompt ``b // rows_per_prompt``. :meth:`repeat_rows` (beams, return sequences)
multiplies ``rows_per_prompt`` and copies only the self-attention slots; :meth:`gather_beams`
reorders rows within each prompt, so the cross blocks stay as they are. Models fold the
``rows_per_prompt`` rows of a prompt into the query axis of one attention call
(:func:`fold_rows`), a reshape rather than a gather, so no per-row copy of the encoder states
is ever made. Only :meth:`gather_rows` (an arbitrary reordering, which may mix prompts) gathers
the cross blocks into one entry per row.

Static or traced:
    Static: every shape (layers, ``B``, ``S``, the source length ``Se``, heads, head dimension,
    dtype) and ``rows_per_prompt``. Traced: the contents, the write index and the encoder mask.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from genjax.cache.kv import KVCache
from genjax.typing import Array


@struct.dataclass
class EncoderDecoderCache:
    """Decoder self-attention slots, per-prompt cross-attention blocks and the encoder mask.

    Example:
        >>> self_cache = KVCache.create(num_layers=1, batch=2, length=4, num_kv_heads=2, head_dim=3)
        >>> cross = (jnp.zeros((1, 2, 3, 5)),), (jnp.zeros((1, 2, 5, 3)),)
        >>> cache = EncoderDecoderCache(self_cache, *cross, jnp.ones((1, 5), jnp.int32), 2)
        >>> cache.batch, cache.num_prompts, cache.source_length
        (2, 1, 5)
    """

    self_attention: KVCache  # decoder self-attention: L x float[B, K, H, S] / [B, K, S, H]
    cross_keys: tuple[Array, ...]  # L x float[B / R, K, H, Se]: slots last, as KVCache's keys
    cross_values: tuple[Array, ...]  # L x float[B / R, K, Se, H]
    encoder_mask: Array  # int32[B / R, Se]: nonzero where the source holds a real token
    rows_per_prompt: int = struct.field(pytree_node=False, default=1)  # R: rows per cross entry

    @property
    def index(self) -> Array:
        """int32[]: the first decoder slot not yet written."""
        return self.self_attention.index

    @property
    def length(self) -> int:
        """``S``, the decoder slots (static)."""
        return self.self_attention.length

    @property
    def batch(self) -> int:
        """``B``, the decoder rows (static)."""
        return self.self_attention.batch

    @property
    def num_prompts(self) -> int:
        """``B / R``, the rows of the cross blocks (static)."""
        return self.encoder_mask.shape[0]

    @property
    def source_length(self) -> int:
        """``Se``, the encoder positions (static)."""
        return self.encoder_mask.shape[1]

    def update_layer(self, layer: int, new_keys: Array, new_values: Array):
        """Writes a layer's new self-attention slots (:meth:`KVCache.update_layer`).

        Returns:
            ``(keys, values, cache)``.
        """
        keys, values, inner = self.self_attention.update_layer(layer, new_keys, new_values)
        return keys, values, self.replace(self_attention=inner)

    def advance(self, num_slots) -> EncoderDecoderCache:
        """The cache with the decoder write index moved forward by ``num_slots``."""
        return self.replace(self_attention=self.self_attention.advance(num_slots))

    def with_length(self, length: int) -> EncoderDecoderCache:
        """The cache with ``length`` (static) decoder slots; the cross blocks are unchanged."""
        return self.replace(self_attention=self.self_attention.with_length(length))

    def repeat_rows(self, count: int) -> EncoderDecoderCache:
        """Each decoder row repeated ``count`` (static) times in place; the cross blocks stay one
        per prompt and ``rows_per_prompt`` is multiplied by ``count``."""
        return self.replace(
            self_attention=self.self_attention.repeat_rows(count),
            rows_per_prompt=self.rows_per_prompt * count,
        )

    def gather_beams(self, beams: Array) -> EncoderDecoderCache:
        """Reorders decoder rows within each prompt (:meth:`KVCache.gather_beams`); beams of one
        prompt share its cross blocks, so only the self-attention slots move."""
        return self.replace(self_attention=self.self_attention.gather_beams(beams))

    def gather_rows(self, rows: Array) -> EncoderDecoderCache:
        """Decoder rows reordered or repeated by ``rows`` (int32[B']); each row's cross entry
        comes along, so the result holds one cross entry per row (``rows_per_prompt = 1``)."""
        prompts = rows // self.rows_per_prompt
        return EncoderDecoderCache(
            self_attention=self.self_attention.gather_rows(rows),
            cross_keys=tuple(x[prompts] for x in self.cross_keys),
            cross_values=tuple(x[prompts] for x in self.cross_values),
            encoder_mask=self.encoder_mask[prompts],
            rows_per_prompt=1,
        )

    def cross_bias(self, dtype: jnp.dtype = jnp.float32) -> Array:
        """float[B / R, 1, 1, Se]: 0 where the source holds a real token, else the dtype's lowest
        finite value (a row of padding only gives no NaN)."""
        allowed = self.encoder_mask[:, None, None, :] != 0
        return jnp.where(allowed, 0.0, jnp.finfo(dtype).min).astype(dtype)


def fold_rows(x: Array, rows_per_prompt: int) -> Array:
    """``[B, T, ...]`` -> ``[B / R, R * T, ...]``: a prompt's rows as one block of queries."""
    batch, length = x.shape[:2]
    return x.reshape(batch // rows_per_prompt, rows_per_prompt * length, *x.shape[2:])


def unfold_rows(x: Array, rows_per_prompt: int) -> Array:
    """The inverse of :func:`fold_rows`: ``[B / R, R * T, ...]`` -> ``[B, T, ...]``."""
    prompts, folded = x.shape[:2]
    return x.reshape(prompts * rows_per_prompt, folded // rows_per_prompt, *x.shape[2:])
