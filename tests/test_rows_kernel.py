"""genjax's float32 CPU kernel for products of 1-32 activation rows (genjax/kernels/rows.py):
float32 accuracy, each row's bits independent of the other rows, XLA's product where the kernel
does not apply (more rows, odd widths, meshes), gradients, and generate taking it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import genjax
from genjax.generation.entry import lower_program
from genjax.generation.plan import CallRequest, prepare
from genjax.kernels import rows
from genjax.models import layers
from genjax.sharding import make_mesh

pytestmark = [
    pytest.mark.usefixtures("fast_compiles"),
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel"),
]


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


@pytest.mark.parametrize("count", [1, 2, 5, 7, 8, 32])
def test_products_are_float32_accurate_and_each_row_is_its_own(weight, count):
    rng = np.random.default_rng(count)
    x = jnp.asarray(rng.standard_normal((count, weight.shape[1]), dtype=np.float32))
    assert rows.applies(x, weight)
    y = np.asarray(jax.jit(_linear)(x, weight))
    exact = np.asarray(x, np.float64) @ np.asarray(weight, np.float64).T
    np.testing.assert_allclose(y, exact, rtol=0, atol=2e-5 * np.abs(exact).max())
    # Each row gets the bits it gets alone: a request decoded beside others equals it alone.
    alone = np.concatenate(
        [np.asarray(jax.jit(_linear)(x[i : i + 1], weight)) for i in range(count)]
    )
    np.testing.assert_array_equal(y, alone)


def test_the_kernel_runs_exactly_where_it_applies(weight):
    x = jnp.ones((8, weight.shape[1]), jnp.float32)
    assert rows.TARGET in _hlo(_linear, x, weight)
    assert rows.TARGET in _hlo(_linear, x.reshape(2, 4, -1), weight)  # [B, T, in]: 8 rows
    more = jnp.ones((rows.MAX_ROWS + 1, weight.shape[1]), jnp.float32)
    assert rows.TARGET not in _hlo(_linear, more, weight)
    odd = jnp.ones((2, 40), jnp.float32)
    assert rows.TARGET not in _hlo(_linear, odd, jnp.ones((3, 40), jnp.float32))
    narrow = weight.astype(jnp.bfloat16)
    assert rows.TARGET not in _hlo(lambda x, w: layers.linear(x, w, None, jnp.bfloat16), x, narrow)
    with rows.disabled():
        assert rows.TARGET not in _hlo(lambda x, w: _linear(x, w) + 0, x, weight)
    with jax.set_mesh(make_mesh((2, 4))):  # automatic axes: XLA's partitioned product
        assert rows.TARGET not in _hlo(lambda x, w: _linear(x, w) * 2, x, weight)


def test_each_shard_map_block_runs_the_kernel(weight):
    mesh = make_mesh((2, 4))
    spec = jax.sharding.PartitionSpec
    blocks = jax.shard_map(
        _linear, mesh=mesh, in_specs=(spec("data"), spec("model")), out_specs=spec("data", "model")
    )
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, weight.shape[1]), np.float32))
    padded = jnp.concatenate([weight, weight[:3]])  # 80 outputs: 20 per block of "model"
    assert rows.TARGET in _hlo(blocks, x, padded)
    np.testing.assert_array_equal(np.asarray(jax.jit(blocks)(x, padded)), _linear(x, padded))


def test_gradients_equal_xla_products(weight):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, weight.shape[1]), np.float32))
    x = x * 0.03  # pre-activations of order 1, where tanh does not saturate

    def loss(x, weight):
        return jnp.sum(jnp.tanh(_linear(x, weight)))

    with rows.disabled():
        expected = jax.jit(jax.grad(lambda x, w: loss(x, w) * 1.0, argnums=(0, 1)))(x, weight)
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, weight)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


def test_generate_runs_the_kernel_on_one_device_and_xla_products_on_a_mesh():
    model, params = genjax.models.from_pretrained(genjax.io.bundled.path())
    model = model.with_generation_config(None)
    ids = np.full((4, 6), 7, np.int32)
    config = genjax.GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=0)

    def program_text(**request) -> str:
        request = CallRequest.of(attention_mask=np.ones_like(ids), **request)
        return lower_program(prepare(model, params, ids, config, request)).as_text()

    assert rows.TARGET in program_text()
    assert rows.TARGET not in program_text(mesh=make_mesh((2, 4)))
