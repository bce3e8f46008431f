"""One layer of a paged pool, as a one-token attention reads it where it lies.

:meth:`genjax.cache.PagedKVCache.update_layer` returns a decode step's keys and values as
:class:`PagedBlocks` (the layer's pool and the rows' block tables) instead of copying each row's
blocks into logical order, where genjax's CPU attention kernel reads the pool in place
(:func:`genjax.kernels.attention.paged_scores`): on the serving engine's decode loop that copy,
made once per call for every layer, took more time than a decode iteration
(``bench/README.md``). :func:`genjax.models.attention.attention` takes either form; it turns
:class:`PagedBlocks` into the logical arrays (:meth:`PagedBlocks.logical`) wherever it does not
run the kernel.

Static or traced: the layout (keys or values) is static; the pool and the tables are traced.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from genjax.kernels import block_gather
from genjax.typing import Array


@struct.dataclass
class PagedBlocks:
    """A layer's keys or values in its pool, with the rows' block tables.

    Its ``shape``, ``dtype`` and ``ndim`` are those of the logical array it stands for: keys
    ``[B, K, H, S]``, values ``[B, K, S, H]``, ``S = M * bs``.
    """

    pool: Array  # keys float[N, K, H, bs] or values float[N, K, bs, H]
    tables: Array  # int32[B, M]: row b's logical block m is pool block tables[b, m]
    keys: bool = struct.field(pytree_node=False)  # True: a keys pool (slots last)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        batch, blocks = self.tables.shape
        _, heads, a, b = self.pool.shape
        slots = blocks * (b if self.keys else a)
        return (batch, heads, a, slots) if self.keys else (batch, heads, slots, b)

    @property
    def dtype(self) -> jnp.dtype:
        return self.pool.dtype

    @property
    def ndim(self) -> int:
        return 4

    def logical(self) -> Array:
        """The rows' blocks copied into logical order (keys [B, K, H, S] or values [B, K, S, H])."""
        return block_gather.logical(self.pool, self.tables, self.keys)
