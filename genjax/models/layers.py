"""Layers shared by the built-in architectures: activations, norms, embeddings, linear layers.

Every layer computes in the model dtype and follows transformers' numerics where they matter:
norms reduce in float32 and products below float32 accumulate in float32 (attention:
:mod:`genjax.models.attention`). Parameter names follow flax (``kernel``, ``bias``, ``scale``,
``embedding``) so that a parameter path maps to an HF state-dict name mechanically (see
``loading.py``).

Shapes use the axis letters of :mod:`genjax.typing`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from genjax.errors import UnsupportedError
from genjax.kernels import block_gather, q4
from genjax.kernels import rows as rows_kernel
from genjax.typing import Array


def _gelu_tanh(x: Array) -> Array:
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _gelu_fast(x: Array) -> Array:
    return 0.5 * x * (1.0 + jnp.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _gelu_exact(x: Array) -> Array:
    return jax.nn.gelu(x, approximate=False)


# The transformers ``ACT2FN`` names whose math genjax reproduces exactly.
ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu": _gelu_exact,
    "gelu_python": _gelu_exact,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_python_tanh": _gelu_tanh,
    "gelu_fast": _gelu_fast,
    "gelu_10": lambda x: jnp.clip(_gelu_exact(x), -10.0, 10.0),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
    "relu6": jax.nn.relu6,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "linear": lambda x: x,
}


def stored_param(module: nn.Module, name: str, init: Callable, shape: tuple, dtype) -> Array:
    """``module.param(name, init, shape, dtype)``, without tracing ``init`` when the param exists.

    Flax's ``param`` checks an existing param by running its initializer abstractly
    (``jax.eval_shape``), on every param of every layer at every generate trace (for SmolLM's
    30 layers, 270 params, traced twice: prefill and decode step), a large share of the Python
    time spent tracing the model. Here the stored shape is compared with ``shape`` directly; the
    initializer only runs in ``init``. Which path runs depends on the params' structure
    (static), never on their values.
    """
    if not module.has_variable("params", name):  # initializing: flax creates it
        return module.param(name, init, shape, dtype)
    value = module.get_variable("params", name)
    if tuple(value.shape) != tuple(shape):
        raise flax.errors.ScopeParamShapeError(name, module.scope.path_text, value.shape, shape)
    return value


def check_activation(name: str, key: str) -> str:
    """Returns ``name`` if genjax implements it, else raises naming the config key."""
    if name not in ACTIVATIONS:
        raise UnsupportedError(
            f"{key}={name!r} is not supported; supported activations: {', '.join(ACTIVATIONS)}."
        )
    return name


class RMSNorm(nn.Module):
    """Root-mean-square norm: reduces in float32, then scales by ``offset + scale``.

    Llama's (``offset`` 0, ``upcast_scale`` False) rounds the normalized input to the model dtype
    and scales it there. ``upcast_scale`` multiplies in float32 and rounds once, after the scale
    (OLMo 2; Gemma, whose weights are stored as ``scale`` around ``offset`` 1).
    """

    eps: float
    dtype: jnp.dtype
    offset: float = 0.0
    upcast_scale: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        scale = stored_param(self, "scale", init, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        if self.upcast_scale:
            return (normed * (self.offset + scale.astype(jnp.float32))).astype(self.dtype)
        return (self.offset + scale.astype(self.dtype)) * normed.astype(self.dtype)


class LayerNorm(nn.Module):
    """Layer norm with bias (GPT-2): statistics in float32, output in the model dtype."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: Array) -> Array:
        width = x.shape[-1]
        scale = stored_param(self, "scale", nn.initializers.ones, (width,), self.dtype)
        bias = stored_param(self, "bias", nn.initializers.zeros, (width,), self.dtype)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        normed = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


class Embed(nn.Module):
    """A lookup table ``embedding`` dtype[num, D]; indices are clipped into range.

    Clipping keeps out-of-range ids (say, position ids of padding) finite: a NaN in a padding
    slot's key or value would reach real tokens through ``0 * NaN`` in attention.
    """

    num_embeddings: int
    features: int
    dtype: jnp.dtype

    def setup(self):
        self.embedding = stored_param(
            self,
            "embedding",
            nn.initializers.normal(stddev=0.02),
            (self.num_embeddings, self.features),
            self.dtype,
        )

    def __call__(self, ids: Array) -> Array:
        """Returns dtype[..., D] rows for int ids[...]."""
        rows = take_rows(self.embedding, ids).astype(self.dtype)
        if self.has_variable("params", "embedding_scale"):  # int8 table, float32[num] row scales
            scale = jnp.take(self.get_variable("params", "embedding_scale"), ids, mode="clip")
            rows = (rows.astype(jnp.float32) * scale[..., None]).astype(self.dtype)
        return rows

    def attend(self, x: Array) -> Array:
        """Returns ``x @ embedding.T`` (tied output head), dtype[..., num]."""
        scale = None
        if self.has_variable("params", "embedding_scale"):  # row scales = output channels
            scale = self.get_variable("params", "embedding_scale")
        return linear(x, self.embedding, scale, self.dtype)


def take_rows(table: Array, ids: Array) -> Array:
    """``table[ids]`` (ids clipped into range) for a table dtype[num, D]; dtype[..., D].

    A table of 16-bit floats is not gathered by XLA:CPU's gather, which computes bfloat16 and
    float16 ops in float32 and so converts the whole table to float32 first (hoisted before a
    decode loop, once per call: a [V, D] float32 copy of the vocabulary, to read B rows of it).
    On the CPU its rows are copied by genjax's gather kernel (:mod:`genjax.kernels.block_gather`)
    straight from the table. Elsewhere, and where the kernel stands aside, the table is gathered
    as its 16-bit integer bits; XLA:CPU still copies the table once per call for that bitcast
    (SmolLM's 49152 x 576 bfloat16 table: 17.7 ms per serving-engine round trip on the AMD EPYC,
    5% of the engine's bfloat16 time). Integers are gathered as they are. Same values.
    """
    if not jnp.issubdtype(table.dtype, jnp.floating) or jnp.finfo(table.dtype).bits != 16:
        return jnp.take(table, ids, axis=0, mode="clip")
    if block_gather.applies():
        flat = jnp.clip(ids.reshape(-1), 0, table.shape[0] - 1).astype(jnp.int32)
        return block_gather.take_rows(table, flat).reshape(*ids.shape, table.shape[1])
    bits = jax.lax.bitcast_convert_type(table, jnp.uint16)
    rows = jnp.take(bits, ids, axis=0, mode="clip")
    return jax.lax.bitcast_convert_type(rows, table.dtype)


def dense(features: int, use_bias: bool, dtype: jnp.dtype, name: str) -> Dense:
    """A :class:`Dense` of ``features`` outputs whose params are stored in ``dtype``."""
    return Dense(features, use_bias=use_bias, dtype=dtype, name=name)


class Dense(nn.Module):
    """A linear layer whose ``kernel`` is stored as dtype[out, in], the layout of HF's
    ``nn.Linear.weight`` (and of the embedding table that doubles as a tied output head), plus
    ``bias`` dtype[out] when ``use_bias``.

    Why [out, in] and not flax's [in, out]: XLA on CPU multiplies several rows of activations
    (batched decoding, beams, a prefill) by an [out, in] matrix faster than by the same matrix
    stored [in, out], which makes whole decode steps at batch 8-32 faster. One row (batch-1
    decoding) runs at about the same speed either way, except a large output head, which is
    slower alone in this layout. GPU and TPU matrix units take either operand order, so the
    choice is made for CPUs. Figures: ``bench/README.md``.

    With weight-only int8 params (:mod:`genjax.quantize`) ``kernel`` is int8[out, in] and a
    sibling ``kernel_scale`` float32[out] holds one scale per output channel. With 4-bit params
    there is no ``kernel``: ``kernel_q4`` uint8[out, in/2], ``kernel_q4_scale`` and
    ``kernel_q4_min`` float16[out, in/32] (:mod:`genjax.kernels.q4`). Which path runs is decided
    by the params' structure (static), never by their values.
    """

    features: int
    use_bias: bool
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """Returns dtype[..., out] for x dtype[..., in]."""
        if self.has_variable("params", "kernel_q4"):  # 4-bit weights: genjax.kernels.q4
            packed, scale, minimum = (
                self.get_variable("params", f"kernel_q4{suffix}")
                for suffix in ("", "_scale", "_min")
            )
            if packed.shape[0] != self.features:
                raise flax.errors.ScopeParamShapeError(
                    "kernel_q4",
                    self.scope.path_text,
                    packed.shape,
                    (self.features, x.shape[-1] // 2),
                )
            y = q4.matmul(x, packed, scale, minimum).astype(self.dtype)
        else:
            init = nn.initializers.lecun_normal(in_axis=1, out_axis=0)
            kernel = stored_param(self, "kernel", init, (self.features, x.shape[-1]), self.dtype)
            scale = None
            if self.has_variable("params", "kernel_scale"):
                scale = self.get_variable("params", "kernel_scale")
            y = linear(x, kernel, scale, self.dtype)
        if self.use_bias:
            bias = stored_param(self, "bias", nn.initializers.zeros, (self.features,), self.dtype)
            y = y + bias.astype(self.dtype)
        return y


def linear(x: Array, weight: Array, scale: Array | None, dtype: jnp.dtype) -> Array:
    """``x @ weight.T`` for x [..., in] and weight [out, in]; returns dtype[..., out].

    On the CPU, products of a few rows (1-32; int8 weights 1-256; bfloat16 weights 1-64 with
    AVX-512 BF16, 16 with AMX, else 1-8) with float32, bfloat16 or int8 weights run genjax's
    kernel (:mod:`genjax.kernels.rows`), which reads the weights faster than XLA's products;
    the same sums up to their order. Otherwise:

    Float weights in float32 give the plain product. Below float32 (bfloat16, float16) the
    product accumulates in float32 and is rounded to ``dtype`` once, after the sum (one row on a
    CPU: ``_one_row_widened``): on a mesh the partial sums of a row-parallel layer (split on its
    input features) are then added in float32 too, so tensor-parallel and one-device runs round
    the same sums (a bfloat16 all-reduce rounds each partial sum and moves logits by a bfloat16
    step, enough to flip near-tied greedy tokens).

    An int8 ``weight`` with ``scale`` float32[out] computes ``(x @ weight.T) * scale``, the int8
    values converted to ``dtype`` (exactly: int8 fits every float dtype) where they are used and
    the product accumulated in float32. One row is written so that XLA:CPU fuses the conversion
    into the product; several rows as a plain product, which reads int8 when the program is
    compiled with ``quantize.LIBRARY_DOT_OPTIONS`` (``generate`` does so for int8 params at
    several rows).
    """
    x = x.astype(dtype)
    if rows_kernel.applies(x, weight, scale, dtype):  # a few rows, on the CPU: genjax's kernel
        return rows_kernel.matmul(x, weight, scale).astype(dtype)
    if scale is not None:
        if math.prod(x.shape[:-1]) > 1:  # see quantize.LIBRARY_DOT_OPTIONS
            x, weight = _keep_in_loop(x, weight)
            y = _rows_times_transposed(x, weight.astype(dtype), jnp.float32)
            return (y * scale).astype(dtype)
        x = _materialized(x)
        x, weight = _keep_in_loop(x, weight)
        # Written as a product with the transposed matrix, not as a dot_general contracting the
        # weight's last axis: XLA on CPU then fuses the int8 conversion into a one-row product
        # and reads int8, a quarter of float32's bytes; the dot_general spelling converts the
        # whole matrix to memory first.
        y = jnp.matmul(x, weight.astype(dtype).T, preferred_element_type=jnp.float32)
        return (y * scale).astype(dtype)
    weight = weight.astype(dtype)
    if jnp.finfo(dtype).bits >= 32:
        return _rows_times_transposed(x, weight, None).astype(dtype)
    if math.prod(x.shape[:-1]) == 1:
        y = jax.lax.platform_dependent(
            x, weight, cpu=_one_row_widened, default=_rows_times_transposed_accumulating
        )
        return y.astype(dtype)
    return _rows_times_transposed_accumulating(x, weight).astype(dtype)


def _rows_times_transposed_accumulating(x: Array, weight: Array) -> Array:
    """float32 ``x @ weight.T`` of narrow float operands, accumulated in float32.

    Always the plain product: the swapped one that helps float32 at 2-16 rows makes bfloat16
    products 1.7-2.4x slower there on the CPU (GPT-2's step at 8 rows: 127 ms swapped, 53 ms
    plain; ``bench/matmul_floor.py --dtypes``).

    The rows are flattened to one axis [R, in] first. XLA rewrites a product whose activations
    have several non-contracted axes (a decode step's [B, 1, in]) into its canonical form
    ``[R, in] x [in, out]``: a transpose of the weight that layout assignment turns into a
    transposed copy of every matrix, made once per call before the decode loop (a whole
    model's weights copied per ``generate``), and then XLA:CPU's narrow product reads the
    weight [in, out], which runs several times slower than [out, in] contracted on its last
    axis. A two-axis product is left as written.
    """
    flat = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # [R, in]
    contract = (((1,), (1,)), ((), ()))
    y = jax.lax.dot_general(flat, weight, contract, preferred_element_type=jnp.float32)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _one_row_widened(x: Array, weight: Array) -> Array:
    """float32 ``x @ weight.T`` for one row of narrow floats x [..., in] (one row in all) and a
    narrow weight [out, in], for the CPU.

    XLA:CPU's bfloat16 product of one row runs at about 0.4-0.9x the float32 one, though it reads
    half the bytes: it widens the whole matrix first. Widened here (exactly: every bfloat16 and
    float16 value is a float32 value) and written as int8 weights are (``x @ weight.T`` after
    ``_materialized`` and ``_keep_in_loop``), the conversion fuses into the one-row product,
    which then reads the narrow matrix once: 1.4-2.8x float32 at 1 row in a loop of GPT-2-sized
    products (figures: ``bench/README.md``, end to end ``bench/run.py --dtypes``).
    Same sums as the narrow product, in float32, up to their order. Several rows keep the plain
    narrow product, which is the faster one there.
    """
    x = _materialized(x.astype(jnp.float32))
    x, weight = _keep_in_loop(x, weight)
    return jnp.matmul(x, weight.astype(jnp.float32).T)


SWAPPED_MAX_ROWS = 16
"""Products with up to this many activation rows run as ``weight @ x.T`` on CPU (see below)."""


def _rows_times_transposed(x: Array, weight: Array, accumulate: jnp.dtype | None) -> Array:
    """``x @ weight.T`` for x [..., in] and weight [out, in], accumulated in ``accumulate``.

    With 2 to ``SWAPPED_MAX_ROWS`` rows (a decode step at batch 2-16, beam search, speculative
    verification), XLA on CPU computes this product much faster as ``weight @ x.T``: an
    [out, rows] result, then a transpose of that small result. At one row the two are equal,
    and at 32 rows and more (batch 32, a long prefill) the plain product is slightly faster,
    hence the bound (``bench/matmul_rows.py`` times both; figures in ``bench/README.md``). XLA
    folds a plain ``(weight @ x.T).T`` back into ``x @ weight.T``, so an optimization barrier
    keeps the [out, rows] product. Other platforms get the plain product: there the extra
    transpose would only add work. Same values either way, up to the order of float32 sums.
    """
    contract = (((x.ndim - 1,), (1,)), ((), ()))

    def plain(x: Array, weight: Array) -> Array:
        return jax.lax.dot_general(x, weight, contract, preferred_element_type=accumulate)

    rows = math.prod(x.shape[:-1])
    if not 1 < rows <= SWAPPED_MAX_ROWS:
        return plain(x, weight)

    def swapped(x: Array, weight: Array) -> Array:
        flat = x.reshape(rows, x.shape[-1])  # [R, in]
        by_output = jax.lax.dot_general(
            weight, flat, (((1,), (1,)), ((), ())), preferred_element_type=accumulate
        )  # [out, R]
        by_output = jax.lax.optimization_barrier(by_output)
        return by_output.T.reshape(*x.shape[:-1], weight.shape[0])

    return jax.lax.platform_dependent(x, weight, cpu=swapped, default=plain)


def _materialized(x: Array) -> Array:
    """``x``, computed into a buffer of its own before an int8 product reads it (on CPU).

    XLA:CPU emits a one-row int8 product as a loop over the outputs with the matrix's int8-to-
    float conversion fused in (what makes it read int8). It then also fuses the cheap elementwise
    ops that make the activations (a norm's scaling, the previous product's scale and bias, a
    GELU's multiplies) into that loop, where they run again for every output, so a product
    whose activations are costly to make (GPT-2's int8 MLP down-projection after its GELU) takes
    much longer than one that reads as many bytes. XLA never fuses across a conditional, so
    passing ``x`` through one makes it computed once. Both branches return ``x``; the predicate
    is a constant behind an optimization barrier, so that XLA keeps the conditional and no value
    of ``x`` is read (on a mesh, reading one would cost a collective). Other platforms fuse
    differently, and a GPU conditional waits for its predicate, so they get ``x`` as it is.
    """

    def through_conditional(x: Array) -> Array:
        always = jax.lax.optimization_barrier(jnp.bool_(True))
        return jax.lax.cond(always, lambda v: v, lambda v: v + 0, x)

    return jax.lax.platform_dependent(x, cpu=through_conditional, default=lambda x: x)


def _keep_in_loop(x: Array, weight: Array) -> tuple[Array, Array]:
    """Ties an int8 ``weight`` to the activations ``x`` so that its conversion stays at its use.

    Weights are loop-invariant in the decode ``while_loop``: without this, XLA hoists the
    int8-to-float conversion out of the loop and holds a float copy of every quantized matrix for
    the whole call (more memory than the float model, and none of the int8 reads). The barrier
    makes the converted weight depend on each step's activations.
    """
    return jax.lax.optimization_barrier((x, weight))


def forward_outputs(hidden: list | None, weights: list | None) -> dict:
    """The extra outputs of a forward pass, as the model protocol returns them: a dict with
    ``"hidden_states"`` dtype[L+1, B, T, D] (the embeddings, each layer's output but the last,
    then the last one after the final norm: transformers' layout) and ``"attentions"``
    dtype[L, B, N, T, S] (each layer's softmax weights over every cache slot), each present when
    its list is given (not None)."""
    outputs = {}
    if hidden is not None:
        outputs["hidden_states"] = jnp.stack(hidden)
    if weights is not None:
        outputs["attentions"] = jnp.stack(weights)
    return outputs


def keep_positions(x: Array, logits_to_keep) -> Array:
    """The positions of ``x`` (dtype[B, T, D]) whose logits the model computes: all of them for
    0, the last ``k`` for an int ``k > 0``, those given for an int32[k] array (transformers'
    two forms of ``logits_to_keep``); dtype[B, T or k, D]."""
    if not isinstance(logits_to_keep, int):
        return jnp.take(x, logits_to_keep, axis=1)
    return x[:, -logits_to_keep:] if logits_to_keep else x
