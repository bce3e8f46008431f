"""float32 products of a few activation rows on the CPU, through genjax's kernel.

``matmul(x, weight)`` is ``x @ weight.T`` for x float32[R, I] and weight float32[O, I]. On the
CPU, for 1 to :data:`MAX_ROWS` rows (decode steps, beams, speculative verification, short
prompt chunks), it runs ``rows_matmul.cc`` as an XLA FFI custom call, which reads each weight
once from memory and multiplies it by every row while it is in the CPU's cache. XLA:CPU's
products read the weights slower: over a SmolLM-shaped stack of matrices on the 2-core Intel
Xeon they took 1.56x the kernel's time at one row, 2.1x at five, 1.9x at eight and 1.4x at 32
(``bench/matmul_stack.py``; figures in ``bench/README.md``).

Each output's float operations run in one fixed order whatever the number of rows (16 partial
sums along the inputs, then summed by halves; 8 without AVX-512), so a row's result is the same
bits alone or beside other rows: a request decoded in the serving engine's batch gets what
``generate`` gives it alone.

When the kernel is not used (other backends; inputs not a multiple of 16; more rows; a compiler
missing, see :mod:`genjax.kernels.native`; under :func:`disabled`; or in a process started with
``GENJAX_ROWS_KERNEL=0``, for comparisons), callers take XLA's product. :func:`disabled` acts
when a program is traced: a program JAX has already compiled keeps its path. Not under a mesh
either: XLA's SPMD partitioner knows no sharding rule for a custom call and would gather every
operand onto each device, so programs traced while a mesh with automatic axes is set
(``jax.set_mesh``, or genjax's own meshed ``generate`` and serving engine, through
:func:`disabled`) use XLA's partitioned product. Inside ``shard_map`` each device's block runs
the kernel.

Gradients: the product's derivative is taken through XLA's product (a custom JVP), so
training code that calls the models' layers differentiates as before.

Static or traced: the choice of path (backend, shapes, dtypes, the context) is static; the
activations and weights are traced.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os

import jax
import jax.numpy as jnp

from genjax.kernels import native
from genjax.typing import Array, vary_like

MAX_ROWS = 32
"""Products of up to this many activation rows run the kernel; more take XLA's product (at 64
rows the two were level, at 32 the kernel took 0.72x the time)."""

INPUT_MULTIPLE = 16
"""The kernel's input width must be a multiple of this (its vector width, in floats)."""

TARGET = "genjax_rows_matmul"
_ALLOWED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "genjax_rows_kernel", default=os.environ.get("GENJAX_ROWS_KERNEL", "1") != "0"
)


@contextlib.contextmanager
def disabled(when: bool = True):
    """Products traced inside the block take XLA's path (when ``when``): for meshes, and to
    compare the two paths."""
    token = _ALLOWED.set(_ALLOWED.get() and not when)
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def applies(x: Array, weight: Array) -> bool:
    """Whether ``matmul(x, weight)`` would run the kernel (static: shapes, dtypes, context)."""
    rows = math.prod(x.shape[:-1])
    return (
        _ALLOWED.get()
        and x.dtype == jnp.float32
        and weight.dtype == jnp.float32
        and weight.ndim == 2
        and 1 <= rows <= MAX_ROWS
        and x.shape[-1] % INPUT_MULTIPLE == 0
        and not _automatic_mesh()
        and _kernel_registered()
    )


def matmul(x: Array, weight: Array) -> Array:
    """float32[..., O] = ``x @ weight.T`` for x float32[..., I], weight float32[O, I], through the
    kernel on the CPU (call only where :func:`applies`) and XLA's product elsewhere."""
    flat = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    y = jax.lax.platform_dependent(flat, weight, cpu=_product, default=_xla_product)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def kernel_available() -> bool:
    """Whether products on this CPU can run the kernel (building it on first call)."""
    return _kernel_registered()


def _xla_product(x: Array, weight: Array) -> Array:
    return jax.lax.dot_general(x, weight, (((1,), (1,)), ((), ())))


@jax.custom_jvp
def _product(x: Array, weight: Array) -> Array:
    out = jax.ShapeDtypeStruct((x.shape[0], weight.shape[0]), jnp.float32)
    y = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, weight)
    return vary_like(y, (x, weight))  # in shard_map: typed as XLA's product would be


@_product.defjvp
def _product_jvp(primals, tangents):
    (x, weight), (dx, dweight) = primals, tangents
    return _product(x, weight), _xla_product(dx, weight) + _xla_product(x, dweight)


def _automatic_mesh() -> bool:
    """Whether a mesh with automatic (not ``shard_map``-manual) axes is set while tracing."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    manual = set(getattr(mesh, "manual_axes", ()))
    return any(name not in manual for name in mesh.axis_names)


@functools.cache
def _kernel_registered() -> bool:
    """Builds, loads and registers the kernel once per process; False when it cannot be built
    (:func:`genjax.kernels.native.problem` says why) or JAX's default backend is not the CPU."""
    if jax.default_backend() != "cpu":
        return False
    library = native.load("rows_matmul")
    if library is None:
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.GenjaxRowsMatmul), platform="cpu")
    return True
