"""genjax's CPU kernel for one-token attention's sums over the KV cache
(genjax/kernels/attention.py): the sums XLA computes, over each row's span of unmasked slots
only, independent of where the span starts and of the buffer's length; the whole buffer for a
row with every slot masked; XLA's sums on meshes and where disabled; gradients; decode steps and
generate taking it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import genjax
from genjax.cache import PagedBlocks
from genjax.errors import InputError
from genjax.generation.entry import lower_program
from genjax.generation.plan import CallRequest, prepare
from genjax.kernels import attention, block_gather, gate
from genjax.models import attention as attention_layer
from genjax.sharding import make_mesh

pytestmark = [
    pytest.mark.usefixtures("fast_compiles"),
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel"),
]

KERNEL = "genjax_attention"  # the prefix of the kernel's custom-call targets
MASKED = float(jnp.finfo(jnp.float32).min)
B, K, G, H, S = 4, 3, 3, 64, 40


def _blocks(dtype, seed=0, slots=S):
    """queries [B, K, G, H], keys [B, K, H, slots], values [B, K, slots, H], and a bias
    [B, slots] whose rows mask: a prefix (left padding), a suffix (slots not written yet), every
    slot, two inner slots."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, K, G, H)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((B, K, H, slots)), dtype)
    values = jnp.asarray(rng.standard_normal((B, K, slots, H)), dtype)
    allowed = np.ones((B, slots), bool)
    allowed[0, :5] = allowed[1, slots - 10 :] = allowed[2, :] = allowed[3, 10:12] = False
    bias = jnp.where(jnp.asarray(allowed), 0.0, MASKED)
    return q, keys, values, bias


def _span(bias):
    """bool[B, S]: the slots from each row's first to last unmasked one (all: none unmasked)."""
    allowed = np.asarray(bias) > -1e30
    span = np.ones_like(allowed)
    for row, slots in enumerate(allowed):
        hits = np.flatnonzero(slots)
        if hits.size:
            span[row] = (np.arange(slots.size) >= hits[0]) & (np.arange(slots.size) <= hits[-1])
    return span


def test_the_kernel_builds_here():
    assert attention.kernel_available(), genjax.kernels.native.problem(gate.LIBRARY)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sums_equal_xla_over_each_rows_span(dtype):
    q, keys, values, bias = _blocks(dtype)
    wide_keys, wide_values = keys.astype(jnp.float32), values.astype(jnp.float32)
    span = _span(bias)[:, None, None, :]
    scores = np.asarray(jax.jit(attention.scores)(q, keys, bias))
    expected = np.einsum("bkgh,bkhs->bkgs", np.asarray(q, np.float64), np.asarray(wide_keys))
    inside = np.broadcast_to(span, scores.shape)
    np.testing.assert_allclose(scores[inside], expected[inside], rtol=0, atol=1e-5)
    assert np.all(scores[~inside] == 0)  # masked again by the bias
    assert span[2].all()  # the row with no unmasked slot takes every slot

    weights = jax.nn.softmax(jnp.asarray(expected, jnp.float32) + bias[:, None, None], axis=-1)
    assert np.all(np.asarray(weights)[~inside] == 0)  # why leaving those slots out is exact
    out = np.asarray(jax.jit(attention.weighted_values)(weights, values, bias))
    exact = np.einsum("bkgs,bksh->bkgh", np.asarray(weights, np.float64), np.asarray(wide_values))
    np.testing.assert_allclose(out, exact, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_rows_bits_do_not_depend_on_padding_buffer_length_or_other_rows(dtype):
    q, keys, values, bias = _blocks(dtype)
    weights = jax.nn.softmax(attention.scores(q, keys, bias) + bias[:, None, None], axis=-1)
    scores = attention.scores(q, keys, bias)
    out = attention.weighted_values(weights, values, bias)
    # 7 masked slots in front (more left padding) and 9 behind (a longer buffer), holding junk.
    front, back = 7, 9
    junk = jnp.full((B, K, H, front + back), 3.0, dtype)
    wider_keys = jnp.concatenate([junk[..., :front], keys, junk[..., front:]], axis=-1)
    wider_values = jnp.swapaxes(jnp.concatenate([junk[..., :front], jnp.swapaxes(values, 2, 3),
                                                 junk[..., front:]], axis=-1), 2, 3)  # fmt: skip
    pad = lambda x, fill: jnp.pad(
        x, [(0, 0)] * (x.ndim - 1) + [(front, back)], constant_values=fill
    )  # noqa: E731
    wider_bias = pad(bias, MASKED)
    rows = np.array([0, 1, 3])  # row 2 masks every slot: it takes the whole, different, buffer
    wider_scores = attention.scores(q, wider_keys, wider_bias)[..., front : front + S]
    np.testing.assert_array_equal(wider_scores[rows], scores[rows])
    wider_out = attention.weighted_values(pad(weights, 0.0), wider_values, wider_bias)
    np.testing.assert_array_equal(wider_out[rows], out[rows])
    alone = attention.weighted_values(weights[3:], values[3:], bias[3:])
    np.testing.assert_array_equal(alone, out[3:])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "slots, block_size",
    # 40 slots: vectors and scalar tails; 160: also the tiles of several vectors, whose bits a
    # block of 5 (scalar sums only) must give too.
    [(40, 40), (40, 20), (40, 8), (40, 5), (160, 160), (160, 32), (160, 5)],
)
def test_paged_sums_equal_the_sums_over_blocks_gathered_first(dtype, slots, block_size):
    q, _, _, bias = _blocks(dtype, seed=4, slots=slots)
    blocks = slots // block_size
    rng = np.random.default_rng(5)
    pool_keys = jnp.asarray(rng.standard_normal((11, K, H, block_size)), dtype)
    pool_values = jnp.asarray(rng.standard_normal((11, K, block_size, H)), dtype)
    tables = jnp.asarray(rng.integers(0, 11, (B, blocks)), jnp.int32)
    keys = PagedBlocks(pool_keys, tables, True)
    values = PagedBlocks(pool_values, tables, False)
    assert keys.shape == (B, K, H, slots) and values.shape == (B, K, slots, H)
    logical_keys, logical_values = keys.logical(), values.logical()
    with gate.disabled(kernels=("block_gather",)):  # XLA's gather: the same arrays
        np.testing.assert_array_equal(keys.logical(), logical_keys)
        np.testing.assert_array_equal(values.logical(), logical_values)
    for row in range(B):  # the gather itself, against numpy
        for m in range(blocks):
            part = slice(m * block_size, (m + 1) * block_size)
            want_k = np.asarray(pool_keys[int(tables[row, m])])
            np.testing.assert_array_equal(np.asarray(logical_keys[row, :, :, part]), want_k)
            want_v = np.asarray(pool_values[int(tables[row, m])])
            np.testing.assert_array_equal(np.asarray(logical_values[row, :, part]), want_v)
    scores = jax.jit(attention.paged_scores)(q, pool_keys, tables, bias)
    np.testing.assert_array_equal(scores, jax.jit(attention.scores)(q, logical_keys, bias))
    weights = jax.nn.softmax(scores + bias[:, None, None, :], axis=-1)
    out = jax.jit(attention.paged_weighted_values)(weights, pool_values, tables, bias)
    expected = jax.jit(attention.weighted_values)(weights, logical_values, bias)
    np.testing.assert_array_equal(out, expected)


def test_block_gather_copies_what_xlas_gather_does():
    rng = np.random.default_rng(6)
    tables = jnp.asarray(rng.integers(-14, 14, (3, 4)), jnp.int32)  # wraps and clamps as XLA
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        pool = jnp.asarray(rng.standard_normal((9, 6, 16)), dtype)
        assert block_gather.applies()
        assert "genjax_block_gather" in jax.jit(block_gather.gather).lower(pool, tables).as_text()
        got = jax.jit(block_gather.gather)(pool, tables)
        expected = jax.jit(lambda p, t: p[t].transpose(0, 2, 1, 3))(pool, tables)
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint16), np.asarray(expected).view(np.uint16)
        )


def _decode(q, keys, values, bias):
    """attention for one query token: q [B, 1, N, H], bias [B, 1, 1, S]."""
    return attention_layer.attention(q, keys, values, bias, H**-0.5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_attention_equals_xla_and_runs_exactly_where_it_applies(dtype):
    q, keys, values, bias = _blocks(dtype, seed=1)
    queries = q.reshape(B, 1, K * G, H).astype(dtype)
    full_bias = bias[:, None, None, :]
    args = (queries, keys, values, full_bias)
    assert KERNEL in jax.jit(_decode).lower(*args).as_text()
    got = jax.jit(_decode)(*args)
    with gate.disabled(kernels=("attention",)):  # a new function: traced with XLA's sums
        hlo = jax.jit(lambda *a: _decode(*a) * 1).lower(*args).as_text()
        expected = jax.jit(lambda *a: _decode(*a) * 1)(*args)
    assert KERNEL not in hlo
    tolerance = 1e-6 if dtype == jnp.float32 else 1e-2  # bfloat16: one rounding step
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=0, atol=tolerance
    )
    with jax.set_mesh(make_mesh((2, 4))):  # automatic axes: XLA's partitioned sums
        assert KERNEL not in jax.jit(lambda *a: _decode(*a) * 2).lower(*args).as_text()
    odd = (queries[..., :40], keys[:, :, :40], values[..., :40], full_bias)  # H = 40
    assert KERNEL not in jax.jit(_decode).lower(*odd).as_text()
    # output_attentions: the weights are XLA's softmax either way; the kernel computes the sums
    _, weights = jax.jit(lambda *a: attention_layer.attention(*a, H**-0.5, return_weights=True))(
        *args
    )
    with gate.disabled(kernels=("attention",)):
        _, xla_weights = attention_layer.attention(*args, H**-0.5, return_weights=True)
    np.testing.assert_allclose(
        np.asarray(weights, np.float32), np.asarray(xla_weights, np.float32), atol=tolerance
    )


def test_gradients_equal_xla_sums():
    q, keys, values, bias = _blocks(jnp.float32, seed=2)
    queries, full_bias = q.reshape(B, 1, K * G, H), bias[:, None, None, :]

    def loss(queries, keys, values):
        return jnp.sum(jnp.tanh(_decode(queries, keys, values, full_bias)))

    with gate.disabled(kernels=("attention",)):
        expected = jax.jit(jax.grad(lambda *a: loss(*a) * 1.0, argnums=(0, 1, 2)))(
            queries, keys, values
        )
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(queries, keys, values)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


def test_generate_takes_the_kernel_and_gives_xlas_tokens():
    model, params = genjax.models.from_pretrained(genjax.io.bundled.path())
    model = model.with_generation_config(None)
    ids = np.array([[0, 0, 5, 9, 13, 2], [4, 8, 15, 16, 23, 42]], np.int32)
    mask = (ids != 0).astype(np.int32)
    config = genjax.GenerationConfig(
        max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True
    )

    def program_text(**request) -> str:
        request = CallRequest.of(attention_mask=mask, **request)
        return lower_program(prepare(model, params, ids, config, request)).as_text()

    assert KERNEL in program_text()
    assert KERNEL not in program_text(mesh=make_mesh((2, 4)))
    got = genjax.generate(model, params, ids, config, attention_mask=mask)
    with gate.disabled(kernels=("attention",)):
        expected = jax.jit(lambda p, i, m: genjax.generate(model, p, i, config, attention_mask=m))(
            params, ids, mask
        )
    np.testing.assert_array_equal(got.sequences, expected.sequences)
    np.testing.assert_allclose(np.stack(got.scores), np.stack(expected.scores), atol=1e-5)


def test_kernel_switches_are_checked():
    with pytest.raises(InputError, match=r"kernels=\('attn',\).*'rows', 'attention'"):
        with gate.disabled(kernels=("attn",)):
            pass
    with gate.disabled(kernels=("attention",)):
        assert not gate.allowed("attention") and gate.allowed("rows")
    assert gate.allowed("attention")
