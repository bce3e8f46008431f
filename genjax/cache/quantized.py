"""An int8 key/value cache: ``cache_implementation="quantized"`` with ``cache_config={"nbits": 8}``.

Each key or value vector of one head (``H`` numbers: one layer, row, slot and key/value head) is
stored as ``H`` int8 codes and one scale, symmetric absmax quantization::

    scale = max_h |x_h| / 127          (in the cache's float dtype; 0 for an all-zero vector)
    code  = clip(round(x / scale), -127, 127)  as int8
    x~    = code * scale               (|x - x~| <= scale / 2 per number)

So a slot costs ``K * (H + itemsize)`` bytes per layer for keys and as much for values, against
``K * H * itemsize`` in the float cache: with ``H = 64``, 26.6% of a float32 cache and 51.6% of a
bfloat16 one (``genjax.cache.memory.cache_bytes`` gives the exact figure for a model).

:class:`QuantizedKVCache` has :class:`~genjax.cache.KVCache`'s interface, so models and decoding
loops use it unchanged: ``update_layer`` quantizes the ``T`` new slots as it writes them and
returns the layer's whole block dequantized, in which the call's own ``T`` slots hold the exact
new keys and values (the tokens of a call attend to themselves in full precision, as in
transformers' ``QuantizedCache``). Beam reordering and row repetition move codes and scales
together, so they are exact.

Differences from transformers' ``QuantizedCache`` (KIVI-style, quanto/HQQ backends):
    - one scale per head vector, symmetric, computed by genjax itself: no ``backend``, no
      ``axis_key``/``axis_value``/``q_group_size`` (rejected by name);
    - every slot is quantized when it is written: no full-precision window of the newest
      tokens (transformers' ``residual_length``, default 128; genjax accepts only 0);
    - 8 bits only (transformers' default is 4), so ``cache_config`` must say ``"nbits": 8``.

Sliding windows: this cache keeps every layer in the full layout of ``S`` slots (windows are
applied by the attention mask); only the float :class:`~genjax.cache.KVCache` keeps a windowed
layer as a ring (:mod:`genjax.cache.ring`). :func:`init_cache` builds it at the logical length.

Static or traced:
    Static: the cache shape (layers, rows, slots, key/value heads, head dimension) and the float
    dtype of the scales (= the dtype ``update_layer`` returns, the model's by default).
    Traced: the codes, the scales and ``index``.

References:
    Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache" (the idea
    of quantizing the KV cache behind transformers' ``QuantizedCache``); Dettmers et al. 2022,
    "LLM.int8()" (symmetric absmax int8 quantization of vectors).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from genjax.cache.kv import (
    KVCache,
    gather_beams,
    grow_slots,
    heads_first,
    repeat_rows,
    replace_layer,
)
from genjax.errors import GenerationConfigError, UnsupportedError
from genjax.typing import Array

NBITS = 8
_LIMIT = 2 ** (NBITS - 1) - 1  # 127: codes are symmetric, -128 is never used

# cache_implementation values whose cache genjax's preallocated float KVCache is: every cache is
# static-sized here, and sliding-window layers keep rings of W slots in every one of them (as
# transformers' hybrid and sliding-window caches do; genjax.cache.ring).
FLOAT_IMPLEMENTATIONS = (None, "static", "dynamic", "sliding_window", "hybrid", "hybrid_chunked")
_NOT_YET = {
    "offloaded": "offloading the cache to host memory",
    "offloaded_static": "offloading the cache to host memory",
    "offloaded_hybrid": "offloading the cache to host memory",
    "offloaded_hybrid_chunked": "offloading the cache to host memory",
    "paged": "a paged cache",
}
# transformers' QuantizedCache keyword -> why genjax rejects it (nbits and residual_length are
# checked by value in ``check_cache_options``).
_REJECTED_KEYS = {
    "backend": "genjax quantizes with its own symmetric absmax int8 code (no quanto/HQQ/fp8 "
    "backend)",
    "axis_key": "genjax always gives each key vector of one head (H numbers) its own scale",
    "axis_value": "genjax always gives each value vector of one head (H numbers) its own scale",
    "q_group_size": "genjax's quantization group is always one head vector of H numbers",
}


def quantize(x: Array, scale_dtype: jnp.dtype) -> tuple[Array, Array]:
    """Quantizes the last axis of ``x`` to int8 codes with one absmax scale per vector.

    Args:
        x: float[..., H].
        scale_dtype: the dtype of the returned scales (static).

    Returns:
        ``(codes int8[..., H], scales scale_dtype[...])`` with ``codes * scales ~= x`` to within
        ``scales / 2`` per number. An all-zero vector gets scale 0 and codes 0.

    Example:
        >>> codes, scales = quantize(jnp.array([[1.0, -0.5, 0.25]]), jnp.float32)
        >>> codes
        Array([[127, -64,  32]], dtype=int8)
    """
    x = x.astype(jnp.float32)
    scales = (jnp.max(jnp.abs(x), axis=-1) / _LIMIT).astype(scale_dtype)  # [...]
    # Divide by the stored (rounded) scale, so the error bound holds for what dequantize reads.
    stored = scales.astype(jnp.float32)[..., None]
    codes = jnp.round(x / jnp.where(stored > 0, stored, 1.0))
    return jnp.clip(codes, -_LIMIT, _LIMIT).astype(jnp.int8), scales


def dequantize(codes: Array, scales: Array, dtype: jnp.dtype) -> Array:
    """Returns ``codes * scales`` (int8[..., H] times scales[...]) in ``dtype`` (static).

    The product is taken in float32 (exact for bfloat16 and float16 scales) and rounded once
    to ``dtype``.
    """
    return (codes.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]).astype(dtype)


@struct.dataclass
class QuantizedKVCache:
    """Keys and values of all layers as int8 codes with one scale per head vector.

    The interface is :class:`~genjax.cache.KVCache`'s; see the module docstring for the code.

    Example:
        >>> cache = QuantizedKVCache.create(
        ...     num_layers=2, batch=1, length=16, num_kv_heads=2, head_dim=4)
        >>> cache.keys[0].dtype, len(cache.key_scales), cache.key_scales[0].shape
        (dtype('int8'), 2, (1, 2, 16))
    """

    keys: tuple[Array, ...]  # L x int8[B, K, S, H] (slots before H, unlike KVCache keys)
    values: tuple[Array, ...]  # L x int8[B, K, S, H]
    key_scales: tuple[Array, ...]  # L x float[B, K, S]: max |key| / 127 per head vector (0 unused)
    value_scales: tuple[Array, ...]  # L x float[B, K, S]
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
    ) -> QuantizedKVCache:
        """Returns an empty cache of ``length`` slots, index 0; ``dtype`` is the float dtype
        of the scales and of the blocks ``update_layer`` returns."""
        shape = (batch, num_kv_heads, length, head_dim)
        layers = range(num_layers)
        return cls(
            keys=tuple(jnp.zeros(shape, jnp.int8) for _ in layers),
            values=tuple(jnp.zeros(shape, jnp.int8) for _ in layers),
            key_scales=tuple(jnp.zeros(shape[:-1], dtype) for _ in layers),
            value_scales=tuple(jnp.zeros(shape[:-1], dtype) for _ in layers),
            index=jnp.zeros((), jnp.int32),
        )

    @classmethod
    def like(cls, cache: KVCache) -> QuantizedKVCache:
        """Returns an empty quantized cache with the shape and float dtype of ``cache`` (a
        :class:`~genjax.cache.KVCache`, or its ``jax.eval_shape``: nothing is read), every
        layer in the full layout of its logical length (ring layers included)."""
        batch, num_kv_heads, _, head_dim = cache.values[0].shape  # keys are [B, K, H, S]
        return cls.create(
            len(cache.values), batch, cache.length, num_kv_heads, head_dim, cache.values[0].dtype
        )

    @property
    def length(self) -> int:
        """The number of slots ``S`` (static)."""
        return self.keys[0].shape[2]

    @property
    def batch(self) -> int:
        """The number of rows ``B`` (static)."""
        return self.keys[0].shape[0]

    @property
    def dtype(self) -> jnp.dtype:
        """The float dtype of the scales and of the blocks ``update_layer`` returns (static)."""
        return self.key_scales[0].dtype

    def ring_slots(self, layer: int) -> None:
        """None: every layer keeps the full layout (see the module docstring)."""
        return None

    def with_length(self, length: int, margin: int = 0, ring: bool = True) -> QuantizedKVCache:
        """Returns the cache grown to ``length`` (static) slots: the same slots and index, then
        empty ones (zero codes and scales), as :meth:`genjax.cache.KVCache.with_length`.
        ``margin`` and ``ring`` are accepted for that interface and unused: no layer is a
        ring here."""
        return self.replace(
            keys=tuple(grow_slots(x, length) for x in self.keys),
            values=tuple(grow_slots(x, length) for x in self.values),
            key_scales=tuple(grow_slots(x, length) for x in self.key_scales),
            value_scales=tuple(grow_slots(x, length) for x in self.value_scales),
        )

    def update_layer(
        self, layer: int, new_keys: Array, new_values: Array
    ) -> tuple[Array, Array, QuantizedKVCache]:
        """Quantizes and writes ``T`` new slots of one layer at ``index``; does not advance it.

        Args:
            layer: the layer number (a Python int).
            new_keys: float[B, T, K, H].
            new_values: float[B, T, K, H].

        Returns:
            ``(keys, values, cache)``: the layer's full keys float[B, K, H, S] and values
            float[B, K, S, H] after the write (dequantized, except the ``T`` new slots, which
            hold ``new_keys`` and ``new_values`` exactly; keys slots last, as
            :meth:`genjax.cache.KVCache.update_layer` returns them), and the cache holding the
            codes (both stored ``[B, K, S, H]``: the dequantized block is a new array anyway).
        """
        keys, key_scales, full_keys = self._write(
            self.keys[layer], self.key_scales[layer], new_keys
        )
        values, value_scales, full_values = self._write(
            self.values[layer], self.value_scales[layer], new_values
        )
        cache = self.replace(
            keys=replace_layer(self.keys, layer, keys),
            values=replace_layer(self.values, layer, values),
            key_scales=replace_layer(self.key_scales, layer, key_scales),
            value_scales=replace_layer(self.value_scales, layer, value_scales),
        )
        return jnp.swapaxes(full_keys, 2, 3), full_values, cache

    def _write(self, codes: Array, scales: Array, new: Array):
        """Writes ``new`` float[B, T, K, H] into one layer's ``codes`` int8[B, K, S, H] and
        ``scales`` float[B, K, S]; returns them and the layer's dequantized float[B, K, S, H]
        block with ``new`` in its slots."""
        new = heads_first(new.astype(self.dtype))  # [B, K, T, H]
        new_codes, new_scales = quantize(new, self.dtype)  # int8[B, K, T, H], float[B, K, T]
        codes = jax.lax.dynamic_update_slice(codes, new_codes, (0, 0, self.index, 0))
        scales = jax.lax.dynamic_update_slice(scales, new_scales, (0, 0, self.index))
        full = dequantize(codes, scales, self.dtype)  # [B, K, S, H]
        full = jax.lax.dynamic_update_slice(full, new, (0, 0, self.index, 0))
        return codes, scales, full

    def advance(self, num_slots: int | Array) -> QuantizedKVCache:
        """Returns the cache with ``index`` moved forward by ``num_slots``."""
        return self.replace(index=self.index + jnp.asarray(num_slots, jnp.int32))

    def _map_rows(self, fn) -> QuantizedKVCache:
        """Applies ``fn`` to every layer's codes and scales (arrays whose axis 0 is the rows)."""
        return self.replace(
            keys=tuple(map(fn, self.keys)),
            values=tuple(map(fn, self.values)),
            key_scales=tuple(map(fn, self.key_scales)),
            value_scales=tuple(map(fn, self.value_scales)),
        )

    def gather_rows(self, rows: Array) -> QuantizedKVCache:
        """Returns the cache with batch rows reordered or repeated by ``rows`` (int32[B'])."""
        return self._map_rows(lambda x: x[rows])

    def repeat_rows(self, count: int) -> QuantizedKVCache:
        """Returns the cache with each row repeated ``count`` (static) times in place, as
        :meth:`genjax.cache.KVCache.repeat_rows` does."""
        return self._map_rows(lambda x: repeat_rows(x, count))

    def gather_beams(self, beams: Array) -> QuantizedKVCache:
        """Reorders the rows of each prompt (codes and scales together, so exactly), as
        :meth:`genjax.cache.KVCache.gather_beams` does; ``beams`` is int32[B, M]."""
        return self._map_rows(lambda x: gather_beams(x, beams))


def check_cache_options(
    cache_implementation: str | None, cache_config: Mapping[str, Any] | None
) -> bool:
    """Checks a config's cache settings in Python; returns True for the int8 cache.

    Honoured: ``cache_implementation`` None, ``"static"``, ``"dynamic"``, ``"sliding_window"``,
    ``"hybrid"`` and ``"hybrid_chunked"`` (genjax's preallocated float cache, which gives the
    tokens each of them gives), and ``"quantized"`` with ``cache_config`` ``{"nbits": 8}``
    (optionally ``"residual_length": 0``).

    Raises:
        UnsupportedError: an offloaded or paged cache; a quantized ``cache_config`` without
            ``nbits``, with ``nbits`` other than 8, with ``residual_length`` other than 0, or
            with ``backend``, ``axis_key``, ``axis_value`` or ``q_group_size``.
        GenerationConfigError: ``cache_config`` without ``cache_implementation="quantized"``
            (it would have no effect), or an unknown ``cache_config`` key.

    Example:
        >>> check_cache_options("quantized", {"nbits": 8})
        True
    """
    if cache_implementation in _NOT_YET:
        raise UnsupportedError(
            f"cache_implementation={cache_implementation!r} ({_NOT_YET[cache_implementation]}) "
            f"is not supported by genjax yet: the KV cache stays in device memory. Use "
            f"'static' (the default), or 'quantized' with cache_config={{'nbits': 8}} to halve "
            f"it or more."
        )
    if cache_implementation != "quantized":
        if cache_config is not None:
            raise GenerationConfigError(
                f"GenerationConfig.cache_config={dict(cache_config)!r} is only read with "
                f"cache_implementation='quantized', but cache_implementation="
                f"{cache_implementation!r}. Set cache_implementation='quantized' or unset "
                f"cache_config."
            )
        return False
    _check_quantized_config(cache_config)
    return True


def _check_quantized_config(cache_config: Mapping[str, Any] | None) -> None:
    options = dict(cache_config or {})
    fix = "Use cache_config={'nbits': 8}."
    if "nbits" not in options:
        raise UnsupportedError(
            f"cache_implementation='quantized' needs cache_config['nbits'] = 8; got cache_config="
            f"{None if cache_config is None else options!r}. transformers' default is 4 bits, "
            f"which genjax does not support yet (only 8). {fix}"
        )
    if options["nbits"] != NBITS:
        raise UnsupportedError(
            f"cache_config['nbits']={options['nbits']!r} is not supported by genjax yet: its "
            f"quantized cache stores int8 codes (nbits 8 only). {fix}"
        )
    if options.get("residual_length", 0) != 0:
        raise UnsupportedError(
            f"cache_config['residual_length']={options['residual_length']!r} is not supported "
            f"by genjax yet: every slot is quantized when written (residual_length 0), with no "
            f"full-precision window of the newest tokens. Remove it or set it to 0."
        )
    for key, reason in _REJECTED_KEYS.items():
        if key in options:
            raise UnsupportedError(
                f"cache_config[{key!r}]={options[key]!r} is not supported: {reason}. Remove "
                f"{key!r}. {fix}"
            )
    unknown = sorted(set(options) - {"nbits", "residual_length"})
    if unknown:
        raise GenerationConfigError(
            f"GenerationConfig.cache_config has unknown keys {unknown}; a quantized cache "
            f"takes 'nbits' (8) and 'residual_length' (0). {fix}"
        )


def init_cache(model, batch: int, length: int, quantized: bool) -> KVCache | QuantizedKVCache:
    """Returns ``model``'s empty cache of ``length`` slots for ``batch`` rows (all static),
    as int8 codes when ``quantized`` (with the float cache's dtype for the scales)."""
    if not quantized:
        return model.init_cache(batch, length)
    return QuantizedKVCache.like(jax.eval_shape(lambda: model.init_cache(batch, length)))
