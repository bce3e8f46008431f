"""genjax's CPU kernel that writes new slots into a 16-bit KV cache block in place
(genjax/kernels/cache_writes.py): the bits ``dynamic_update_slice`` writes, for every slot axis,
count and index (negative and past the end included); XLA's write elsewhere; a bfloat16 decode
loop that no longer copies its cache blocks, and gives the same tokens and scores."""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import genjax
from genjax.cache.kv import write_slots
from genjax.generation.entry import lower_program
from genjax.generation.plan import CallRequest, prepare
from genjax.kernels import cache_writes, gate
from genjax.sharding import make_mesh

pytestmark = [
    pytest.mark.usefixtures("fast_compiles"),
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel"),
]

KERNEL = "genjax_write_slots_16"


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "shape, axis, count",
    [((2, 3, 16, 10), 3, 1), ((2, 3, 10, 16), 2, 1), ((2, 3, 10, 16), 2, 4), ((10, 4), 0, 10)],
)
def test_writes_equal_dynamic_update_slice(dtype, shape, axis, count):
    rng = np.random.default_rng(0)
    block = jnp.asarray(rng.standard_normal(shape), dtype)
    new_shape = tuple(count if d == axis else n for d, n in enumerate(shape))
    new = jnp.asarray(rng.standard_normal(new_shape), jnp.float32)  # cast to the block's dtype
    assert cache_writes.applies(block)
    write = jax.jit(lambda b, n, i: write_slots(b, n, i, axis))
    assert KERNEL in write.lower(block, new, jnp.int32(0)).as_text()
    for index in (-30, -3, 0, 5, shape[axis] - 1, 100):
        starts = tuple(jnp.int32(index) if d == axis else 0 for d in range(len(shape)))
        expected = jax.lax.dynamic_update_slice(block, new.astype(dtype), starts)
        np.testing.assert_array_equal(_bits(write(block, new, jnp.int32(index))), _bits(expected))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("keys", [True, False], ids=["keys", "values"])
def test_page_writes_equal_xlas_scatter(dtype, keys):
    rng = np.random.default_rng(2)
    shape = (9, 3, 16, 4) if keys else (9, 3, 4, 16)  # [N, K, H, bs] or [N, K, bs, H]
    pool = jnp.asarray(rng.standard_normal(shape), dtype)
    new = jnp.asarray(rng.standard_normal((6, 3, 16)), jnp.float32)
    blocks = jnp.asarray([4, 0, -2, 8, 9, 2], jnp.int32)  # -2: block 7; 9: past the pool
    offsets = jnp.asarray([1, 3, 0, -1, 2, 7], jnp.int32)  # -1: the last; 7: past the block
    assert cache_writes.applies(pool)
    write = jax.jit(lambda p, n, b, o: cache_writes.write_pages(p, n, b, o, keys=keys))
    assert "genjax_write_pages_16" in write.lower(pool, new, blocks, offsets).as_text()
    if keys:
        expected = pool.at[blocks, :, :, offsets].set(new.astype(dtype))
    else:
        expected = pool.at[blocks, :, offsets, :].set(new.astype(dtype))
    np.testing.assert_array_equal(_bits(write(pool, new, blocks, offsets)), _bits(expected))


def test_other_blocks_and_places_take_xlas_write():
    block, new = jnp.zeros((2, 8, 4), jnp.float32), jnp.ones((2, 1, 4), jnp.float32)
    assert not cache_writes.applies(block)  # float32: XLA writes it in place already
    text = jax.jit(lambda b, n: write_slots(b, n, jnp.int32(3), 1)).lower(block, new).as_text()
    assert KERNEL not in text
    wide = block.astype(jnp.bfloat16)
    with jax.set_mesh(make_mesh((2, 4))):  # automatic axes: no custom call
        assert not cache_writes.applies(wide)
    with gate.disabled(kernels=("cache_writes",)):
        assert not cache_writes.applies(wide)
        got = jax.jit(lambda b, n: write_slots(b, n, jnp.int32(3), 1))(wide, new)
    np.testing.assert_array_equal(np.asarray(got, np.float32)[:, 3], 1.0)
    np.testing.assert_array_equal(np.asarray(got, np.float32)[:, :3], 0.0)


def test_gradients_flow_as_through_dynamic_update_slice():
    block = jnp.asarray(np.random.default_rng(1).standard_normal((2, 6, 4)), jnp.bfloat16)
    new = jnp.ones((2, 1, 4), jnp.bfloat16)

    def loss(block, new, write):
        return jnp.sum(jnp.sin(write(block, new, jnp.int32(2)).astype(jnp.float32)))

    got = jax.grad(loss, argnums=(0, 1))(block, new, lambda b, n, i: write_slots(b, n, i, 1))
    xla = lambda b, n, i: jax.lax.dynamic_update_slice(b, n, (0, i, 0))  # noqa: E731
    expected = jax.grad(loss, argnums=(0, 1))(block, new, xla)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def _full_block_producers(text: str) -> collections.Counter:
    """What produces each bfloat16 [B, K, X, Y] array with no axis of length 1 (a whole cache
    block, not one slot) inside the program's loops: ``{op: count}``."""
    found, computation = collections.Counter(), None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%(\S+) ", line)
        if header:
            computation = "ENTRY" if header.group(1) else header.group(2)
            continue
        if computation in (None, "ENTRY") or computation.startswith(("fused", "wrapped")):
            continue
        made = re.match(r"\s*(?:ROOT )?%\S+ = bf16\[(\d+),(\d+),(\d+),(\d+)\]\S* ([\w-]+)\(", line)
        if made and "1" not in made.groups()[2:4]:
            found[made.group(5)] += 1
    return found


def test_a_bfloat16_decode_loop_writes_its_cache_in_place_with_the_same_tokens():
    model, params = genjax.models.from_pretrained(genjax.io.bundled.path(), dtype="bfloat16")
    model = model.with_generation_config(None)
    ids = np.array([[0, 0, 5, 9, 13, 2], [4, 8, 15, 16, 23, 42]], np.int32)
    mask = (ids != 0).astype(np.int32)
    layers = model.config.num_layers

    def producers(config) -> collections.Counter:
        request = CallRequest.of(attention_mask=mask)
        text = lower_program(prepare(model, params, ids, config, request)).compile().as_text()
        return _full_block_producers(text)

    config = genjax.GenerationConfig(
        max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True
    )
    # keys and values of each layer: written by the kernel, no fusion or copy rewrites them
    assert producers(config) == {"get-tuple-element": 2 * layers, "custom-call": 2 * layers}
    got = genjax.generate(model, params, ids, config, attention_mask=mask)
    with gate.disabled(kernels=("cache_writes",)):
        other = config.replace(max_new_tokens=7)  # another program, traced on XLA's path
        assert producers(other)["fusion"] == 2 * layers  # each step copies every block
        expected = genjax.generate(model, params, ids, other, attention_mask=mask)
    np.testing.assert_array_equal(got.sequences, expected.sequences[:, :-1])
    np.testing.assert_array_equal(np.asarray(got.scores), np.asarray(expected.scores)[:, :-1])
