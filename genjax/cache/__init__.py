"""KV caches: the pytrees that hold every layer's keys and values between decoding steps.

``kv`` is the float cache (keys ``[B, K, H, S]``, values ``[B, K, S, H]``, preallocated to its
final length ``S``); ``quantized`` its int8 form; ``slots`` the fixed slot layout that lets one
compiled program serve many prompt and output lengths (``max_cache_len``); ``memory`` sizes a
cache before it is allocated; ``encoder_decoder`` the decoder-plus-cross-attention cache of
T5/BART-style models; ``paged`` the block pool of the serving engine (rows of
different lengths in fixed-size blocks, per-row write indices; in the model's dtype or as int8
codes with scales, the ``quantized`` code), ``paged_blocks`` one layer of it as a one-token
attention reads it in place and ``gathered`` a few of its rows copied into
logical order for a run of decode steps; ``ring`` the sliding-window layers
of a float cache, kept as rings of ``W`` slots (written modulo ``W``) instead of ``S``. The int8
and paged caches keep every layer in the full layout (windows are applied by the mask there).

Layer:
    Floor 2. Imports only :mod:`genjax.errors`, :mod:`genjax.typing` and :mod:`genjax.kernels`
    (in-place writes into 16-bit caches).

Static or traced:
    Cache shapes (``B``, ``K``, ``S``, ``H``, dtype, layer count) are static; the contents and the
    write index are traced arrays carried by the decoding loops.
"""

from genjax.cache.encoder_decoder import EncoderDecoderCache, fold_rows, unfold_rows
from genjax.cache.gathered import GatheredKVCache
from genjax.cache.kv import (
    KVCache,
    attention_bias,
    gather_beams,
    grow_slots,
    heads_first,
    repeat_rows,
    replace_layer,
    slots_last,
)
from genjax.cache.memory import (
    CacheRequest,
    cache_bytes,
    check_fits,
    check_pool_fits,
    free_bytes,
    paged_block_bytes,
)
from genjax.cache.paged import SCRATCH_BLOCK, PagedKVCache
from genjax.cache.paged_blocks import PagedBlocks
from genjax.cache.quantized import (
    QuantizedKVCache,
    check_cache_options,
    dequantize,
    init_cache,
    quantize,
)
from genjax.cache.ring import ring_bias, ring_size, ring_to_slots

__all__ = [
    "CacheRequest",
    "EncoderDecoderCache",
    "GatheredKVCache",
    "PagedBlocks",
    "KVCache",
    "PagedKVCache",
    "QuantizedKVCache",
    "SCRATCH_BLOCK",
    "attention_bias",
    "cache_bytes",
    "check_cache_options",
    "check_fits",
    "check_pool_fits",
    "dequantize",
    "fold_rows",
    "free_bytes",
    "gather_beams",
    "grow_slots",
    "heads_first",
    "init_cache",
    "paged_block_bytes",
    "quantize",
    "repeat_rows",
    "replace_layer",
    "ring_bias",
    "ring_size",
    "ring_to_slots",
    "slots_last",
    "unfold_rows",
]
