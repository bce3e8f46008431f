"""``jax.pmap`` data parallelism over :func:`genjax.generate`, for users of the older API.

New code shards one call over a mesh instead (``generate(..., mesh=...)``, :mod:`genjax.sharding`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from genjax.errors import ShardingError
from genjax.generation.entry import generate
from genjax.typing import Array, PyTree

__all__ = ["pmap_generate"]


def pmap_generate(
    model,
    params: PyTree,
    input_ids: Array,
    config=None,
    *,
    attention_mask: Array | None = None,
    key: Array | None = None,
    devices: Sequence[jax.Device] | None = None,
):
    """Data-parallel ``generate`` with ``jax.pmap``, for users of the older API.

    The batch is split into one block of rows per device and the parameters are replicated on
    every device; each device runs ``generate`` on its rows, and the outputs are joined back in
    row order. Prefer ``genjax.generate(..., mesh=...)``: it also splits the model, and its
    sampled tokens equal a single device's.

    Differences from a single-device ``generate``: greedy and beam search give the same tokens
    (scores to float32 rounding); sampling folds each device's index into ``key`` (so identical
    prompts on two devices draw different tokens), so its draws differ from a single-device
    call. Prompts are not padded to a bucket length (``generate`` sees traced ids inside
    ``pmap``), so each prompt length compiles its own program.

    Static or traced: the model, the devices and the config's static structure are static (one
    compiled program per combination and prompt shape); params, ids, mask, the config's values
    and the key are traced.

    Args:
        model: a model.
        params: the parameters, replicated on every device.
        input_ids: int[B, P]; ``B`` must divide by the number of devices.
        config: a :class:`~genjax.GenerationConfig`, or None for the defaults.
        attention_mask: int[B, P], or None to infer it as ``generate`` does.
        key: a PRNG key (``jax.random.key(seed)``), required when sampling.
        devices: the devices; defaults to ``jax.local_devices()``.

    Returns:
        A :class:`~genjax.GenerateOutput` with ``B*R`` rows in the order of ``input_ids``.

    Raises:
        ShardingError: ``B`` does not divide by the number of devices.

    Example:
        >>> out = genjax.sharding.pmap_generate(model, params, ids, config, attention_mask=mask,
        ...                                     devices=jax.local_devices()[:2])
        >>> out.sequences.shape  # [B*R, P+N]
        (2, 7)
    """
    devices = tuple(jax.local_devices() if devices is None else devices)
    count = len(devices)
    input_ids = jnp.asarray(input_ids)
    batch = input_ids.shape[0]
    if batch % count:
        raise ShardingError(
            f"pmap_generate splits the {batch} rows of input_ids over {count} devices, but "
            f"{count} does not divide {batch}. Pad the batch to a multiple of {count} rows (and "
            f"drop the extra outputs), or pass devices= with a count that divides {batch}."
        )

    def split(x):
        return None if x is None else jnp.reshape(x, (count, batch // count, *np.shape(x)[1:]))

    keys = None
    if key is not None:
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(count))
    run = _pmapped(model, devices)
    out = run(params, split(input_ids), split(attention_mask), config, keys)
    return jax.tree_util.tree_map(lambda x: x.reshape(-1, *x.shape[2:]), out)


@functools.lru_cache(maxsize=32)
def _pmapped(model, devices: tuple[jax.Device, ...]):
    """One ``jax.pmap`` of ``generate`` per model and device tuple (so calls reuse programs)."""

    def run(params, input_ids, attention_mask, config, key):
        return generate(model, params, input_ids, config, attention_mask=attention_mask, key=key)

    return jax.pmap(run, in_axes=(None, 0, 0, None, 0), devices=devices)
