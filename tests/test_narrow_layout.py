"""The compiled structure that makes narrow (bfloat16, int8) decoding fast on XLA:CPU.

Each test pins one property of the optimized HLO that a speed-up in ``genjax.models.layers``
relies on, so that a later XLA (or a rewrite of the layer) cannot silently undo it. Figures:
``bench/results/*-bf16-*.txt``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from genjax.cache.kv import KVCache
from genjax.kernels import gate
from genjax.kernels import rows as rows_kernel
from genjax.models import attention as attention_layer
from genjax.models import layers

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="XLA:CPU's canonical dots and bfloat16 normalization"
)

OUT, IN = 512, 256  # [out, in] of the weight; distinct, so that a transposed copy shows


def _decode_like_loop(dtype, scale):
    """A 4-step loop over ``linear`` of loop-invariant weights, as a decode step runs them."""

    def loop(x, weight, scale):
        def step(_, x):
            y = layers.linear(x, weight, scale, dtype)
            return x + jnp.tanh(y[..., :IN])

        return jax.lax.fori_loop(0, 4, step, x)

    return loop


def _shapes_in(text: str, element: str) -> set[str]:
    """Every ``element[...]`` shape that an instruction of ``text`` produces."""
    return set(re.findall(rf"= ({element}\[[\d,]*\])\{{", text))


def _buffers(text: str, element: str) -> set[str]:
    """Every ``element[...]`` shape that a fusion or copy of ``text`` writes to memory (ops
    inside a fused computation are computed in registers)."""
    return set(re.findall(rf"= ({element}\[[\d,]*\])\{{[\d,]*\}} (?:fusion|copy)\(", text))


@pytest.mark.parametrize("rows", [8, 32])
def test_several_rows_of_bfloat16_read_the_weight_as_stored(rows):
    """A decode step's [B, 1, in] bfloat16 activations are flattened to [B, in] before the
    product: XLA canonicalizes a product with two non-contracted activation axes into
    ``[R, in] x [in, out]``, a transposed copy of every weight made before the loop, and then
    the narrow product reads [in, out], several times slower than [out, in] on XLA:CPU."""
    weight = jnp.ones((OUT, IN), jnp.bfloat16)
    x = jnp.ones((rows, 1, IN), jnp.bfloat16)
    with rows_kernel.disabled():  # 8 rows: XLA's product, where genjax's CPU kernel does not run
        text = jax.jit(_decode_like_loop(jnp.bfloat16, None)).lower(x, weight, None).compile()
    text = text.as_text()
    assert f"bf16[{IN},{OUT}]" not in _shapes_in(text, "bf16"), "a transposed weight copy"
    dots = re.findall(
        r"dot\(([^)]*)\), lhs_contracting_dims=\{1\}, rhs_contracting_dims=\{1\}", text
    )
    assert dots, "no [R, in] x [out, in] product contracting the weight's last axis"


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_narrow_table_lookup_reads_rows_not_a_widened_table(dtype, kernel):
    """``Embed`` reads a 16-bit float table's rows without a copy of the table: XLA:CPU computes
    a 16-bit float gather in float32, on a float32 copy of the whole table made before the loop;
    gathered as integer bits it still copies the table once (the bitcast), so on the CPU the
    gather kernel reads the table as it is (without it, the bits path)."""
    vocab, width = 1000, 64
    table = jnp.ones((vocab, width), dtype)

    def loop(ids, table):
        def step(i, total):
            return total + layers.take_rows(table, ids + i).astype(jnp.float32)

        return jax.lax.fori_loop(0, 4, step, jnp.zeros((*ids.shape, width), jnp.float32))

    ids = jnp.zeros((8, 1), jnp.int32)
    with gate.disabled(not kernel, kernels=("block_gather",)):
        text = jax.jit(lambda *a: loop(*a)).lower(ids, table).compile().as_text()
        assert f"f32[{vocab},{width}]" not in _shapes_in(text, "f32")
        copies = re.findall(rf"= \w+\[{vocab},{width}\]\S* (?:fusion|copy|convert)\(", text)
        assert (not copies) if kernel else len(copies) <= 1, copies
        got = jax.jit(layers.take_rows)(
            jnp.arange(12.0, dtype=dtype).reshape(4, 3), jnp.array([[3], [9], [-5]])
        )
    expected = jnp.array([[[9.0, 10.0, 11.0]], [[9.0, 10.0, 11.0]], [[0.0, 1.0, 2.0]]], dtype)
    assert jnp.array_equal(got, expected)  # values as jnp.take's, out-of-range ids clipped


def test_a_bfloat16_cache_write_does_not_widen_the_cache():
    """``KVCache.update_layer`` writes a 16-bit float cache as its integer bits: XLA:CPU
    computes a 16-bit float ``dynamic_update_slice`` on a float32 copy of the whole block,
    narrowed back after the write, each decode step of each layer. (float16 caches are
    written the same way; XLA:CPU widens a float16 block for its attention read anyway.)"""
    dtype = jnp.bfloat16
    batch, heads, head_dim, slots = 2, 4, 64, 64  # small blocks fuse the read differently
    cache = KVCache.create(1, batch, slots, heads, head_dim, dtype)
    new = jnp.ones((batch, 1, heads, head_dim), jnp.float32)

    def loop(cache, new):
        def step(i, carry):  # a decode step's write, then its attention over the block
            cache, total = carry
            keys, values, cache = cache.update_layer(0, new * i, new * i)
            bias = jnp.zeros((batch, 1, 1, slots), jnp.float32)
            out = attention_layer.attention(new.astype(dtype), keys, values, bias, 0.25)
            return cache.replace(index=cache.index + 1), total + out.astype(jnp.float32)

        zeros = jnp.zeros((batch, 1, heads * head_dim), jnp.float32)
        return jax.lax.fori_loop(0, 4, step, (cache, zeros))

    compiled = jax.jit(loop).lower(cache, new).compile()
    widened = {
        f"f32[{batch},{heads},{head_dim},{slots}]",
        f"f32[{batch},{heads},{slots},{head_dim}]",
    }
    assert not widened & _buffers(compiled.as_text(), "f32")
    cache, _ = compiled(cache, new)
    np.testing.assert_array_equal(
        np.asarray(cache.keys[0][..., :4], np.float32)[0, 0, 0], [0, 1, 2, 3]
    )
