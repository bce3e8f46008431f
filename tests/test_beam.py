"""Beam search and beam sampling against recorded transformers runs, and their invariants."""

import functools
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matrix import spread

import genjax
from genjax import GenerationConfig
from genjax import processors as P
from genjax.decoding import beam
from genjax.errors import GenerationConfigError, UnsupportedError

pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py

FIXTURES = Path(__file__).parent / "fixtures"
ARCHS = ["llama", "gpt2", "qwen3", "olmo2", "phi3", "gemma3"]  # recorded in tests/fixtures/beam
LIVE_ARCHS = ["llama", "gpt2", "qwen2"]


@functools.cache
def _model(arch):
    return genjax.models.from_pretrained(FIXTURES / arch)


@functools.cache
def _load(arch):
    model, params = _model(arch)
    meta = json.loads((FIXTURES / "beam" / f"{arch}.json").read_text())
    arrays = dict(np.load(FIXTURES / "beam" / f"{arch}.npz"))
    return model, params, meta, arrays


def _cases():
    """(architecture, case) for every recorded case; up to three per architecture by default,
    the rest under ``-m slow`` (``tests/matrix.py``)."""
    cells = []
    for arch in ARCHS:
        meta = json.loads((FIXTURES / "beam" / f"{arch}.json").read_text())
        cells += [(arch, case["name"]) for case in meta["cases"]]
    return spread(cells, per_row=3)


def _config(case) -> GenerationConfig:
    kwargs = dict(case["generate_kwargs"])
    kwargs.pop("return_dict_in_generate")
    return GenerationConfig(**kwargs)


def _check_case(model, params, case, arrays):
    """Runs one recorded transformers case through genjax and compares every output."""
    name, config = case["name"], _config(case)
    ids, mask = arrays["input_ids"], arrays["attention_mask"]
    out = genjax.generate(model, params, ids, config, attention_mask=mask, key=jax.random.key(0))
    expected_scores = arrays[f"{name}/scores"]
    steps = expected_scores.shape[1]
    np.testing.assert_allclose(out.scores[:, :steps], expected_scores, atol=1e-4)
    if config.do_sample:  # sampled continuations come from the RNG; the first scores do not
        return
    np.testing.assert_array_equal(out.scores[:, steps:], 0.0)
    indices = arrays[f"{name}/beam_indices"]
    length = indices.shape[1]
    np.testing.assert_array_equal(out.beam_indices[:, :length], indices)
    np.testing.assert_array_equal(out.beam_indices[:, length:], -1)
    np.testing.assert_allclose(out.sequences_scores, arrays[f"{name}/sequences_scores"], atol=1e-4)
    # transformers' sequences are cut after `length` steps; genjax's hold N steps, filled after
    # each hypothesis' end with the same value as transformers: `pad_token_id or eos_token_id[0]`.
    expected = arrays[f"{name}/sequences"]
    np.testing.assert_array_equal(out.sequences[:, : expected.shape[1]], expected)
    eos = np.atleast_1d(config.eos_token_id)
    fill = config.pad_token_id or eos[0]
    np.testing.assert_array_equal(out.sequences[:, expected.shape[1] :], fill)


@pytest.mark.parametrize("arch, name", _cases())
def test_matches_recorded_transformers(arch, name):
    model, params, meta, arrays = _load(arch)
    _check_case(model, params, next(c for c in meta["cases"] if c["name"] == name), arrays)


@pytest.mark.parity
@pytest.mark.parametrize("arch", LIVE_ARCHS)
def test_matches_live_transformers(arch):
    spec = importlib.util.spec_from_file_location(
        "make_beam_fixtures", FIXTURES / "make_beam_fixtures.py"
    )
    make_beam_fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_beam_fixtures)
    built = make_beam_fixtures.build(arch)
    model, params = _model(arch)
    for case in built["cases"]:
        _check_case(model, params, case, built["arrays"])


def test_recorded_cases_exercise_early_stopping():
    """The fixtures are only useful if the settings really change the search."""
    _, _, meta, arrays = _load("llama")
    by_name = {c["name"]: c for c in meta["cases"]}
    assert by_name["many_es_true"]["n_run"] < 8  # every prompt done: the run stops early
    results = {
        str(arrays[f"many_es_{s}/sequences_scores"].tolist()) for s in ("false", "true", "never")
    }
    assert len(results) == 3
    ends_early = by_name["one_r2"]["ends_early"]
    assert any(ends_early) and not all(ends_early)


def _transformers_lengths(beam_indices):
    return np.sum(np.asarray(beam_indices) >= 0, axis=1)


def test_transition_scores_rebuild_sequences_scores():
    model, params, meta, arrays = _load("llama")
    case = next(c for c in meta["cases"] if c["name"] == "many_lp_half")
    config = _config(case)
    out = genjax.generate(
        model, params, arrays["input_ids"], config, attention_mask=arrays["attention_mask"]
    )
    steps = genjax.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
    assert steps.shape == out.beam_indices.shape
    length = _transformers_lengths(out.beam_indices)
    assert (length < 8).any()  # some hypotheses ended early: the length matters
    np.testing.assert_allclose(steps.sum(-1) / length**0.5, out.sequences_scores, rtol=1e-5)
    # transformers' documented recipe counts the negative transition scores.
    negative = np.sum(np.asarray(steps) < 0, axis=1)
    np.testing.assert_allclose(steps.sum(-1) / negative**0.5, out.sequences_scores, rtol=1e-5)
    # On transformers' own (shorter) outputs, given as a tuple of steps, the same holds.
    scores = arrays["many_lp_half/scores"]
    recorded = genjax.compute_transition_scores(
        arrays["many_lp_half/sequences"],
        tuple(scores[:, t] for t in range(scores.shape[1])),
        arrays["many_lp_half/beam_indices"],
    )
    length = _transformers_lengths(arrays["many_lp_half/beam_indices"])
    np.testing.assert_allclose(
        recorded.sum(-1) / length**0.5, arrays["many_lp_half/sequences_scores"], rtol=1e-5
    )


def test_jitted_equals_unjitted():
    model, params, meta, arrays = _load("llama")
    config = _config(next(c for c in meta["cases"] if c["name"] == "many_es_true"))
    ids, mask = arrays["input_ids"], arrays["attention_mask"]
    eager = genjax.generate(model, params, ids, config, attention_mask=mask)
    generate = functools.partial(genjax.generate, model)
    jitted = jax.jit(lambda p, i, c, m: generate(p, i, c, attention_mask=m))(
        params, ids, config, mask
    )
    for name in ("sequences", "sequences_scores", "beam_indices", "scores"):
        np.testing.assert_allclose(getattr(jitted, name), getattr(eager, name), atol=1e-5)


def test_beam_sampling_traced_values_compile_nothing_and_prompts_are_independent():
    """One compiled program: new keys, temperature, top-k, EOS ids and per-prompt
    length_penalty values reuse it; each prompt's search depends only on its own settings."""
    model, params, _, arrays = _load("gpt2")
    ids, mask = arrays["input_ids"], arrays["attention_mask"]
    traces = []

    def counting(scores, context):
        traces.append(1)
        return scores

    def run(seed=0, penalty=(1.0, 1.0, 1.0), **changes):
        settings = dict(
            num_beams=4,
            num_return_sequences=2,
            max_new_tokens=6,
            do_sample=True,
            temperature=0.7,
            top_k=10,
            eos_token_id=[64, 79],
            pad_token_id=0,
            output_scores=True,
        )
        config = GenerationConfig(length_penalty=jnp.array(penalty), **{**settings, **changes})
        key = jax.random.key(seed)
        return genjax.generate(
            model, params, ids, config, attention_mask=mask, key=key, logits_processor=[counting]
        )

    ones = run()
    compiled = len(traces)
    assert compiled > 0
    halves = run(penalty=(0.5, 0.5, 0.5))
    mixed = run(penalty=(0.5, 1.0, 0.5))
    again = run()
    other_key = run(seed=1)
    changed = run(seed=2, temperature=1.3, top_k=5, eos_token_id=[41, 58])
    assert len(traces) == compiled
    np.testing.assert_array_equal(ones.sequences, again.sequences)
    assert not np.array_equal(ones.sequences, other_key.sequences)
    for prompt, source in enumerate([halves, ones, halves]):
        rows = slice(2 * prompt, 2 * prompt + 2)
        np.testing.assert_array_equal(mixed.sequences[rows], source.sequences[rows])
        np.testing.assert_array_equal(mixed.sequences_scores[rows], source.sequences_scores[rows])
    for out, penalty in ((ones, 1.0), (halves, 0.5), (other_key, 1.0), (changed, 1.0)):
        steps = genjax.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
        length = _transformers_lengths(out.beam_indices)
        rebuilt = steps.sum(-1) / length**penalty
        np.testing.assert_allclose(rebuilt, out.sequences_scores, rtol=1e-5)
        # Returned hypotheses are sorted best first within each prompt.
        assert (np.diff(np.asarray(out.sequences_scores).reshape(3, 2), axis=1) <= 0).all()


# --- the loop alone, driven by a fake step function --------------------------------------------

# P(next | last token), as logits log(p). From the prompt's last token 0, greedy takes 1 (0.5) and
# then 3 (0.4): 0.20; beam search with 2 beams also keeps 2 (0.4) and finds 2 then 3: 0.36.
TABLE = np.array(
    [
        [0.001, 0.5, 0.4, 0.099],
        [0.001, 0.3, 0.299, 0.4],
        [0.001, 0.05, 0.049, 0.9],
        [0.25, 0.25, 0.25, 0.25],
    ]
)


def _table_step(params, tokens, positions, cache, attention_mask):
    return jnp.log(jnp.asarray(TABLE, jnp.float32))[tokens], cache.advance(tokens.shape[1])


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _table_search(num_beams, new_tokens, num_return_sequences):
    """Beam search over TABLE from the prompt [0, 0]; returns best_hypotheses and the cache
    index (which counts the model calls)."""
    prompt_length, total = 2, 2 + new_tokens
    tokens = jnp.zeros((1, total), jnp.int32)
    cache = genjax.cache.KVCache.create(1, 1, total, 1, 1).advance(prompt_length)
    state = beam.init_state(
        tokens,
        cache,
        jnp.ones((1, total), jnp.int32),
        jax.random.key(0),
        num_beams=num_beams,
        num_new_tokens=new_tokens,
    )
    context = P.LogitsContext(
        tokens=state.tokens,
        length=state.length,
        offset=jnp.zeros((), jnp.int32),
        prompt_end=state.length,
        first_valid=jnp.zeros((num_beams,), jnp.int32),
    )
    rules = beam.BeamRules(
        process=P.identity(),
        do_sample=False,
        early_stopping=False,
        context=context,
        length_penalty=1.0,
        eos_token_ids=None,
    )
    first, _ = _table_step(None, tokens[:, prompt_length - 1 : prompt_length], None, cache, None)
    first = jnp.repeat(first[:, -1], num_beams, axis=0)
    state = beam.beam_search(_table_step, None, state, first, rules)
    return beam.best_hypotheses(state, num_return_sequences), state.cache.index


def test_two_beams_find_the_better_path_with_the_documented_bookkeeping():
    (sequences, scores, indices), calls = _table_search(2, 2, 2)
    np.testing.assert_array_equal(sequences[:, 2:], [[2, 3], [1, 3]])
    np.testing.assert_allclose(scores, np.log([0.4 * 0.9, 0.5 * 0.4]) / 2, rtol=1e-6)
    # Step 0 extends row 0 (the only live copy of the prompt); at step 1 the running beams are
    # "1" (row 0, 0.5) and "2" (row 1, 0.4): "2 3" comes from row 1, "1 3" from row 0.
    np.testing.assert_array_equal(indices, [[0, 1], [0, 0]])
    # One model call per token after the first.
    assert int(calls) == 2 + 1


def test_one_beam_equals_greedy():
    (sequences, scores, indices), _ = _table_search(1, 5, 1)
    greedy = [1, 3, 0, 1, 3]  # argmax of each row of TABLE from token 0; ties take the lowest
    np.testing.assert_array_equal(sequences[0, 2:], greedy)
    log_table = np.log(TABLE.astype(np.float32))
    path = [0, *greedy]
    expected = sum(log_table[a, b] for a, b in zip(path[:-1], path[1:], strict=False)) / 5
    np.testing.assert_allclose(scores, [expected], rtol=1e-5)
    np.testing.assert_array_equal(indices, [[0] * 5])


@functools.partial(jax.jit, static_argnums=(0, 4))
def _one_beam(model, params, ids, mask, new):
    """Beam search with M = 1 and no EOS through ``model``'s step function."""
    batch, prompt_length = ids.shape
    cache_mask = jnp.concatenate([mask, jnp.ones((batch, new), jnp.int32)], 1)
    positions = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
    cache = model.init_cache(batch, prompt_length + new)
    logits, cache = model.apply(params, ids, positions, cache, cache_mask)
    tokens = jnp.concatenate([ids, jnp.zeros((batch, new), jnp.int32)], 1)
    state = beam.init_state(
        tokens, cache, cache_mask, jax.random.key(0), num_beams=1, num_new_tokens=new
    )
    rules = beam.BeamRules(
        process=P.identity(),
        do_sample=False,
        early_stopping=False,
        context=P.LogitsContext.for_prompt(ids, mask).replace(tokens=state.tokens),
        length_penalty=1.0,
        eos_token_ids=None,
    )
    state = beam.beam_search(model.apply, params, state, logits[:, -1], rules)
    return beam.best_hypotheses(state, 1)


def test_one_beam_equals_greedy_on_a_model():
    """Beam search whose beams cannot diverge (M = 1, no EOS) is transformers' greedy path."""
    model, params, _, _ = _load("llama")
    records = np.load(FIXTURES / "llama" / "records.npz")
    ids, mask = records["greedy/input_ids"], records["greedy/attention_mask"]
    new = 10  # the recorded greedy case: max_new_tokens=10, its EOS never produced
    sequences, scores, indices = _one_beam(model, params, ids, mask, new)
    np.testing.assert_array_equal(sequences, records["greedy/sequences"])
    np.testing.assert_array_equal(indices, np.repeat(np.arange(len(ids))[:, None], new, 1))
    log_probs = jax.nn.log_softmax(records["greedy/scores"], -1)
    chosen = np.take_along_axis(
        np.asarray(log_probs), records["greedy/sequences"][:, -new:, None], -1
    )
    np.testing.assert_allclose(scores, chosen.sum((1, 2)) / new, atol=1e-4)


# --- bad input ------------------------------------------------------------------------------


def test_more_return_sequences_than_beams_is_rejected_by_the_config():
    with pytest.raises(GenerationConfigError, match="num_return_sequences"):
        GenerationConfig(num_beams=2, num_return_sequences=3)


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
        (dict(assistant_early_exit=1), "assistant_early_exit"),
        (dict(low_memory=True), "low_memory"),
    ],
)
def test_unsupported_beam_options_raise_before_tracing(change, words):
    model, params, _, arrays = _load("llama")
    config = GenerationConfig(max_new_tokens=4, pad_token_id=0, num_beams=2, **change)
    with pytest.raises(UnsupportedError, match=words):
        genjax.generate(model, params, arrays["input_ids"], config)
