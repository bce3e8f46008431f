"""Encoder-decoder generate on a (2, 4) mesh of 8 virtual CPU devices gives one device's tokens.

Tiny random T5 (v1.0) and BART checkpoints with 4 attention heads, so heads split 4 ways on
``model``; 4 source rows, so rows split 2 ways on ``data``. Each (model, strategy) compiles one
sharded and one single-device program.
"""

import functools
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from matrix import spread

import genjax
from genjax import sharding
from genjax.errors import ShardingError, UnsupportedError
from genjax.testing import assert_same_generation, write_random_checkpoint

BATCH, SOURCE, NEW = 4, 7, 5
GREEDY = genjax.GenerationConfig(
    max_new_tokens=NEW, pad_token_id=0, eos_token_id=2, output_scores=True
)
BEAM = GREEDY.replace(num_beams=2, num_return_sequences=2)
CONFIGS = {"greedy": GREEDY, "beam": BEAM}
ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (model, params): the tiny T5 v1.0 and BART of genjax.testing (4 heads each)."""
    root = tmp_path_factory.mktemp("encdec_sharding")
    for arch in ("t5", "bart"):
        write_random_checkpoint(root / arch, arch, seed=1)
    return {arch: genjax.models.from_pretrained(root / arch) for arch in ("t5", "bart")}


def _source(vocab: int):
    """int32[4, 7] source ids and their mask; rows 1 and 3 end early (right padding)."""
    ids = np.random.default_rng(0).integers(3, vocab, (BATCH, SOURCE)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 4:] = 0
    mask[3, 3:] = 0
    return ids, mask


@pytest.fixture(scope="module")
def reference(models):
    """(arch, strategy) -> the single-device output, computed on first use."""

    @functools.cache
    def run(arch, strategy):
        model, params = models[arch]
        ids, mask = _source(model.vocab_size)
        return genjax.generate(model, params, ids, CONFIGS[strategy], attention_mask=mask)

    return run


def _assert_same(out, expected):
    assert_same_generation(out, expected, ATOL)


# --- rules and layouts (nothing compiles) ------------------------------------------------------


def test_t5_and_bart_params_follow_column_then_row_parallel_rules(models):
    t5 = sharding.logical_axes(models["t5"][1])
    for attention in (
        "encoder/block/0/layer/0/SelfAttention",
        "decoder/block/1/layer/1/EncDecAttention",
    ):
        assert t5[f"{attention}/q/kernel"] == ("heads", "embed")
        assert t5[f"{attention}/k/kernel"] == t5[f"{attention}/v/kernel"] == ("kv_heads", "embed")
        assert t5[f"{attention}/o/kernel"] == ("embed", "heads")
    assert t5["decoder/block/0/layer/0/SelfAttention/relative_attention_bias/embedding"] == (
        None,
        "heads",
    )
    assert t5["encoder/block/1/layer/1/DenseReluDense/wi/kernel"] == ("mlp", "embed")
    assert t5["decoder/block/0/layer/2/DenseReluDense/wo/kernel"] == ("embed", "mlp")
    assert t5["shared/embedding"] == ("vocab", "embed")
    assert t5["decoder/block/0/layer/2/layer_norm/scale"] == (None,)

    bart = sharding.logical_axes(models["bart"][1])
    layer = "model/decoder/layers/1"
    for attention in ("self_attn", "encoder_attn"):
        assert bart[f"{layer}/{attention}/q_proj/kernel"] == ("heads", "embed")
        assert bart[f"{layer}/{attention}/v_proj/bias"] == ("kv_heads",)
        assert bart[f"{layer}/{attention}/out_proj/kernel"] == ("embed", "heads")
        assert bart[f"{layer}/{attention}/out_proj/bias"] == (None,)  # added after the reduction
    assert bart[f"{layer}/fc1/kernel"] == ("mlp", "embed")
    assert bart[f"{layer}/fc1/bias"] == ("mlp",)
    assert bart[f"{layer}/fc2/kernel"] == ("embed", "mlp")
    assert bart["model/encoder/embed_positions/embedding"] == ("positions", "embed")

    placed = sharding.shard_params(models["bart"][1], sharding.make_mesh((2, 4)))
    kernel = placed["model"]["decoder"]["layers"]["0"]["encoder_attn"]["k_proj"]["kernel"]
    assert kernel.sharding.spec == P("model", None)


def test_encoder_heads_that_do_not_divide_raise_naming_them(models, tmp_path):
    write_random_checkpoint(tmp_path, "bart", encoder_attention_heads=2)
    model, params = genjax.models.from_pretrained(tmp_path)
    ids, mask = _source(model.vocab_size)
    with pytest.raises(ShardingError, match="2 encoder attention heads"):
        genjax.generate(
            model, params, ids, GREEDY, attention_mask=mask, mesh=sharding.make_mesh((2, 4))
        )
    model, params = models["t5"]  # what stays refused names itself, mesh or not
    with pytest.raises(UnsupportedError, match="guidance_scale"):
        genjax.generate(
            model, params, ids, GREEDY, attention_mask=mask, mesh=sharding.make_mesh((2, 4)),
            guidance_scale=2.0,
        )  # fmt: skip


# --- equivalence with one device ---------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, strategy",
    spread([("t5", "greedy"), ("t5", "beam"), ("bart", "greedy"), ("bart", "beam")], 1),
)
def test_generate_with_mesh_equals_single_device(models, reference, arch, strategy):
    model, params = models[arch]
    ids, mask = _source(model.vocab_size)
    mesh = sharding.make_mesh((2, 4))
    out = genjax.generate(model, params, ids, CONFIGS[strategy], attention_mask=mask, mesh=mesh)
    _assert_same(out, reference(arch, strategy))
    rows = NamedSharding(mesh, P("data"))
    for name in ("sequences", "scores", "sequences_scores", "beam_indices"):
        value = getattr(out, name)
        if value is not None:
            assert value.sharding.is_equivalent_to(rows, value.ndim), (name, value.sharding)


@pytest.mark.slow  # 10 s: runs with -m slow
def test_max_cache_len_beams_on_a_mesh_equal_single_device(models, reference):
    """``max_cache_len``: the decoder's 12 slots split like the others; the first ``1 + N``
    columns (``N`` steps) are the single-device call's without it, ``pad_token_id`` after."""
    model, params = models["t5"]
    ids, mask = _source(model.vocab_size)
    mesh = sharding.make_mesh((2, 4))
    out = genjax.generate(
        model, params, ids, BEAM, attention_mask=mask, mesh=mesh, max_cache_len=12
    )
    np.testing.assert_array_equal(out.sequences[:, 1 + NEW :], 0)
    np.testing.assert_array_equal(out.beam_indices[:, NEW:], -1)
    cut = out.replace(
        sequences=out.sequences[:, : 1 + NEW],
        scores=out.scores[:, :NEW],
        beam_indices=out.beam_indices[:, :NEW],
    )
    _assert_same(cut, reference("t5", "beam"))


@pytest.mark.slow  # 18 s: runs with -m slow
def test_hidden_states_and_attentions_on_a_mesh_equal_single_device(models):
    """Beam search recording the encoder's, the decoder's and the cross-attention outputs on a
    (2, 4) mesh: the tokens and every recorded array equal one device's, rows on ``data``."""
    model, params = models["bart"]
    ids, mask = _source(model.vocab_size)
    config = BEAM.replace(output_hidden_states=True, output_attentions=True)
    expected = genjax.generate(model, params, ids, config, attention_mask=mask)
    mesh = sharding.make_mesh((2, 4))
    out = genjax.generate(model, params, ids, config, attention_mask=mask, mesh=mesh)
    _assert_same(out, expected)
    names = ["encoder_hidden_states", "encoder_attentions", "decoder_hidden_states"]
    for name in names + ["decoder_attentions", "cross_attentions"]:
        got, want = jax.tree.leaves(getattr(out, name)), jax.tree.leaves(getattr(expected, name))
        assert len(got) == len(want) > 0, name
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, atol=ATOL, rtol=1e-5)
            assert g.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), g.ndim), name


def test_jit_under_set_mesh_carries_cross_blocks_split_on_rows_and_heads(models, reference):
    """Your own jax.jit under ``jax.set_mesh``: no all-gather is as large as a sharded weight, and
    the while loop carries each layer's decoder slots and per-prompt cross-attention blocks as
    per-device blocks (rows / 2, heads / 4)."""
    model, params = models["bart"]
    ids, mask = _source(model.vocab_size)
    mesh = sharding.make_mesh((2, 4))
    rows = sharding.batch_sharding(mesh)

    def run(params, ids, mask):
        return genjax.generate(model, params, ids, GREEDY, attention_mask=mask)

    with jax.set_mesh(mesh):
        args = (sharding.shard_params(params, mesh), *jax.device_put((ids, mask), rows))
        compiled = jax.jit(run).lower(*args).compile()
        out = compiled(*args)
    _assert_same(out, reference("bart", "greedy"))

    hlo = compiled.as_text()
    weights = [x.size for x in jax.tree.leaves(args[0]) if x.ndim == 2 and any(x.sharding.spec)]
    gathers = [
        np.prod([int(d) for d in dims.split(",") if d])
        for match in re.finditer(r"= \(?([^=]*?)\)? all-gather(?:-start)?\(", hlo)
        for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", match.group(1))
    ]
    assert all(size < min(weights) for size in gathers), (min(weights), gathers)

    heads, head_dim, slots = model.num_kv_heads, model.head_dim, 1 + NEW
    carries = re.findall(r"= \((.*?)\) while\(", hlo)
    blocks = {  # per layer: decoder keys, values; cross keys, values
        "self": [
            (BATCH // 2, heads // 4, *last) for last in ((head_dim, slots), (slots, head_dim))
        ],
        "cross": [
            (BATCH // 2, heads // 4, *last) for last in ((head_dim, SOURCE), (SOURCE, head_dim))
        ],
    }
    for kind, shapes in blocks.items():
        for shape in shapes:
            block = "f32[" + ",".join(map(str, shape)) + "]"
            assert any(c.count(block) == model.num_layers for c in carries), (kind, block)


@pytest.mark.slow  # 15 s; the default run keeps T5 greedy and BART beams on a mesh
def test_encoder_outputs_and_sampling_on_a_mesh_equal_single_device(models, reference):
    """``encoder_outputs=`` states are placed with their rows on ``data``; sampling with the same
    key draws the single-device tokens."""
    model, params = models["t5"]
    ids, mask = _source(model.vocab_size)
    mesh = sharding.make_mesh((2, 4))
    states = model.encode(params, ids, mask)
    out = genjax.generate(
        model, params, None, GREEDY, attention_mask=mask, encoder_outputs=states, mesh=mesh
    )
    _assert_same(out, reference("t5", "greedy"))

    sample = GREEDY.replace(do_sample=True, temperature=0.8, max_new_tokens=3)
    key = jax.random.key(3)
    expected = genjax.generate(model, params, ids, sample, attention_mask=mask, key=key)
    out = genjax.generate(model, params, ids, sample, attention_mask=mask, key=key, mesh=mesh)
    _assert_same(out, expected)
