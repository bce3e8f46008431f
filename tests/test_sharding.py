"""Sharded parameters and inputs on 8 virtual CPU devices give the single-device tokens."""

import functools
from pathlib import Path

import jax
import numpy as np
import pytest

import genjax
from genjax import sharding

FIXTURES = Path(__file__).parent / "fixtures"


@functools.cache
def _setup(arch):
    model, params = genjax.models.from_pretrained(FIXTURES / arch)
    records = np.load(FIXTURES / arch / "records.npz")
    ids = np.concatenate([records["greedy/input_ids"]] * 2)[:4]  # B = 4 divides data axes
    mask = np.concatenate([records["greedy/attention_mask"]] * 2)[:4]
    config = genjax.GenerationConfig(max_new_tokens=6, pad_token_id=0, output_scores=True)
    expected = genjax.generate(model, params, ids, config, attention_mask=mask)
    return model, params, ids, mask, config, expected


def test_rules_name_every_projection_and_check_divisibility():
    model, params, *_ = _setup("llama")
    axes = sharding.logical_axes(params)
    assert axes["layers/0/self_attn/q_proj/kernel"] == ("embed", "heads")
    assert axes["layers/1/mlp/down_proj/kernel"] == ("mlp", "embed")
    assert axes["norm/scale"] == (None,)
    mesh = sharding.make_mesh((1, 8))
    with pytest.raises(ValueError, match="does not divide"):
        sharding.partition_spec(("heads",), (12,), mesh)
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.make_mesh((4, 4))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_sharded_generate_equals_single_device(arch, shape):
    model, params, ids, mask, config, expected = _setup(arch)
    mesh = sharding.make_mesh(shape)
    sharded = sharding.shard_params(params, mesh)
    q = sharded["layers" if arch == "llama" else "h"]["0"]
    q = q["self_attn"]["q_proj"]["kernel"] if arch == "llama" else q["attn"]["c_attn"]["kernel"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    rows = sharding.batch_sharding(mesh)
    ids_s, mask_s = jax.device_put(ids, rows), jax.device_put(mask, rows)
    generate = jax.jit(functools.partial(genjax.generate, model))
    out = generate(sharded, ids_s, config, attention_mask=mask_s)
    np.testing.assert_array_equal(out.sequences, expected.sequences)
    np.testing.assert_allclose(out.scores, expected.scores, atol=1e-4)
