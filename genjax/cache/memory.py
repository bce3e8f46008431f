"""KV-cache memory: the bytes a call's caches take on each device, checked before allocating.

``generate`` preallocates its KV caches at their final size, so their size is known before
anything runs: layers x rows x slots x key/value heads x head dimension x bytes per number (int8
codes plus one scale per head vector for ``cache_implementation="quantized"``; a sliding-window
layer kept as a ring counts its ``W + margin`` slots, :mod:`genjax.cache.ring`), divided over the
mesh (rows over ``data``, key/value heads over ``model`` when they divide). :func:`check_fits`
compares it with the free memory of the call's devices and raises :class:`CacheMemoryError`
giving both figures, instead of an allocator failure deep inside XLA.

The serving engine's paged pool (:mod:`genjax.cache.paged`) is counted in blocks:
:func:`paged_block_bytes` gives one block's bytes over all layers (keys, values, and with an int8
pool their scales), from which ``ContinuousBatchingConfig(kv_cache_memory_bytes=...)`` sizes the
pool, and :func:`check_pool_fits` checks the whole pool before the engine allocates it. An int8
block of ``K`` KV heads of size ``H`` takes ``2 * L * K * block_size * (H + itemsize)`` bytes
against ``2 * L * K * block_size * H * itemsize`` in the model dtype (``itemsize`` that dtype's
bytes): at ``H = 64`` 1.94x the tokens per byte of bfloat16 and 3.76x of float32.

Free memory: ``device.memory_stats()`` where the backend reports it (GPU, TPU: ``bytes_limit -
bytes_in_use``); on the CPU backend, which reports nothing, the host's available memory
(``MemAvailable`` of ``/proc/meminfo``, else ``os.sysconf``) shared by the call's devices. Only
the caches are counted: weights and activations need memory too, so a call that passes the check
can still run out.

Static or traced: everything here is static (shapes, dtypes, the mesh); nothing is traced, so
the check runs the same way inside a user's ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from genjax.cache.paged import PagedKVCache
from genjax.cache.quantized import init_cache
from genjax.errors import CacheMemoryError

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class CacheRequest:
    """One KV cache a call allocates; static.

    Attributes:
        model: the model whose ``init_cache`` builds it.
        rows: ``B`` (after beams or return sequences).
        length: ``S``, its slots.
        quantized: int8 codes and scales instead of floats.
        ring_margin: extra slots of each sliding-window ring (assisted decoding's ``G + 1``).
    """

    model: object
    rows: int
    length: int
    quantized: bool = False
    ring_margin: int = 0


def cache_bytes(request: CacheRequest, layout=None) -> int:
    """The bytes one cache takes on each device.

    Args:
        request: the cache.
        layout: the call's :class:`~genjax.sharding.Layout` (static), or None for one device.
            Each layer's arrays (``[B, K, S, ...]``: keys, values, scales) split ``B`` over its
            ``batch`` axis and ``K`` over its ``kv_heads`` axis (rounded up).

    Layers with a sliding window the model keeps as a ring (:mod:`genjax.cache.ring`) count
    their ``W + ring_margin`` slots, not ``length``: the shapes are those of the cache
    ``generate`` builds.

    Example:
        >>> # bfloat16, L=4, K=2, H=64: 2 (k, v) x 4 x 1 x 16 x 2 x 64 x 2 bytes, + 4 (index)
        >>> cache_bytes(CacheRequest(model, rows=1, length=16))
        65540
    """
    data = 1 if layout is None else layout.ways("batch")
    heads = 1 if layout is None else layout.ways("kv_heads")
    total = 0
    for shape, itemsize in _leaf_shapes(request):
        shape = list(shape)
        if len(shape) >= 3:
            shape[0] = -(-shape[0] // data)
            shape[1] = -(-shape[1] // heads)
        total += math.prod(shape) * itemsize
    return total


@functools.lru_cache(maxsize=64)
def _leaf_shapes(request: CacheRequest) -> tuple[tuple[tuple[int, ...], int], ...]:
    """(shape, bytes per element) of each array of the cache; nothing is allocated."""

    def build():
        cache = init_cache(request.model, request.rows, request.length, request.quantized)
        if request.ring_margin:  # the rings generate grows for an assisted call
            cache = cache.with_length(request.length, margin=request.ring_margin)
        return cache

    cache = jax.eval_shape(build)
    return tuple((leaf.shape, leaf.dtype.itemsize) for leaf in jax.tree.leaves(cache))


def free_bytes(devices: Sequence[jax.Device]) -> tuple[int, str]:
    """The memory one of ``devices`` has free, and where the figure comes from.

    The smallest ``bytes_limit - bytes_in_use`` over the devices of this process that report
    memory statistics; else (CPU) the host's available memory divided by the number of them.
    """
    local = [d for d in devices if d.process_index == jax.process_index()] or jax.local_devices()
    stats = [d.memory_stats() for d in local]
    if all(s and "bytes_limit" in s for s in stats):
        free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
        return free, f"free on {local[0].device_kind} device memory (memory_stats)"
    host = _host_available_bytes()
    share = f", shared by {len(local)} devices" if len(local) > 1 else ""
    return host // len(local), f"available in host memory ({local[0].platform} backend{share})"


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def call_devices(layout=None) -> tuple[jax.Device, ...]:
    """The devices a call runs on: its concrete mesh's, else the default device."""
    if layout is not None and isinstance(layout.mesh, Mesh):
        return tuple(layout.mesh.devices.flat)
    return (jax.local_devices()[0],)


def check_fits(requests: Sequence[CacheRequest], layout=None) -> int:
    """Raises :class:`CacheMemoryError` when the caches would not fit on the call's devices.

    Args:
        requests: the caches the call allocates (all live at once).
        layout: the call's :class:`~genjax.sharding.Layout`, or None for one device.

    Returns:
        The bytes the caches take per device.

    Raises:
        CacheMemoryError: giving the bytes needed per device, the bytes free, and the fixes.

    Example:
        >>> check_fits([CacheRequest(model, rows=4, length=1024)])
        16777220
    """
    needed = sum(cache_bytes(r, layout) for r in requests)
    devices = call_devices(layout)
    free, source = free_bytes(devices)
    if needed <= free:
        return needed
    parts = "; ".join(
        f"{r.rows} rows x {r.length} slots ({'int8 + scales' if r.quantized else 'float'}): "
        f"{cache_bytes(r, layout):,} bytes"
        for r in requests
    )
    quantize = (
        ""
        if all(r.quantized for r in requests)
        else "use cache_implementation='quantized' with cache_config={'nbits': 8}; "
    )
    raise CacheMemoryError(
        f"the KV cache of this generate call needs {needed:,} bytes ({needed / GiB:.2f} GiB) per "
        f"device ({parts}), but only {free:,} bytes ({free / GiB:.2f} GiB) are {source}. Lower "
        f"max_new_tokens (or max_length), the prompt bucket (prompt_buckets=), the batch size, "
        f"num_beams or num_return_sequences; "
        f"{quantize}or shard the rows and KV heads over more devices with "
        f"mesh=genjax.sharding.make_mesh(...)."
    )


def paged_block_bytes(model, block_size: int, quantized: bool = False) -> int:
    """The bytes one block of the serving engine's pool takes, over all layers.

    Args:
        model: the model (its ``num_layers``, ``num_kv_heads``, ``head_dim`` and ``dtype``).
        block_size: slots per block (static).
        quantized: int8 codes with one scale per slot and KV head (``kv_cache_dtype="int8"``)
            instead of the model's dtype.

    Counted from the shapes :meth:`~genjax.cache.PagedKVCache.create` gives (nothing is
    allocated); the block tables and indices (a few bytes per row) are left out.

    Example:
        >>> # float32, L=4, K=2, H=64: 2 (k, v) x 4 x 2 x 16 slots x 64 x 4 bytes
        >>> paged_block_bytes(model, 16), paged_block_bytes(model, 16, quantized=True)
        (65536, 17408)
    """
    return _block_bytes(
        model.num_layers, model.num_kv_heads, model.head_dim, model.dtype, block_size, quantized
    )


@functools.lru_cache(maxsize=64)
def _block_bytes(layers, heads, head_dim, dtype, block_size, quantized) -> int:
    def build():
        return PagedKVCache.create(layers, 1, block_size, 1, 1, heads, head_dim, dtype, quantized)

    cache = jax.eval_shape(build)
    pools = (*cache.keys, *cache.values, *cache.key_scales, *cache.value_scales)
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in pools)


def check_pool_fits(
    model, num_blocks: int, block_size: int, quantized: bool = False, layout=None
) -> int:
    """Raises :class:`CacheMemoryError` when the engine's pool would not fit on its devices
    (the default device, or with ``layout`` each device of its mesh, which holds the pool's
    share of the KV heads split over ``layout.ways("kv_heads")``); returns the whole pool's
    bytes (``num_blocks * paged_block_bytes(...)``).

    Example:
        >>> check_pool_fits(model, num_blocks=65, block_size=16)
        4259840
    """
    needed = num_blocks * paged_block_bytes(model, block_size, quantized)
    ways = 1 if layout is None else layout.ways("kv_heads")
    share = -(-needed // ways)
    free, source = free_bytes(call_devices(layout))
    if share <= free:
        return needed
    int8 = "" if quantized else "store it as int8 with kv_cache_dtype='int8'; "
    split = f" ({share:,} per device, split {ways} ways)" if ways > 1 else ""
    raise CacheMemoryError(
        f"the serving engine's KV pool of {num_blocks} blocks of {block_size} slots "
        f"({'int8 + scales' if quantized else 'model dtype'}) needs {needed:,} bytes{split} "
        f"({share / GiB:.2f} GiB), but only {free:,} bytes ({free / GiB:.2f} GiB) are {source}. "
        f"Lower ContinuousBatchingConfig.num_blocks or kv_cache_memory_bytes (or max_batch_size "
        f"and max_length, which size it by default); {int8}or serve a smaller model."
    )
