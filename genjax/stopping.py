"""Stopping rules, as pure functions of the token just chosen and the buffer length.

Static or traced:
    The EOS ids are traced (int32[E], E static). The buffer length at which generation ends is
    static (it is the token buffer's shape).
"""

from __future__ import annotations

import jax.numpy as jnp

from genjax.typing import Array


def is_eos(tokens: Array, eos_token_ids: Array | None) -> Array:
    """bool[B]: True where ``tokens`` (int32[B]) is one of ``eos_token_ids`` (int32[E]).

    With no EOS ids, nothing is EOS.

    Example:
        >>> is_eos(jnp.array([2, 5]), jnp.array([2, 3])).tolist()
        [True, False]
    """
    if eos_token_ids is None:
        return jnp.zeros(tokens.shape, bool)
    eos = jnp.atleast_1d(jnp.asarray(eos_token_ids, jnp.int32))
    return jnp.any(tokens[:, None] == eos[None, :], axis=-1)


def should_continue(length: Array, max_length: int, finished: Array) -> Array:
    """bool[]: keep decoding while the buffer has room and some row is unfinished."""
    return (length < max_length) & ~jnp.all(finished)
