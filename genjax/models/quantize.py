"""Weight-only int8 quantization of the built-in models' linear layers.

``quantize_params(model, params, "int8")`` stores every linear kernel float[out, in] as
``kernel`` int8[out, in] plus ``kernel_scale`` float32[out]: symmetric, one scale per output
channel (row), ``scale = max_j |w[i, j]| / 127`` and ``q = round(w / scale)`` in [-127, 127], so
each weight is off by at most ``scale / 2``. The model object does not change: its dense layers
see ``kernel_scale`` in the params and compute ``(x @ q.T) * scale (+ bias)`` with float activations
(``genjax.models.layers.Dense``), so the quantized params plug into ``generate``, ``jax.jit`` and
a mesh (``kernel_scale`` shards like the kernel's rows, its output axis) unchanged.

What is quantized:

* every ``kernel`` (attention q/k/v/o, GPT-2's fused ``c_attn`` and ``c_proj``, the MLP, and an
  untied ``lm_head``: it is a linear layer, and usually the largest one);
* the embedding table that doubles as the output head when ``tie_word_embeddings`` (Llama's
  ``embed_tokens``, GPT-2's ``wte``), with one scale per vocabulary row (``embedding_scale``
  float32[V]), which is the head's output channel: the head is read whole every decode step,
  the lookup reads one row, dequantized with the same scale. ``tied_head=False`` keeps it float.
* not: norms, biases, an untied input embedding or GPT-2's position table (a decode step reads
  one row of each, so int8 would save memory but no bandwidth, and cost lookup precision).

Speed: int8 weights cost a quarter of float32's memory traffic where the compiler converts them
inside the matrix product. XLA on CPU does so for one-row products (batch-1 decoding) when the
product is written ``x @ w.T`` (``layers.linear``), and its activations are computed once
before it (``layers._materialized``), so batch-1 decoding runs about twice as fast as float32
(``bench/quantize.py``; figures in ``bench/README.md``). With several rows XLA:CPU writes each
converted matrix to memory first (about half float32's speed at batch 8), unless the program is
compiled with :data:`LIBRARY_DOT_OPTIONS`, which ``generate`` and the serving engine do for int8
params at several rows: then the products read int8 (``bench/matmul_floor.py --dtypes``). The
conversion is kept inside the decode loop on purpose (``layers._keep_in_loop``): XLA would
otherwise hoist it out of the ``while_loop`` and hold a float copy of every matrix for the whole
call. GPU backends: not measured here.

Static or traced: the mode and which leaves are quantized are static (the params' structure);
the int8 values and scales are ordinary traced arrays.

References:
    Dettmers et al. 2022, "LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale"
    (vector-wise absmax quantization); the per-channel symmetric int8 weight-only scheme is the
    one of TensorRT-LLM's and gpt-fast's ``int8`` weight-only modes.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from genjax.errors import InputError, UnsupportedError
from genjax.kernels import q4
from genjax.kernels import rows as rows_kernel
from genjax.models.gpt2 import GPT2Model
from genjax.typing import Array, PyTree

MODES = ("int8", "int4")
"""The supported values of ``mode`` (``from_pretrained``'s ``quantize``)."""

_QMAX = 127  # symmetric: -128 is never used, so that -q is representable too
_INT8_LEAVES = ("kernel_scale", "embedding_scale")


def check_mode(mode: Any, argument: str = "mode") -> str:
    """Returns ``mode`` if genjax implements it, else raises naming ``argument``.

    Raises:
        UnsupportedError: e.g. ``"nf4"``, or anything not in :data:`MODES`.

    Example:
        >>> check_mode("int8")
        'int8'
    """
    if mode not in MODES:
        raise UnsupportedError(
            f"{argument}={mode!r} is not supported; supported modes: {', '.join(map(repr, MODES))} "
            "(weight-only int8 with one float32 scale per output channel; int4 in blocks of 32 "
            f"with a float16 scale and minimum each). Pass {argument}=None for float weights."
        )
    return mode


@functools.partial(jax.jit, static_argnames="axis")
def quantize_weight(weight: Array, axis: int = 1) -> tuple[Array, Array]:
    """Symmetric absmax int8 quantization with one scale per channel.

    Args:
        weight: float[..., in, ...]; ``axis`` is the one reduced over: the input features, the
            last axis of both a kernel [out, in] and an embedding table [V, D]. Traced.
        axis: the axis that shares one scale (static).

    Returns:
        ``(q, scale)``: int8 of ``weight``'s shape, and float32 with ``axis`` removed, such that
        ``|weight - q * scale| <= scale / 2`` elementwise (in float32). An all-zero channel gets
        scale 1 and zeros.

    Example:
        >>> q, scale = quantize_weight(jnp.array([[1.0, -0.5], [-2.0, 0.25]]))
        >>> q.tolist(), scale.tolist()
        ([[127, -64], [-127, 16]], [0.007874015718698502, 0.015748031437397003])
    """
    w = jnp.asarray(weight, jnp.float32)
    absmax = jnp.max(jnp.abs(w), axis=axis)
    scale = jnp.where(absmax > 0, absmax / _QMAX, 1.0)
    q = jnp.clip(jnp.round(w / jnp.expand_dims(scale, axis)), -_QMAX, _QMAX)
    return q.astype(jnp.int8), scale


@functools.partial(jax.jit, static_argnames=("axis", "dtype"))
def dequantize_weight(q: Array, scale: Array, axis: int = 1, dtype: Any = jnp.float32) -> Array:
    """``q * scale`` with ``scale`` broadcast along ``axis`` (the inverse of quantize_weight).

    Example:
        >>> dequantize_weight(*quantize_weight(jnp.array([[1.0, -2.0]]))).ravel().tolist()
        [1.0078740119934082, -2.0]
    """
    return (q.astype(jnp.float32) * jnp.expand_dims(scale, axis)).astype(dtype)


LIBRARY_DOT_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}
"""XLA:CPU compiler options under which int8 products of several rows read int8.

Without them XLA:CPU converts an int8 matrix multiplied by several rows to a float copy in
memory first and then multiplies: 1 + 4 + 4 bytes per weight instead of 1, so int8 weights
decoded at batch 8 at about half float32's speed. With them XLA hands each product, its
int8-to-float conversion included, to XNNPACK's YNNPACK kernels, which convert the matrix in
tiles as they pack it: exact (every int8 value is a float), and measured end to end at about 1.5x
float32 at 8 and 32 rows (``bench/run.py --dtypes``; figures in ``bench/README.md``). They make
the fused one-row int8 product slow, so ``generate`` compiles with them only when every product
has several rows and genjax's rows kernel does not take them (:func:`library_dots`). XLA marks
the option experimental: a future XLA may rename it, which ``tests/test_quantize.py`` would
notice.
"""


def library_dots(params: PyTree, rows: int, meshed: bool = False) -> bool:
    """True when a program over ``params`` whose decode steps multiply ``rows`` activation rows
    should compile with :data:`LIBRARY_DOT_OPTIONS`: int8 params, several rows, on the CPU
    (other backends do not know the option), unless genjax's own kernel
    (:mod:`genjax.kernels.rows`) takes every int8 product of that many rows, as it does off a
    mesh (``meshed`` False) up to 256 rows. Its products read int8 too, and YNNPACK's, which the
    options give every product of the program, attention's included, made SmolLM's step slower:
    greedy batch 8 on the Intel Xeon 31.6 ms per token with the options, 25.1 without
    (float32 34.7); batch 32 91.8, 86.7 (float32 94.9)."""
    if rows <= 1 or jax.default_backend() != "cpu" or not is_quantized(params):
        return False
    return meshed or not all(
        rows_kernel.takes(jnp.int8, rows, leaf.shape[-1])
        for leaf in jax.tree_util.tree_leaves(params)
        if getattr(leaf, "dtype", None) == jnp.int8
    )


def is_quantized(params: PyTree) -> bool:
    """True when ``params`` holds quantized leaves (``kernel_scale``, ``embedding_scale`` or
    4-bit ``kernel_q4``); False for any other pytree (a custom model's params may be a bare
    array)."""
    return _has_leaves(params, (*_INT8_LEAVES, "kernel_q4"))


def quantize_params(
    model: Any, params: PyTree, mode: str = "int8", *, tied_head: bool = True
) -> PyTree:
    """Returns ``params`` with weight-only quantized linear layers (see the module docstring).

    Args:
        model: the built-in model the params belong to (its ``tie_word_embeddings`` decides
            whether an embedding table is also the output head). It is not changed: the same
            model runs float and quantized params.
        params: its float parameter tree.
        mode: ``"int8"`` or ``"int4"`` (static). ``"int4"`` stores every kernel whose input
            width is a multiple of 32 in 4-bit blocks (:mod:`genjax.kernels.q4`, Q4_1's scheme)
            and keeps the output head in int8 (an untied ``lm_head`` per output channel, a tied
            table per row), as llama.cpp's 4-bit files keep their output tensor in 6-8 bits;
            other kernels get int8. 4-bit kernels already in ``params`` (a GGUF file's Q4_0 /
            Q4_1 tensors, kept by ``from_pretrained(..., quantize="int4")``) stay as they are.
            Decoder-only models only.
        tied_head: also quantize an embedding table that is the tied output head, per row.

    Returns:
        A new tree: ``kernel`` int8[out, in] with a sibling ``kernel_scale`` float32[out], or in
        its place ``kernel_q4`` uint8[out, in/2], ``kernel_q4_scale`` and ``kernel_q4_min``
        float16[out, in/32]; a tied head table ``embedding`` int8[V, D] with
        ``embedding_scale`` float32[V]; every other leaf as given. Sharded int8 inputs give
        outputs on the same devices (the arithmetic is elementwise or a reduction over the
        kernel's input axis).

    Raises:
        UnsupportedError: ``mode`` is not in :data:`MODES`, or int4 for an encoder-decoder
            model.
        InputError: ``params`` are already quantized, or a kernel is not a float matrix.

    Example:
        >>> qparams = genjax.quantize_params(model, params, "int8")
        >>> out = genjax.generate(model, qparams, ids, config, attention_mask=mask)
        >>> out.sequences.shape
        (2, 7)
    """
    check_mode(mode)
    if not isinstance(params, Mapping):
        raise InputError(
            f"params must be the nested dict of a built-in model, got {type(params).__name__}."
        )
    already = _INT8_LEAVES if mode == "int4" else (*_INT8_LEAVES, "kernel_q4")
    if _has_leaves(params, already):
        raise InputError(
            "params are already quantized (they hold kernel_scale/embedding_scale/kernel_q4 "
            "leaves); quantize the float params once."
        )
    if mode == "int4" and hasattr(model, "encode"):
        raise UnsupportedError(
            f"quantize='int4' supports decoder-only models; {type(model).__name__} is an "
            "encoder-decoder model. Use quantize='int8' or float weights."
        )
    head = _tied_head_table(model) if tied_head else None
    paths = list(_targets(params, (), head))
    four_bit = [path for path in paths if mode == "int4" and _fits_int4(path, _get(params, path))]
    eight_bit = [path for path in paths if path not in four_bit]
    quantized = _quantize_all({path: _get(params, path) for path in eight_bit})
    packed = _quantize_all_int4({path: _get(params, path) for path in four_bit})
    return _rebuild(params, (), quantized, packed)


def _fits_int4(path: tuple[str, ...], matrix: Any) -> bool:
    """A kernel (not the output head) whose input width splits into 4-bit blocks."""
    return path[-1] == "kernel" and path[0] != "lm_head" and matrix.shape[1] % q4.BLOCK == 0


def _has_leaves(params: PyTree, names: tuple[str, ...]) -> bool:
    return any(
        path and _leaf_name(path) in names
        for path, _ in jax.tree_util.tree_leaves_with_path(params)
    )


def _targets(tree: Mapping, prefix: tuple[str, ...], head: str | None):
    """Yields the path of every matrix to quantize, checking that each is a float matrix."""
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping):
            yield from _targets(value, path, head)
        elif key == "kernel" or path == (head, "embedding"):
            _check_float_matrix(path, value)
            yield path


@jax.jit
def _quantize_all(matrices: dict) -> dict:
    """One compiled program for every matrix (eager ops would compile per op and shape); each
    matrix is [out, in] and gets one scale per row."""
    return {path: quantize_weight(w, 1) for path, w in matrices.items()}


@jax.jit
def _quantize_all_int4(matrices: dict) -> dict:
    """``(packed, scale, minimum)`` of every [out, in] matrix, in one compiled program."""
    return {path: q4.quantize(w) for path, w in matrices.items()}


def _get(tree: Mapping, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _rebuild(tree: Mapping, prefix: tuple[str, ...], quantized: dict, packed: dict) -> dict:
    """``tree`` with each int8 leaf ``name`` replaced by int8 and ``name_scale`` added, and each
    4-bit ``kernel`` replaced by ``kernel_q4``, ``kernel_q4_scale`` and ``kernel_q4_min``."""
    out = {}
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping):
            out[key] = _rebuild(value, path, quantized, packed)
        elif path in quantized:
            out[key], out[f"{key}_scale"] = quantized[path]
        elif path in packed:
            out["kernel_q4"], out["kernel_q4_scale"], out["kernel_q4_min"] = packed[path]
        else:
            out[key] = value
    return out


def _check_float_matrix(path: tuple[str, ...], value: Any) -> None:
    if jnp.ndim(value) != 2 or not jnp.issubdtype(jnp.result_type(value), jnp.floating):
        raise InputError(
            f"params[{'/'.join(path)!r}] must be a float matrix to quantize, got "
            f"{jnp.result_type(value)}{list(jnp.shape(value))}."
        )


def _tied_head_table(model: Any) -> str | None:
    """The top-level name of the embedding table that is also the output head, if any."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return None

    return "wte" if isinstance(model, GPT2Model) else "embed_tokens"


def _leaf_name(path) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "idx", last)))


def param_bytes(params: PyTree) -> int:
    """The bytes of every array in ``params`` (a float32 model: 4 per weight; int8: about 1).

    Example:
        >>> param_bytes({"kernel": jnp.zeros((2, 3), jnp.int8)})
        6
    """
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(params))


__all__ = [
    "MODES",
    "check_mode",
    "dequantize_weight",
    "is_quantized",
    "param_bytes",
    "quantize_params",
    "quantize_weight",
]
