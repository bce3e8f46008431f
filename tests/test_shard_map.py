"""``genjax.generate`` inside the user's own ``jax.shard_map`` gives the single-device results.

The params are replicated (``P()``) and the prompt rows split over ``data``; each device runs
``generate`` on its block of rows. Inside the mapped function the ids are tracers, so no bucket
padding is added; the tokens still equal a padded single-device call's.

Sampling inside the map is not tested here, to keep the file to two compiled programs (the
single-device reference is shared with tests/test_multihost.py); its key semantics are
documented in :mod:`genjax.sharding`.
"""

import jax
import numpy as np
import pytest
from encdec_models import recorded_model
from jax.sharding import PartitionSpec as P

import genjax
from genjax import sharding
from genjax.errors import ShardingError
from genjax.testing import left_padded_batch, write_random_checkpoint

BATCH, PROMPT, NEW = 8, 5, 4
GREEDY = genjax.GenerationConfig(max_new_tokens=NEW, pad_token_id=0, output_scores=True)


pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A 1-layer Llama with 8 query and 8 KV heads: a 2-way ``model`` axis splits both. The
    same shape as tests/test_multihost.py's, so the single-device greedy reference program
    (batch 8, bucket 16) compiles once for both files."""
    folder = tmp_path_factory.mktemp("shard_map")
    write_random_checkpoint(
        folder, "llama", num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
        head_dim=4,
    )  # fmt: skip
    return genjax.models.from_pretrained(folder)


@pytest.fixture(scope="module")
def inputs():
    return left_padded_batch(BATCH, PROMPT, 101)


@pytest.fixture(scope="module")
def reference(llama, inputs):
    model, params = llama
    ids, mask = inputs
    return genjax.generate(model, params, ids, GREEDY, attention_mask=mask)


def _per_shard(model, config, device_mesh, **kwargs):
    """jit(shard_map(generate)): params replicated, rows of ids and mask split on ``data``."""

    def run(params, ids, mask):
        out = genjax.generate(model, params, ids, config, attention_mask=mask, **kwargs)
        return out.sequences, out.scores

    mapped = jax.shard_map(
        run,
        mesh=device_mesh,
        in_specs=(P(), P("data"), P("data")),
        out_specs=P("data"),
        axis_names={"data"},  # manual over "data"; any other mesh axis stays automatic
    )
    return jax.jit(mapped)


def test_greedy_inside_shard_map_equals_single_device(llama, inputs, reference):
    """A (4, 2) mesh mapped over "data" only: two rows per block, and "model" left automatic,
    so inside the map generate constrains its KV cache's heads on "model" (the mesh in effect).
    With every axis manual there is nothing left to constrain."""
    model, params = llama
    ids, mask = inputs
    mesh = sharding.make_mesh((4, 2))
    sequences, scores = _per_shard(model, GREEDY, mesh)(params, ids, mask)
    np.testing.assert_array_equal(sequences, reference.sequences)
    np.testing.assert_allclose(scores, reference.scores, atol=1e-5, rtol=1e-5)

    seen = []  # the layout generate reads inside the map: "data" manual, "model" automatic

    def layout_inside(ids):
        seen.append(sharding.context_layout(model, batch=ids.shape[0]))
        return ids

    spec = dict(mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    jax.make_jaxpr(jax.shard_map(layout_inside, axis_names={"data"}, **spec))(ids)
    assert seen[0].cache_spec == P(None, "model", None, None)
    jax.make_jaxpr(jax.shard_map(layout_inside, **spec))(ids)  # every axis manual
    assert seen[1] is None  # nothing to constrain


def test_mesh_argument_inside_shard_map_raises_a_clear_error(llama, inputs):
    model, params = llama
    ids, mask = inputs
    mesh = sharding.make_mesh((2,), ("data",))
    with pytest.raises(ShardingError, match=r"mesh= inside shard_map .*\('data',\).*Drop mesh="):
        _per_shard(model, GREEDY, mesh, mesh=mesh)(params, ids, mask)


def test_encoder_decoder_inside_shard_map_and_pmap_equals_single_device():
    """T5 v1.1 (recorded): the decoder's first self-attention slots come from the start token
    alone, the same on every device, and still enter the loop typed as varying over "data"
    (genjax.typing.vary_like); pmap_generate's blocks equal one device too."""
    model, params, src, mask = recorded_model("t5_v1_1")
    ids, mask = np.resize(src, (4, src.shape[1])), np.resize(mask, (4, mask.shape[1]))
    config = genjax.GenerationConfig(max_new_tokens=NEW, pad_token_id=0)
    reference = genjax.generate(model, params, ids, config, attention_mask=mask).sequences
    mesh = sharding.make_mesh((4,), ("data",))
    rows = jax.sharding.NamedSharding(mesh, P("data"))
    sequences, _ = _per_shard(model, config, mesh)(
        params, jax.device_put(ids, rows), jax.device_put(mask, rows)
    )
    np.testing.assert_array_equal(sequences, reference)
    devices = jax.devices()[:4]
    mapped = genjax.pmap_generate(model, params, ids, config, attention_mask=mask, devices=devices)
    np.testing.assert_array_equal(mapped.sequences, reference)
