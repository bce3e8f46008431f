"""4-bit weights in blocks of 32, and their product with float activations.

Format of a weight matrix float[O, I] (``I`` a multiple of :data:`BLOCK`), the block layout of
llama.cpp's Q4_0 and Q4_1 so that GGUF tensors of those types are kept as they are:

* ``packed`` uint8[O, I/2]: 16 bytes per block of 32 inputs; byte ``j`` of a block holds the
  block's value ``j`` in its low nibble and value ``j + 16`` in its high nibble;
* ``scale`` and ``minimum`` float16[O, I/32]: value ``q`` (0..15) of block ``g`` of row ``o``
  stands for ``scale[o, g] * q + minimum[o, g]``.

So a weight costs 0.625 bytes (half a byte, plus two float16 per 32). :func:`quantize` makes
this format from float weights with Q4_1's scheme (per block, ``minimum`` = the smallest value,
``scale`` = the range / 15); a Q4_0 block (``d * (q - 8)``) is ``scale = d``,
``minimum = -8 d``.

Products (:func:`matmul`): XLA:CPU cannot unpack nibbles inside a product (it writes an
unpacked copy of the matrix first, slower than float32; ``bench/README.md``), so on the CPU
products run genjax's kernel ``q4_matmul.cc`` as an XLA FFI custom call, which reads the packed
matrix once, in one of two ways:

* rounded (decode steps: one position per sequence, up to :data:`KERNEL_MAX_ROWS` rows): each
  activation row is rounded to int8 per block of 32 as llama.cpp does (one float scale per
  block, absmax / 127), the block sums of nibble times int8 activation are taken exactly in
  int32 with the CPU's dot instructions (AVX-VNNI, or AVX2) and scaled in float32. The rounding
  moves a product by about 1% of its largest output (``tests/test_int4.py``). From 8 rows the
  kernel works like a GEMM: a tile of weight rows is unpacked once and each unpacked block is
  dotted with 8 activation rows per instruction;
* exact (prompts: several positions per sequence, up to :data:`EXACT_KERNEL_MAX_ROWS` rows):
  float32 activations times the weights dequantized to float32, a panel of weight rows at a
  time, in a register-tiled FMA product (each weight decoded once per product). A prompt's
  rounding errors would stay in the cache for every later token: on SmolLM2-135M-Instruct's
  Q4_1 file, greedy tokens equal transformers' float32 argmax on the dequantized weights at
  96.4% of positions with exact prompts and 93.2% with rounded ones (teacher forced, six chat
  prompts).

In both modes each output's float operations run in one fixed order whatever the number of
rows, so a row's result does not depend on the other rows of the product.

Longer products, other backends, and CPUs where the kernel cannot be built (see
:mod:`genjax.kernels.native`) take the XLA path: the matrix dequantized to float32 at its use
and an exact float32 product.

Static or traced: the format (shapes, the block size) and the choice of path (the number of
activation rows, the backend) are static; the packed values, scales and activations are traced.

References:
    llama.cpp's ``ggml-quants.c`` (the Q4_0 / Q4_1 block layouts, and the Q8 rounding of
    activations in its dot products); Dettmers & Zettlemoyer 2023, "The case for 4-bit
    precision: k-bit Inference Scaling Laws" (block-wise 4-bit weights).
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp

from genjax.kernels import native
from genjax.typing import Array

BLOCK = 32
"""Inputs per block: one scale and one minimum per 32 weights of a row."""

KERNEL_MAX_ROWS = 512
"""Rounded products (decode steps) of up to this many activation rows run the CPU kernel; more
take the XLA path (the matrix dequantized to float32 at its use, a float32 product). The
kernel's rounded mode costs less per row than its exact mode, which beat the XLA path at every
product size measured, up to 500 rows (``bench/README.md``); the bound marks that range."""

EXACT_KERNEL_MAX_ROWS = 256
"""The same bound for exact products (float activations; prompts): the kernel reads and decodes
the packed matrix once per product and beat the XLA path (which writes a float32 copy of the
matrix first) on SmolLM2-135M's whole prefill at 42 and 128 tokens; at 500 rows the two were
level within the measurements' noise (``bench/README.md``)."""

TARGET = "genjax_q4_matmul"
_LEVELS = 15


def check_shapes(packed: Array, scale: Array, minimum: Array, inputs: int | None = None) -> None:
    """Raises ValueError unless ``packed`` [O, I/2], ``scale`` and ``minimum`` [O, I/32] agree
    (and ``I`` equals ``inputs`` when given)."""
    rows, half = packed.shape
    width = 2 * half if inputs is None else inputs
    expected = (rows, width // BLOCK)
    if (
        packed.dtype != jnp.uint8
        or width % BLOCK
        or 2 * half != width
        or tuple(scale.shape) != expected
        or tuple(minimum.shape) != expected
    ):
        raise ValueError(
            f"4-bit weights need packed uint8[O, I/2] and scale, minimum [O, I/{BLOCK}] with I a "
            f"multiple of {BLOCK} (I={width}); got packed {packed.dtype}{list(packed.shape)}, "
            f"scale {list(scale.shape)}, minimum {list(minimum.shape)}."
        )


def pack(values: Array) -> Array:
    """uint8[O, I] values in 0..15 -> uint8[O, I/2] in the block layout above."""
    rows, width = values.shape
    blocks = values.astype(jnp.uint8).reshape(rows, width // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(rows, width // 2)


def unpack(packed: Array) -> Array:
    """uint8[O, I/2] -> uint8[O, I] values in 0..15 (the inverse of :func:`pack`)."""
    rows, half = packed.shape
    blocks = packed.reshape(rows, half // (BLOCK // 2), BLOCK // 2)
    return jnp.concatenate([blocks & 15, blocks >> 4], axis=-1).reshape(rows, 2 * half)


def dequantize(packed: Array, scale: Array, minimum: Array, dtype=jnp.float32) -> Array:
    """The float[O, I] matrix the 4-bit weights stand for, computed in float32."""
    rows, half = packed.shape
    values = unpack(packed).astype(jnp.float32).reshape(rows, -1, BLOCK)
    weight = values * scale.astype(jnp.float32)[..., None] + minimum.astype(jnp.float32)[..., None]
    return weight.reshape(rows, 2 * half).astype(dtype)


@jax.jit
def quantize(weight: Array) -> tuple[Array, Array, Array]:
    """float[O, I] -> ``(packed, scale, minimum)`` with Q4_1's scheme, per block of 32.

    ``minimum`` is the block's smallest value and ``scale`` its range / 15, both rounded to
    float16 first; the values are rounded against those rounded numbers, so each weight is off
    by at most about ``scale / 2``. A constant block gets scale 0.

    Example:
        >>> packed, scale, minimum = quantize(jnp.linspace(0.0, 1.55, 32)[None])
        >>> dequantize(packed, scale, minimum)[0, :3].tolist()
        [0.0, 0.0, 0.10333251953125]
    """
    rows, width = weight.shape
    blocks = weight.astype(jnp.float32).reshape(rows, width // BLOCK, BLOCK)
    low = jnp.min(blocks, axis=-1)
    minimum = low.astype(jnp.float16)
    scale = ((jnp.max(blocks, axis=-1) - low) / _LEVELS).astype(jnp.float16)
    step = scale.astype(jnp.float32)[..., None]
    safe = jnp.where(step > 0, step, 1.0)
    values = jnp.round((blocks - minimum.astype(jnp.float32)[..., None]) / safe)
    values = jnp.where(step > 0, jnp.clip(values, 0, _LEVELS), 0).astype(jnp.uint8)
    return pack(values.reshape(rows, width)), scale, minimum


def matmul(
    x: Array, packed: Array, scale: Array, minimum: Array, exact: bool | None = None
) -> Array:
    """float32[..., O] = ``x @ dequantize(packed, scale, minimum).T`` for x float[..., I].

    Args:
        x: float[..., I] activations.
        packed, scale, minimum: the 4-bit matrix (see the module docstring).
        exact: False rounds the activations to int8 per block (the fast kernel; decode steps);
            True keeps them float32. None (static) picks by shape: exact when ``x`` holds
            several positions per sequence (``x.shape[-2] > 1``: a prompt, whose rounding
            errors every later token would read from the cache), rounded for one position
            per row (a decode step at any batch size).
    """
    check_shapes(packed, scale, minimum, x.shape[-1])
    if exact is None:
        exact = x.ndim >= 3 and x.shape[-2] > 1
    rows = math.prod(x.shape[:-1])
    flat = x.reshape(rows, x.shape[-1]).astype(jnp.float32)
    operands = (flat, packed, scale.astype(jnp.float16), minimum.astype(jnp.float16))
    limit = EXACT_KERNEL_MAX_ROWS if exact else KERNEL_MAX_ROWS
    if rows <= limit and _kernel_registered():
        kernel = functools.partial(_kernel_product, exact=bool(exact))
        y = jax.lax.platform_dependent(*operands, cpu=kernel, default=_xla_product)
    else:
        y = _xla_product(*operands)
    return y.reshape(*x.shape[:-1], packed.shape[0])


def kernel_available() -> bool:
    """Whether products on this CPU run the native kernel (building it on first call)."""
    return _kernel_registered()


def _kernel_product(x: Array, packed: Array, scale: Array, minimum: Array, exact: bool) -> Array:
    out = jax.ShapeDtypeStruct((x.shape[0], packed.shape[0]), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(x, packed, scale, minimum, exact=exact)


def _xla_product(x: Array, packed: Array, scale: Array, minimum: Array) -> Array:
    # The barrier ties the weights to this step's activations: otherwise XLA hoists their
    # dequantization out of a decode loop and keeps a float32 copy of every matrix.
    x, packed, scale, minimum = jax.lax.optimization_barrier((x, packed, scale, minimum))
    weight = dequantize(packed, scale, minimum)
    contract = (((1,), (1,)), ((), ()))
    return jax.lax.dot_general(x, weight, contract, preferred_element_type=jnp.float32)


@functools.cache
def _kernel_registered() -> bool:
    """Builds, loads and registers the kernel once per process; False (with one warning) when
    it cannot be built, or when JAX's default backend is not the CPU."""
    if jax.default_backend() != "cpu":
        return False
    library = native.load("q4_matmul")
    if library is None:
        warnings.warn(
            "genjax's 4-bit CPU kernel is not available, so 4-bit products convert each matrix "
            f"to float32 in XLA (several times slower): {native.problem('q4_matmul')}",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.GenjaxQ4Matmul), platform="cpu")
    return True
