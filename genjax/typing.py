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

Inside ``shard_map`` JAX's types also say which manual mesh axes a value varies over:
:func:`varying_axes` reads that, :func:`vary_like` widens it.
"""

from __future__ import annotations

from typing import Any

import jax

Array = jax.Array
PyTree = Any

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
"""The bounds of int32, the dtype of token ids, counts and seeds in compiled programs."""


def varying_axes(x) -> tuple[str, ...]:
    """The manual mesh axes ``x`` varies over (its type's; JAX 0.7-0.9 name them ``vma``)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return tuple(sorted(manual.varying if manual is not None else getattr(aval, "vma", ())))


def vary_like(tree, reference):
    """``tree`` typed as varying over every manual mesh axis ``reference`` varies over (a pytree:
    over any of its leaves). Outside a ``shard_map`` nothing varies and ``tree`` comes back as
    it is.

    Inside a ``shard_map`` a value computed from replicated inputs alone, or returned by a
    custom call (which JAX cannot see into), is typed as not varying; where it meets varying
    values in one carry or one ``switch``, JAX requires the same type.
    """
    axes = tuple(sorted({a for leaf in jax.tree.leaves(reference) for a in varying_axes(leaf)}))
    if not axes:
        return tree

    def vary(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(vary, tree)
