"""genjax's CPU kernel for products of a few activation rows (genjax/kernels/rows.py) with
float32, bfloat16 and int8 weights: float32 sums of exact products, each row's bits independent
of the other rows, XLA's product where the kernel does not apply (more rows, odd widths, float16,
meshes), gradients, and generate taking it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import genjax
from genjax.generation.entry import lower_program
from genjax.generation.plan import CallRequest, prepare
from genjax.kernels import native, rows
from genjax.models import layers
from genjax.models.quantize import quantize_weight
from genjax.sharding import make_mesh

pytestmark = [
    pytest.mark.usefixtures("fast_compiles"),
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel"),
]


KERNEL = "genjax_rows_matmul"  # the prefix of the kernel's custom-call targets


def _linear(x, weight):
    return layers.linear(x, weight, None, jnp.float32)


def _hlo(function, *args) -> str:
    return jax.jit(function).lower(*args).as_text()


@pytest.fixture(scope="module")
def weight():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.standard_normal((77, 1536), dtype=np.float32))  # odd output count


def test_the_kernel_builds_here():
    assert rows.kernel_available(), genjax.kernels.native.problem("rows_matmul")


def _weights(weight, kind):
    """(weight, scale, dtype) of ``kind``, and the float64 matrix those stand for."""
    if kind == "int8":
        q, scale = quantize_weight(weight)
        return (q, scale, jnp.float32), np.asarray(q, np.float64) * np.asarray(scale)[:, None]
    if kind == "bfloat16":
        narrow = weight.astype(jnp.bfloat16)
        return (narrow, None, jnp.bfloat16), np.asarray(narrow, np.float64)
    return (weight, None, jnp.float32), np.asarray(weight, np.float64)


@pytest.mark.parametrize(
    "kind, count",
    [("float32", n) for n in (1, 2, 5, 7, 8, 32)] + [("bfloat16", n) for n in (1, 8, 13, 40)]
    + [("int8", 1), ("int8", 6), ("int8", 32), ("int8", 45), ("int8", 70)],  # 70: blocks of 32
)  # fmt: skip
def test_products_are_float32_sums_and_each_row_is_its_own(weight, kind, count):
    (matrix, scale, dtype), exact_matrix = _weights(weight, kind)
    rng = np.random.default_rng(count)
    x = jnp.asarray(rng.standard_normal((count, weight.shape[1]), dtype=np.float32)).astype(dtype)
    if not rows.applies(x, matrix, scale, dtype):  # more bfloat16 rows than the widening kernel's
        assert kind == "bfloat16" and count > rows.MAX_ROWS[jnp.dtype(jnp.bfloat16)]
        pytest.skip("no AVX-512 BF16 pair product on this CPU")

    def product(x):
        return layers.linear(x, matrix, scale, dtype).astype(jnp.float32)

    y = np.asarray(jax.jit(product)(x))
    exact = np.asarray(x, np.float64) @ exact_matrix.T
    tolerance = 2e-5 if dtype == jnp.float32 else 1e-2  # bfloat16 outputs: rounded once
    np.testing.assert_allclose(y, exact, rtol=0, atol=tolerance * np.abs(exact).max())
    # Each row gets the bits it gets alone: a request decoded beside others equals it alone.
    alone = np.concatenate([np.asarray(jax.jit(product)(x[i : i + 1])) for i in range(count)])
    np.testing.assert_array_equal(y, alone)


def test_the_kernel_runs_exactly_where_it_applies(weight):
    x = jnp.ones((8, weight.shape[1]), jnp.float32)
    assert KERNEL in _hlo(_linear, x, weight)
    assert KERNEL in _hlo(_linear, x.reshape(2, 4, -1), weight)  # [B, T, in]: 8 rows
    more = jnp.ones((33, weight.shape[1]), jnp.float32)
    assert KERNEL not in _hlo(_linear, more, weight)
    q, scale = quantize_weight(weight)
    int8 = rows.MAX_ROWS[jnp.dtype(jnp.int8)]  # prompts too: 42 tokens' prefill 1.7x faster
    assert int8 == 256
    for count, taken in [(int8, True), (int8 + 1, False)]:
        many = jnp.ones((count, weight.shape[1]), jnp.float32)
        program = _hlo(lambda x: layers.linear(x, q, scale, jnp.float32), many)
        assert (KERNEL in program) == taken, count
    odd = jnp.ones((2, 40), jnp.float32)
    assert KERNEL not in _hlo(_linear, odd, jnp.ones((3, 40), jnp.float32))

    def narrow(x, w):
        return layers.linear(x, w, None, w.dtype)

    bf16 = weight.astype(jnp.bfloat16)
    assert KERNEL in _hlo(narrow, x.astype(jnp.bfloat16), bf16)
    limit = rows.pair_max_rows() if rows.pairs_available() else rows.MAX_ROWS[bf16.dtype]
    for count, taken in [(limit, True), (limit + 1, False)]:  # then XLA's (AMX) products
        many = jnp.ones((count, weight.shape[1]), jnp.bfloat16)
        assert (KERNEL in _hlo(narrow, many, bf16)) == taken, count
    assert KERNEL not in _hlo(narrow, x.astype(jnp.float16), weight.astype(jnp.float16))
    # float32 weights computed in bfloat16 are rounded first, as XLA's path does: not the kernel
    assert KERNEL not in _hlo(lambda x, w: layers.linear(x, w, None, jnp.bfloat16), x, weight)
    with rows.disabled():
        assert KERNEL not in _hlo(lambda x, w: _linear(x, w) + 0, x, weight)
    with jax.set_mesh(make_mesh((2, 4))):  # automatic axes: XLA's partitioned product
        assert KERNEL not in _hlo(lambda x, w: _linear(x, w) * 2, x, weight)


@pytest.mark.skipif(not rows.pairs_available(), reason="a CPU with AVX-512 BF16")
def test_bfloat16_products_take_the_pair_product_where_inputs_come_in_32s(weight):
    def narrow(x, w):
        return layers.linear(x, w, None, jnp.bfloat16)

    x = jnp.ones((4, 48), jnp.bfloat16)
    program = _hlo(narrow, x[:, :32], jnp.ones((5, 32), jnp.bfloat16))
    assert f"{KERNEL}_bf16_pairs" in program
    program = _hlo(narrow, x, jnp.ones((5, 48), jnp.bfloat16))  # 48 inputs: the widening kernel
    assert f"{KERNEL}_bf16(" in program and "pairs" not in program
    assert rows.pair_max_rows() == (16 if "amx_bf16" in native.cpu_flags() else 64)


def test_each_shard_map_block_runs_the_kernel(weight):
    mesh = make_mesh((2, 4))
    spec = jax.sharding.PartitionSpec
    blocks = jax.shard_map(
        _linear, mesh=mesh, in_specs=(spec("data"), spec("model")), out_specs=spec("data", "model")
    )
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, weight.shape[1]), np.float32))
    padded = jnp.concatenate([weight, weight[:3]])  # 80 outputs: 20 per block of "model"
    assert KERNEL in _hlo(blocks, x, padded)
    np.testing.assert_array_equal(np.asarray(jax.jit(blocks)(x, padded)), _linear(x, padded))


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_gradients_equal_xla_products(weight, kind):
    (matrix, scale, dtype), _ = _weights(weight, kind)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, weight.shape[1]), np.float32))
    x = (x * 0.03).astype(dtype)  # pre-activations of order 1, where tanh does not saturate
    argnums = (0, 2) if kind == "int8" else (0, 1)  # int8 weights have no gradient

    def loss(x, matrix, scale):
        return jnp.sum(jnp.tanh(layers.linear(x, matrix, scale, dtype)))

    with rows.disabled():  # a new function: traced here, with XLA's products
        expected = jax.jit(jax.grad(lambda *a: loss(*a) * 1.0, argnums=argnums))(x, matrix, scale)
    got = jax.jit(jax.grad(loss, argnums=argnums))(x, matrix, scale)
    tolerance = 1e-2 if kind == "bfloat16" else 1e-6  # bfloat16 gradients: rounded
    for a, b in zip(got, expected, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=tolerance * 10, atol=tolerance * np.abs(b).max())


def test_generate_runs_the_kernel_on_one_device_and_xla_products_on_a_mesh():
    model, params = genjax.models.from_pretrained(genjax.io.bundled.path())
    model = model.with_generation_config(None)
    ids = np.full((4, 6), 7, np.int32)
    config = genjax.GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=0)

    def program_text(**request) -> str:
        request = CallRequest.of(attention_mask=np.ones_like(ids), **request)
        return lower_program(prepare(model, params, ids, config, request)).as_text()

    assert KERNEL in program_text()
    assert KERNEL not in program_text(mesh=make_mesh((2, 4)))
