"""Sharded generate on 8 virtual CPU devices gives the single-device tokens.

Two tiny random models whose heads divide 8: a GQA Llama (8 query heads, 4 KV heads, so the KV
cache is split on ``model`` up to 4 ways and replicated on the (1, 8) mesh) and a GPT-2 (8 heads).
Each (mesh, model, strategy) compiles once; the single-device references are computed once.

Programs here compile with ``jax_disable_most_optimizations`` (LLVM at -O0), which halves XLA's
compile time on CPU; SPMD partitioning and the HLO passes still run, so the collectives the
checks below look for are the ones an optimized build has.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import genjax
from genjax import processors as proc
from genjax import sharding
from genjax.cache import KVCache
from genjax.decoding.sampling import DecodeRules, DecodeState, decode, greedy_chooser
from genjax.errors import InputError, ShardingError
from genjax.stopping import stopping_rules
from genjax.testing import (
    MESH_LLAMA,
    assert_same_generation,
    left_padded_batch,
    write_random_checkpoint,
)

BATCH, PROMPT, NEW = 8, 5, 4
GREEDY = genjax.GenerationConfig(max_new_tokens=NEW, pad_token_id=0, output_scores=True)
SAMPLE = GREEDY.replace(do_sample=True, temperature=0.8)
BEAM = GREEDY.replace(num_beams=2, num_return_sequences=2)
ATOL = 1e-4  # absolute, on scores of magnitude up to ~50 (float32 sums over D = 512)


pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (model, params). GPT-2 is wide (D = 512) so that every activation of these
    calls ([B, T <= 16, 3D]) is smaller than its smallest sharded weight ([D, D]): an
    all-gather that large can then only be a weight."""
    root = tmp_path_factory.mktemp("sharding")
    write_random_checkpoint(
        root / "llama",
        "llama",
        **MESH_LLAMA,
    )
    write_random_checkpoint(root / "gpt2", "gpt2", n_layer=1, n_head=8, n_embd=512)
    return {arch: genjax.models.from_pretrained(root / arch) for arch in ("llama", "gpt2")}


def _inputs(vocab: int):
    return left_padded_batch(BATCH, PROMPT, vocab)


def _counting(scores, context):
    """An identity processor that counts traces: one per compiled program."""
    _counting.traces += 1
    return scores


_counting.traces = 0


@pytest.fixture(scope="module")
def reference(models):
    """(arch, strategy) -> the single-device output, computed on first use."""
    configs = {"greedy": GREEDY, "sample": SAMPLE, "beam": BEAM}

    @functools.cache
    def run(arch, strategy):
        model, params = models[arch]
        ids, mask = _inputs(model.vocab_size)
        extra = [_counting] if strategy == "sample" else []
        return genjax.generate(
            model,
            params,
            ids,
            configs[strategy],
            attention_mask=mask,
            key=jax.random.key(7),
            logits_processor=extra,
        )

    return run


def _assert_same(out, expected):
    assert_same_generation(out, expected, ATOL)


def _assert_rows_on_data(out, mesh):
    rows = NamedSharding(mesh, P("data"))
    for name in ("sequences", "scores", "sequences_scores", "beam_indices"):
        value = getattr(out, name)
        if value is not None:
            assert value.sharding.is_equivalent_to(rows, value.ndim), (name, value.sharding)


# --- layouts and uneven sizes (nothing compiles) ----------------------------------------------


def test_layout_follows_the_rules_and_replicates_kv_heads_that_do_not_divide(models):
    model, params = models["llama"]
    layout = sharding.layout_for(model, sharding.make_mesh((2, 4)), batch=8)
    assert layout.cache_spec == P("data", "model", None, None)
    # 4 KV heads on an 8-way model axis: the cache and k/v projections fall back to replicated.
    wide = sharding.layout_for(model, sharding.make_mesh((1, 8)))
    assert wide.cache_spec == P("data", None, None, None)
    placed = wide.place_params(params)
    attention = placed["layers"]["0"]["self_attn"]
    assert attention["q_proj"]["kernel"].sharding.spec == P("model", None)
    assert attention["k_proj"]["kernel"].sharding.spec == P(None, None)
    assert wide.place_params(placed) is placed  # already on the mesh: left alone
    # A ("data",) mesh: rules naming "model" replicate, so this is pure data parallelism.
    data_only = sharding.layout_for(model, sharding.make_mesh((8,), ("data",)))
    assert data_only.cache_spec == P("data", None, None, None)
    assert sharding.logical_axes(params)["layers/0/mlp/down_proj/kernel"] == ("embed", "mlp")


def test_uneven_sizes_raise_clear_errors(models):
    model, params = models["llama"]
    ids, mask = _inputs(model.vocab_size)
    with pytest.raises(
        ShardingError, match=r"6 rows do not divide over mesh axis 'data' of size 4"
    ):
        genjax.generate(model, params, ids[:6], GREEDY, mesh=sharding.make_mesh((4, 2)))
    four_heads = genjax.models.llama.LlamaModel(
        genjax.models.llama.LlamaConfig(
            vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=4,
            num_kv_heads=2, head_dim=4,
        )
    )  # fmt: skip
    with pytest.raises(
        ShardingError, match=r"4 attention heads .* 'model' of size 8.* \[1, 2, 4\]"
    ):
        sharding.layout_for(four_heads, sharding.make_mesh((1, 8)))
    with pytest.raises(ValueError, match="does not divide"):  # ShardingError is a ValueError
        sharding.partition_spec(("mlp",), (12,), sharding.make_mesh((1, 8)))
    with pytest.raises(InputError, match="no mesh"):
        genjax.generate(model, params, ids, GREEDY, rules=sharding.DEFAULT_RULES)
    for junk in (5, "batch", [("batch", 1)], [("batch", "data", "model")]):
        with pytest.raises(TypeError, match=r"rules must be a dict or a sequence of \(logical"):
            genjax.generate(model, params, ids, GREEDY, rules=junk)
    with pytest.raises(ShardingError, match="6 rows of input_ids over 8 devices"):
        sharding.pmap_generate(model, params, ids[:6], GREEDY)
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.make_mesh((4, 4))


# --- the loop carry keeps its shardings ----------------------------------------------------------


def test_decode_loop_constrains_its_carry_every_step():
    """A fake step function writes the cache; replicated inputs come out sharded, so the
    constraint is what places the carry (rows on data, KV heads on model)."""
    mesh = sharding.make_mesh((2, 4))
    layout = sharding.Layout(mesh)
    batch, length, heads = 8, 6, 4

    def step(params, tokens, positions, cache, attention_mask):
        new = jnp.broadcast_to(tokens[:, :, None, None], (batch, 1, heads, 2)).astype(jnp.float32)
        _, _, cache = cache.update_layer(0, new, new)
        return jax.nn.one_hot((tokens + 1) % 5, 5), cache.advance(1)

    @jax.jit
    def run(tokens):
        state = DecodeState(
            tokens=tokens,
            length=jnp.asarray(2, jnp.int32),
            positions=jnp.full((batch,), 2, jnp.int32),
            cache=KVCache.create(1, batch, length, heads, 2).advance(2),
            attention_mask=jnp.ones((batch, length), jnp.int32),
            finished=jnp.zeros((batch,), bool),
            key=jax.random.key(0),
            scores=None,
            raw_logits=None,
        )
        rules = DecodeRules(
            process=proc.identity(),
            choose=greedy_chooser(),
            context=proc.LogitsContext.for_prompt(tokens[:, :2]),
            pad_token_id=jnp.asarray(0, jnp.int32),
            stopping=stopping_rules(None),
            constrain=layout.constrain,
        )
        return decode(step, None, state, jax.nn.one_hot((tokens[:, 1] + 1) % 5, 5), rules)

    tokens = jnp.zeros((batch, length), jnp.int32).at[:, 1].set(jnp.arange(batch) % 5)
    state = run(tokens)
    for x, spec in [
        (state.cache.keys[0], P("data", "model")),
        (state.cache.values[0], P("data", "model")),
        (state.tokens, P("data")),
        (state.finished, P("data")),
    ]:
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), x.sharding
    np.testing.assert_array_equal(state.tokens[:, 2:], (tokens[:, 1:2] + jnp.arange(1, 5)) % 5)
    np.testing.assert_array_equal(state.cache.keys[0][:, 0, 0, 4], state.tokens[:, 4])


def _all_gathers(hlo: str) -> list[tuple[int, ...]]:
    """The result shapes of every all-gather in compiled HLO text."""
    shapes = []
    for match in re.finditer(r"= \(?([^=]*?)\)? all-gather(?:-start)?\(", hlo):
        for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", match.group(1)):
            shapes.append(tuple(int(d) for d in dims.split(",") if d))
    return shapes


def _while_carries(hlo: str) -> list[str]:
    """The tuple types carried by every while loop in compiled HLO text."""
    return re.findall(r"= \((.*?)\) while\(", hlo)


@pytest.mark.parametrize(
    ("arch", "strategy"), [("llama", "greedy"), ("gpt2", "greedy"), ("llama", "beam")]
)
def test_jit_under_set_mesh_keeps_carry_sharded_and_gathers_no_weight(
    models, reference, arch, strategy
):
    """Your own jax.jit under ``jax.set_mesh``: generate constrains its carry from the mesh in
    effect. The compiled program carries per-device blocks of the cache through its while
    loops, and no all-gather returns as many elements as a sharded weight matrix."""
    model, params = models[arch]
    ids, mask = _inputs(model.vocab_size)
    mesh = sharding.make_mesh((2, 4))
    config = {"greedy": GREEDY, "beam": BEAM}[strategy]
    sharded = sharding.shard_params(params, mesh)
    rows = sharding.batch_sharding(mesh)

    def run(params, ids, mask):
        return genjax.generate(model, params, ids, config, attention_mask=mask)

    with jax.set_mesh(mesh):
        args = (sharded, jax.device_put(ids, rows), jax.device_put(mask, rows))
        compiled = jax.jit(run).lower(*args).compile()
        out = compiled(*args)
    _assert_same(out, reference(arch, strategy))
    _assert_rows_on_data(out, mesh)

    hlo = compiled.as_text()
    weights = [
        x.size
        for x in jax.tree.leaves(sharded)
        if x.ndim == 2 and any(axis is not None for axis in x.sharding.spec)
    ]
    gathers = _all_gathers(hlo)
    too_big = [s for s in gathers if np.prod(s) >= min(weights)]
    assert not too_big, f"all-gathers as large as a weight ({min(weights)} elements): {too_big}"
    if arch == "llama" and strategy == "greedy":
        assert gathers == []  # heads split, KV heads split, rows split: nothing to gather

    # Each layer's values [B*M, K, S, H] are carried as per-device blocks [B*M/2, K/4, S, H],
    # its keys [B*M, K, H, S] as [B*M/2, K/4, H, S].
    copies = config.with_defaults().num_beams
    layers, kv_heads, head_dim = model.num_layers, model.num_kv_heads, model.head_dim
    rows, heads, slots = BATCH * copies, kv_heads, PROMPT + NEW
    carries = _while_carries(hlo)
    for last_two in ((slots, head_dim), (head_dim, slots)):
        block = f"f32[{rows // 2},{heads // 4},{last_two[0]},{last_two[1]}]"
        whole = f"f32[{rows},{heads},{last_two[0]},{last_two[1]}]"
        assert any(c.count(block) == layers for c in carries), carries
        assert not any(whole in c for c in carries), carries


# --- equivalence with one device -------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 8), (4, 2), (8, 1)])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_generate_with_mesh_equals_single_device(models, reference, arch, shape):
    """generate(mesh=...) places params and rows itself; (2, 4) is covered above."""
    model, params = models[arch]
    ids, mask = _inputs(model.vocab_size)
    mesh = sharding.make_mesh(shape)
    out = genjax.generate(model, params, ids, GREEDY, attention_mask=mask, mesh=mesh)
    _assert_same(out, reference(arch, "greedy"))
    _assert_rows_on_data(out, mesh)


def test_sampling_with_the_same_key_gives_the_same_tokens_on_every_layout(models, reference):
    """Each mesh compiles once; a new key and temperature then reuse its program."""
    model, params = models["llama"]
    ids, mask = _inputs(model.vocab_size)
    before = _counting.traces
    expected = reference("llama", "sample")
    per_program = _counting.traces - before  # the processor is traced once or twice a program
    assert per_program > 0
    assert not np.array_equal(expected.sequences, reference("llama", "greedy").sequences)
    key = jax.random.key(7)

    def sample(mesh, config=SAMPLE, key=key):
        return genjax.generate(
            model, params, ids, config, attention_mask=mask, key=key, mesh=mesh,
            logits_processor=[_counting],
        )  # fmt: skip

    for shape in [(1, 8), (2, 4), (4, 2), (8, 1)]:
        mesh = sharding.make_mesh(shape)
        before = _counting.traces
        _assert_same(sample(mesh), expected)
        assert _counting.traces == before + per_program, shape
    other = sample(mesh, SAMPLE.replace(temperature=1.3), jax.random.key(8))
    assert _counting.traces == before + per_program  # nothing recompiled
    assert other.sequences.shape == expected.sequences.shape


def test_beam_search_with_mesh_equals_single_device(models, reference):
    """(8, 1) here, (2, 4) above: beams of a prompt stay on the device holding its rows."""
    model, params = models["llama"]
    ids, mask = _inputs(model.vocab_size)
    mesh = sharding.make_mesh((8, 1))
    out = genjax.generate(model, params, ids, BEAM, attention_mask=mask, mesh=mesh)
    _assert_same(out, reference("llama", "beam"))
    _assert_rows_on_data(out, mesh)


FLAGS = {"output_hidden_states": True, "output_attentions": True}


def _assert_same_records(out, expected, names=("hidden_states", "attentions")):
    """Every recorded forward output (tuples per token of arrays per layer) within ``ATOL``."""
    for name in names:
        got, want = jax.tree.leaves(getattr(out, name)), jax.tree.leaves(getattr(expected, name))
        assert len(got) == len(want) > 0, name
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, atol=ATOL, rtol=1e-5)


@pytest.mark.slow  # 10 s: runs with -m slow
def test_hidden_states_and_attentions_on_a_mesh_equal_single_device(models):
    """``output_hidden_states`` / ``output_attentions`` on a (2, 4) mesh: greedy with ``mesh=``,
    beams under your own jax.jit with ``jax.set_mesh``; the outputs keep their rows on ``data``
    and the loop carries the recorded buffers ``[N - 1, L + 1, B*M, 1, D]`` as per-device row
    blocks."""
    model, params = models["llama"]
    ids, mask = _inputs(model.vocab_size)
    mesh = sharding.make_mesh((2, 4))
    on_data = NamedSharding(mesh, P("data"))
    greedy = GREEDY.replace(**FLAGS)
    expected = genjax.generate(model, params, ids, greedy, attention_mask=mask)
    out = genjax.generate(model, params, ids, greedy, attention_mask=mask, mesh=mesh)
    _assert_same(out, expected)
    _assert_same_records(out, expected)
    for leaf in jax.tree.leaves((out.hidden_states, out.attentions)):
        assert leaf.sharding.is_equivalent_to(on_data, leaf.ndim), leaf.sharding

    beam = BEAM.replace(**FLAGS)
    rows = sharding.batch_sharding(mesh)

    def run(params, ids, mask):
        return genjax.generate(model, params, ids, beam, attention_mask=mask)

    # jitted on one device too: no bucket padding either, so the query rows of the user's
    # padding (which bucket padding changes) match as well
    expected = jax.jit(run)(params, ids, mask)

    with jax.set_mesh(mesh):
        args = (sharding.shard_params(params, mesh), *jax.device_put((ids, mask), rows))
        compiled = jax.jit(run).lower(*args).compile()
        out = compiled(*args)
    _assert_same(out, expected)
    _assert_same_records(out, expected)
    for leaf in jax.tree.leaves((out.hidden_states, out.attentions)):
        assert leaf.sharding.is_equivalent_to(on_data, leaf.ndim), leaf.sharding
    buffer = (NEW - 1, model.num_layers + 1, BATCH * 2, 1, model.config.hidden_size)
    block = "f32[" + ",".join(map(str, (*buffer[:2], buffer[2] // 2, *buffer[3:]))) + "]"
    carries = _while_carries(compiled.as_text())
    assert any(block in c for c in carries), (block, carries)
    assert not any("f32[" + ",".join(map(str, buffer)) + "]" in c for c in carries)


def test_pmap_generate_equals_single_device(models, reference):
    model, params = models["llama"]
    ids, mask = _inputs(model.vocab_size)
    out = sharding.pmap_generate(model, params, ids, GREEDY, attention_mask=mask)
    _assert_same(out, reference("llama", "greedy"))
