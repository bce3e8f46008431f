"""Products of a few activation rows on the CPU through genjax's kernel: float32, bfloat16 and
int8 weights.

``matmul(x, weight, scale)`` is ``x @ weight.T`` (times ``scale`` per output for int8 weights) in
float32, for x [R, I] and weight [O, I] in float32, bfloat16, or int8 with scale float32[O]. On
the CPU, for 1 to ``MAX_ROWS[weight dtype]`` rows (decode steps, beams, speculative
verification, short prompt chunks; int8 prompts), it runs ``rows_matmul.h`` as an XLA FFI custom
call, which reads each weight once from memory (once per 32 rows for more), widens narrow
weights to float32 in registers (exactly), and multiplies it by every row while it is in the
CPU's cache. XLA:CPU's products read the weights
slower: its one-row product, and with several rows it packs the weight panel first (for int8,
it writes a float copy of the matrix). Over a SmolLM-shaped stack of matrices on the 2-core Intel
Xeon XLA's products took, against the kernel: float32 1.5x the time at one row, 2.0x at five,
1.3x at 32; bfloat16 1.6x at one row, 1.5x at eight, level at 16 (where XLA's AMX products take
over); int8 2.0x at one row, 2.3x at eight, 1.6x at 32 (``bench/matmul_stack.py``; figures in
``bench/README.md``).

bfloat16 weights with bfloat16 activations, on a CPU with AVX-512 BF16 (AMD EPYC since Zen 4,
Intel Xeon since Cooper Lake) and input widths that are multiples of 32, take the pair product
instead: ``vdpbf16ps`` adds the exact products of two inputs to a float32 partial sum per lane,
twice the multiply-adds per instruction, and the activations stay bfloat16 (no widening at
all). It is fast enough to take prompt chunks too: up to :data:`PAIR_MAX_ROWS` rows
(:data:`PAIR_MAX_ROWS_AMX` where XLA's products use AMX). Over SmolLM's stack of matrices on the
AMD EPYC, 8 rows took 9.8-13.4 ms against the widening kernel's 19.3-22.0
(``bench/matmul_stack.py``, ``bench/results/2026-12-04-cpu-amd-epyc-matmul-stack-bf16.txt``).
The instruction flushes subnormal inputs and partial sums to zero; products of normal values
are the same float32 sums, in another order.

Each output's float operations run in one fixed order whatever the number of rows (16 partial
sums along the inputs, then summed by halves; 8 without AVX-512), so a row's result is the same
bits alone or beside other rows: a request decoded in the serving engine's batch gets what
``generate`` gives it alone.

When the kernel is not used (inputs not a multiple of 16; more rows; float16 weights; or where
:mod:`genjax.kernels.gate` stands every kernel aside: other backends, meshes with automatic
axes, :func:`disabled`, ``GENJAX_KERNELS_OFF``), callers take XLA's product.

Gradients: the product's derivative is taken through XLA's product (a custom JVP), so training
code that calls the models' layers differentiates as before.

Static or traced: the choice of path (backend, shapes, dtypes, the context) is static; the
activations, weights and scales are traced.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from genjax.kernels import gate, native
from genjax.typing import Array, vary_like

MAX_ROWS = {jnp.dtype(jnp.float32): 32, jnp.dtype(jnp.bfloat16): 8, jnp.dtype(jnp.int8): 256}
"""Products of up to this many activation rows run the kernel, per weight dtype; more take XLA's
product. float32: at 64 rows the two were level. int8: XLA's product writes a float32 copy of the
matrix first, so prompts too are faster through the kernel (32 rows at a time) up to 256 rows
(SmolLM's matrices on the AMD EPYC, ``bench/matmul_stack.py``: XLA 1.05-1.5x the kernel's time
at 42-256 rows, 0.8x at 512; a 42-token prompt's forward pass 1.19x float32 against 0.64x
through XLA, ``bench/results/2026-12-03-cpu-amd-epyc-int8-prefill.txt``). bfloat16: from 16
rows XLA's products (AMX on the Intel Xeon) are as fast or faster, the kernel widening each
weight once per 6 rows."""

PAIR_MAX_ROWS = 64
"""bfloat16 weights through the pair product (:func:`pairs_available`) take the kernel up to
this many rows on a CPU without AMX: SmolLM's stack of matrices on the AMD EPYC
(``bench/matmul_stack.py``), XLA's product against the kernel's, 2.0-3.1x the time at 8 rows,
2.5-2.6x at 16, 1.4-1.7x at 32, 1.2-1.4x at 64, 0.86-0.97x at 128."""

PAIR_MAX_ROWS_AMX = 16
"""The same on a CPU with AMX bfloat16 tiles, which XLA's products use: on the Intel Xeon they
took 27.3 ms over SmolLM's stack at 16 rows and 29.0 at 32, level with the widening kernel at 16
rows, which the pair product beats by 1.7x at 8 rows on the EPYC (not yet measured there)."""

INPUT_MULTIPLE = 16
"""The kernel's input width must be a multiple of this (its vector width, in floats)."""

PAIR_INPUT_MULTIPLE = 32
"""The pair product's input width must be a multiple of this (bfloat16 values per vector)."""

_TARGETS = {
    jnp.dtype(jnp.float32): ("genjax_rows_matmul_f32", "GenjaxRowsMatmulF32"),
    jnp.dtype(jnp.bfloat16): ("genjax_rows_matmul_bf16", "GenjaxRowsMatmulBF16"),
    jnp.dtype(jnp.int8): ("genjax_rows_matmul_s8", "GenjaxRowsMatmulS8"),
}
_PAIRS_TARGET = ("genjax_rows_matmul_bf16_pairs", "GenjaxRowsMatmulBF16Pairs")
disabled = gate.disabled
"""``disabled(when=True, kernels=("rows", "attention"))``: programs traced inside take XLA's
path (:func:`genjax.kernels.gate.disabled`)."""


def applies(x: Array, weight: Array, scale: Array | None, dtype) -> bool:
    """Whether ``linear``'s product of ``x`` (already in ``dtype``) and ``weight`` runs the kernel
    (static: shapes, dtypes, context): float32 or bfloat16 weights computed in their own dtype,
    or int8 weights with a scale computed in float32 or bfloat16."""
    dtype, kind = jnp.dtype(dtype), jnp.dtype(weight.dtype)
    if kind == jnp.int8:
        typed = scale is not None and dtype in (jnp.float32, jnp.bfloat16)
    else:
        typed = scale is None and kind == dtype and kind in _TARGETS
    rows = math.prod(x.shape[:-1])
    return typed and weight.ndim == 2 and takes(kind, rows, x.shape[-1]) and gate.allowed("rows")


def takes(kind, rows: int, width: int) -> bool:
    """Whether products of ``rows`` activation rows with ``kind`` weights of input width
    ``width`` run the kernel off a mesh (static; also asked on the host before tracing)."""
    kind = jnp.dtype(kind)
    limit = pair_max_rows() if _pairs(kind, width) else MAX_ROWS.get(kind, 0)
    return (
        1 <= rows <= limit
        and width % INPUT_MULTIPLE == 0
        and gate.enabled("rows")
        and _kernel_registered()
    )


def matmul(x: Array, weight: Array, scale: Array | None = None) -> Array:
    """float32[..., O] = ``x @ weight.T`` (``* scale`` for int8 weights) for x [..., I] and weight
    [O, I], through the kernel on the CPU (call only where :func:`applies`) and XLA's product
    elsewhere; ``x`` is taken in float32 (exactly, from bfloat16), or in bfloat16 for the pair
    product."""
    pairs = _pairs(weight.dtype, weight.shape[-1])  # bfloat16 activations and weights
    flat = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    flat = flat.astype(jnp.bfloat16 if pairs else jnp.float32)
    if scale is None:
        y = jax.lax.platform_dependent(flat, weight, cpu=_product, default=_xla_product)
    else:
        operands = (flat, weight, scale.astype(jnp.float32))
        y = jax.lax.platform_dependent(*operands, cpu=_scaled_product, default=_xla_scaled)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def kernel_available() -> bool:
    """Whether products on this CPU can run the kernel (building it on first call)."""
    return _kernel_registered()


def pairs_available() -> bool:
    """Whether this CPU's kernel multiplies bfloat16 activations by bfloat16 weights with the
    AVX-512 BF16 pair product (``vdpbf16ps``; building the kernel on first call)."""
    return _pairs_registered()


def pair_max_rows() -> int:
    """Products of up to this many rows take the pair product on this CPU (see
    :data:`PAIR_MAX_ROWS`, :data:`PAIR_MAX_ROWS_AMX`)."""
    return PAIR_MAX_ROWS_AMX if "amx_bf16" in native.cpu_flags() else PAIR_MAX_ROWS


def _pairs(kind, width: int) -> bool:
    """Whether a product with ``kind`` weights of input width ``width`` takes the pair product
    (static)."""
    return (
        jnp.dtype(kind) == jnp.bfloat16
        and width % PAIR_INPUT_MULTIPLE == 0
        and (_pairs_registered())
    )


def _xla_product(x: Array, weight: Array) -> Array:
    operands = (x.astype(jnp.float32), weight.astype(jnp.float32))
    return jax.lax.dot_general(*operands, (((1,), (1,)), ((), ())))


def _xla_scaled(x: Array, weight: Array, scale: Array) -> Array:
    return _xla_product(x, weight) * scale


def _call(*operands: Array) -> Array:
    x, weight = operands[:2]
    pairs = jnp.dtype(x.dtype) == jnp.bfloat16
    target = _PAIRS_TARGET[0] if pairs else _TARGETS[jnp.dtype(weight.dtype)][0]
    out = jax.ShapeDtypeStruct((x.shape[0], weight.shape[0]), jnp.float32)
    y = jax.ffi.ffi_call(target, out, vmap_method="sequential")(*operands)
    return vary_like(y, operands)  # in shard_map: typed as XLA's product would be


@jax.custom_jvp
def _product(x: Array, weight: Array) -> Array:
    return _call(x, weight)


@_product.defjvp
def _product_jvp(primals, tangents):
    (x, weight), (dx, dweight) = primals, tangents
    return _product(x, weight), _xla_product(dx, weight) + _xla_product(x, dweight)


@jax.custom_jvp
def _scaled_product(x: Array, weight: Array, scale: Array) -> Array:
    return _call(x, weight, scale)


@_scaled_product.defjvp
def _scaled_product_jvp(primals, tangents):
    (x, weight, scale), (dx, _, dscale) = primals, tangents  # int8 weights: no tangent
    y = _scaled_product(x, weight, scale)
    return y, _xla_scaled(dx, weight, scale) + _xla_product(x, weight) * dscale


@functools.cache
def _kernel_registered() -> bool:
    """Registers the kernels once per process; False without the library
    (:func:`genjax.kernels.gate.library`)."""
    return gate.register(dict(_TARGETS.values()))


@functools.cache
def _pairs_registered() -> bool:
    """Registers the pair product once per process; False where the library was built without
    AVX-512 BF16 (or not at all)."""
    loaded = gate.library() if _kernel_registered() else None
    if loaded is None or not hasattr(loaded, _PAIRS_TARGET[1]):
        return False
    return gate.register(dict([_PAIRS_TARGET]))
