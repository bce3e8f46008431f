"""The axis vocabulary used in every shape comment, einsum string and sharding rule.

    B  batch (rows of a call; after expansion, batch * num_return_sequences)
    T  query length of one model call (the prompt in prefill, 1 in decoding)
    S  cache / token-buffer length (the full preallocated sequence length)
    P  prompt length as the user gave it
    N  new tokens (``max_new_tokens``), or query heads inside attention
    V  vocabulary size
    D  model width
    K  key/value heads
    H  head dimension
    F  MLP width
    L  layers
    R  return sequences per prompt (``num_return_sequences``)
    M  beams

Shapes are written ``dtype[axes]``, e.g. ``int32[B, S]``.
"""

from __future__ import annotations

from typing import Any

import jax

Array = jax.Array
PyTree = Any
