"""When genjax's decode-step CPU kernels run, and the library that holds them.

The kernels (:mod:`genjax.kernels.rows`: products of a few activation rows;
:mod:`genjax.kernels.attention`: one-token attention's sums over the KV cache;
:mod:`genjax.kernels.cache_writes`: new slots written into 16-bit caches in place;
:mod:`genjax.kernels.block_gather`: a paged pool's blocks copied into logical order) live in one
library, ``decode_kernels.cc``, built once per machine. Each kernel module asks :func:`allowed`
while tracing. A kernel stands aside:

* inside :func:`disabled` (for the kernels it names; all by default). genjax's own meshed
  ``generate`` and serving engine trace under it, and tests and benchmarks use it to compare the
  kernel with XLA's path. It acts when a program is traced: one JAX has already traced keeps its
  path;
* in a process started with ``GENJAX_KERNELS_OFF`` naming it (comma-separated: ``rows``,
  ``attention``, ``cache_writes``, ``block_gather``, or ``all``), for comparisons from the
  command line;
* under a mesh with automatic axes (``jax.set_mesh``): XLA's SPMD partitioner knows no sharding
  rule for a custom call and would gather every operand onto each device. Inside ``shard_map``
  each device's block runs the kernel;
* off the CPU, or where the library cannot be built (:func:`genjax.kernels.native.problem`).

Static or traced: all of it is static, decided on the host while a program is traced.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os

import jax

from genjax.errors import InputError
from genjax.kernels import native

KERNELS = ("rows", "attention", "cache_writes", "block_gather")
LIBRARY = "decode_kernels"


def _from_environment() -> frozenset[str]:
    named = {name.strip() for name in os.environ.get("GENJAX_KERNELS_OFF", "").split(",")}
    named.discard("")
    if "all" in named:
        return frozenset(KERNELS)
    unknown = named - set(KERNELS)
    if unknown:
        raise InputError(
            f"GENJAX_KERNELS_OFF names {sorted(unknown)}; the kernels are {list(KERNELS)} "
            "(or 'all'), comma-separated."
        )
    return frozenset(named)


_OFF_AT_START = _from_environment()
_OFF: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "genjax_kernels_off", default=_OFF_AT_START
)


@contextlib.contextmanager
def disabled(when: bool = True, kernels: tuple[str, ...] = KERNELS):
    """Programs traced inside the block take XLA's path for ``kernels`` (when ``when``)."""
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        raise InputError(f"kernels={kernels!r} names {sorted(unknown)}; known: {list(KERNELS)}.")
    token = _OFF.set(_OFF.get() | frozenset(kernels if when else ()))
    try:
        yield
    finally:
        _OFF.reset(token)


def allowed(kernel: str) -> bool:
    """Whether ``kernel`` may run in what is being traced now: not disabled, not under a mesh
    with automatic axes, and the library built and loaded on a CPU backend."""
    return kernel not in _OFF.get() and not _automatic_mesh() and library() is not None


def enabled(kernel: str) -> bool:
    """Whether ``kernel`` would run off a mesh (asked on the host, before tracing)."""
    return kernel not in _OFF.get() and library() is not None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels' library, built on first use (None off the CPU, or when it cannot be built:
    :func:`genjax.kernels.native.problem` says why)."""
    if jax.default_backend() != "cpu":
        return None
    return native.load(LIBRARY)


def register(targets: dict[str, str]) -> bool:
    """Registers ``{custom-call target: handler symbol}`` from the library with XLA's CPU
    backend; False when there is no library."""
    loaded = library()
    if loaded is None:
        return False
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(loaded, symbol)), "cpu")
    return True


def _automatic_mesh() -> bool:
    """Whether a mesh with automatic (not ``shard_map``-manual) axes is set while tracing."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    manual = set(getattr(mesh, "manual_axes", ()))
    return any(name not in manual for name in mesh.axis_names)
