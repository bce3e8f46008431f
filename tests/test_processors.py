"""Logits processors against transformers (recorded and live) and NumPy statements of its rules.

The recorded cases (``tests/fixtures/processors/processors.*``, written by
``tests/fixtures/make_processor_fixtures.py``) hold transformers' outputs for every processor
alone, for common combinations, and for whole configs (``_get_logits_processor``, so the order of
the chain too). genjax computes all of them in one compiled program, with ``OFFSET`` slots of
genjax bucket padding before the recorded input ids, which must change nothing.
"""

import functools
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genjax import GenerationConfig
from genjax import processors as P
from genjax.errors import GenerationConfigError

pytestmark = pytest.mark.usefixtures("fast_compiles")

VOCAB = 12
FIXTURES = Path(__file__).parent / "fixtures"
OFFSET = 4


def _context(tokens, length=None, offset=0, prompt_end=None, first_valid=None):
    tokens = jnp.asarray(tokens, jnp.int32)
    batch, size = tokens.shape
    length = size if length is None else length
    return P.LogitsContext(
        tokens=tokens,
        length=jnp.asarray(length, jnp.int32),
        offset=jnp.asarray(offset, jnp.int32),
        prompt_end=jnp.asarray(size if prompt_end is None else prompt_end, jnp.int32),
        first_valid=jnp.asarray(np.zeros(batch) if first_valid is None else first_valid, jnp.int32),
    )


def _logits(seed, batch=3, vocab=VOCAB):
    return np.random.default_rng(seed).normal(size=(batch, vocab)).astype(np.float32) * 3


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _ref_top_k(x, k):
    out = x.copy()
    for row in out:
        kth = np.sort(row)[::-1][min(k, len(row)) - 1]
        row[row < kth] = -np.inf
    return out


def _ref_top_p(x, p):
    out = x.copy()
    for row in out:
        order = np.argsort(row)  # ascending
        cum = np.cumsum(_softmax(row[order]))
        remove = cum <= 1 - p
        remove[-1] = False
        row[order[remove]] = -np.inf
    return out


CTX = _context(np.zeros((3, 4)))


def test_temperature_divides_and_accepts_per_row_values():
    x = _logits(0)
    np.testing.assert_allclose(P.temperature(0.5)(x, CTX), x / 0.5, rtol=1e-6)
    per_row = jnp.array([0.5, 1.0, 2.0])
    np.testing.assert_allclose(P.temperature(per_row)(x, CTX), x / per_row[:, None], rtol=1e-6)


_top_k = jax.jit(lambda x, k: P.top_k(k)(x))
_top_p = jax.jit(lambda x, p: P.top_p(p)(x))


@pytest.mark.parametrize("k", [1, 3, 11, 12, 50])
def test_top_k_matches_reference(k):
    x = _logits(k)
    np.testing.assert_array_equal(_top_k(x, k), _ref_top_k(x, k))


def test_top_k_zero_keeps_everything_and_per_row_k():
    x = _logits(1)
    np.testing.assert_array_equal(_top_k(x, 0), x)
    got = _top_k(x, jnp.array([1, 2, 0]))
    np.testing.assert_array_equal(got[0], _ref_top_k(x[:1], 1)[0])
    np.testing.assert_array_equal(got[1], _ref_top_k(x[1:2], 2)[0])
    np.testing.assert_array_equal(got[2], x[2])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_matches_reference(p):
    x = _logits(int(p * 100))
    np.testing.assert_array_equal(_top_p(x, p), _ref_top_p(x, p))


def test_min_p_matches_reference():
    x = _logits(7)
    probs = _softmax(x)
    expected = np.where(probs < 0.2 * probs.max(-1, keepdims=True), -np.inf, x)
    np.testing.assert_array_equal(P.min_p(0.2)(x, CTX), expected)


def test_repetition_penalty_ignores_left_padding_and_future_slots():
    x = _logits(3, batch=2)
    tokens = [[5, 5, 1, 2, 9], [3, 4, 1, 7, 7]]
    # Row 0 has two padding slots (token 5), row 1 none; slot 4 is not filled yet.
    ctx = _context(tokens, length=4, first_valid=[2, 0])
    got = np.asarray(P.repetition_penalty(2.0)(x, ctx))
    expected = x.copy()
    for row, seen in enumerate([{1, 2}, {3, 4, 1, 7}]):
        for tok in seen:
            v = expected[row, tok]
            expected[row, tok] = v * 2.0 if v < 0 else v / 2.0
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_count_penalties_subtract_openais_terms_over_generated_tokens_only():
    # Slots 0-2 the prompt, 3-5 generated, 6-7 not yet written: only 3-5 count.
    tokens = np.asarray([[4, 4, 4, 4, 7, 4, 9, 9], [1, 2, 3, 5, 5, 5, 6, 6]])
    ctx = _context(tokens, length=6, prompt_end=3)
    scores = _logits(3, batch=2)
    counts = np.zeros((2, VOCAB))
    counts[0, 4], counts[0, 7], counts[1, 5] = 2, 1, 3
    traces = []

    @jax.jit
    def process(x, p, f):
        traces.append(1)
        both = P.count_penalties(p, f)(x, ctx)
        return both, P.chain(P.presence_penalty(p), P.frequency_penalty(f))(x, ctx)

    for presence, frequency in [([0.5, -1.0], [0.25, 2.0]), ([2.0, 0.0], [-2.0, 0.1])]:
        presence, frequency = np.asarray(presence), np.asarray(frequency)
        both, chained = process(scores, presence, frequency)
        want = scores - presence[:, None] * (counts > 0) - frequency[:, None] * counts
        np.testing.assert_allclose(both, want, rtol=1e-6)
        np.testing.assert_allclose(chained, want, rtol=1e-6)
    assert len(traces) == 1  # new strengths compile nothing


def test_logit_bias_equals_sequence_bias_of_single_tokens_and_takes_per_row_ids():
    scores = jnp.asarray(_logits(4, batch=2))
    ctx = _context([[1, 2], [3, 4]])

    @jax.jit
    def process(x):
        single = P.sequence_bias([[[5], -100.0], [[2], 3.5]])(x, ctx)
        flat = P.logit_bias([5, 2, -1], [-100.0, 3.5, 9.0])(x)
        rows = P.logit_bias([[5, 2], [0, -1]], [[-100.0, 3.5], [1.0, 7.0]])(x)
        return single, flat, rows

    single, flat, rows = process(scores)
    np.testing.assert_array_equal(flat, single)
    np.testing.assert_array_equal(rows[0], single[0])
    np.testing.assert_array_equal(rows[1], np.asarray(scores[1]) + np.eye(VOCAB)[0])


def test_min_length_and_min_new_tokens_block_eos_until_reached():
    x = _logits(4, batch=1)
    eos = jnp.array([2, 5])
    # transformers' input_ids length = length - offset = 6 - 1 = 5; new tokens = 6 - 4 = 2.
    ctx = _context(np.zeros((1, 8)), length=6, offset=1, prompt_end=4)
    blocked = np.asarray(P.min_length(6, eos)(x, ctx))
    assert np.isneginf(blocked[0, [2, 5]]).all()
    np.testing.assert_array_equal(np.delete(blocked, [2, 5], 1), np.delete(x, [2, 5], 1))
    np.testing.assert_array_equal(P.min_length(5, eos)(x, ctx), x)
    assert np.isneginf(np.asarray(P.min_new_tokens(3, eos)(x, ctx))[0, [2, 5]]).all()
    np.testing.assert_array_equal(P.min_new_tokens(2, eos)(x, ctx), x)


# --- transformers' outputs, recorded and live ------------------------------------------------


def _compile_fast(jitted, *example_args):
    """``jitted`` compiled for arguments like ``example_args`` without LLVM's optimizations,
    which halves the compile time of these test programs (the results are the same)."""
    return jitted.lower(*example_args).compile({"xla_backend_optimization_level": 0})


@functools.cache
def _recorded():
    spec = json.loads((FIXTURES / "processors" / "processors.json").read_text())
    return spec, dict(np.load(FIXTURES / "processors" / "processors.npz"))


@functools.cache
def _allowed_rule(rule, vocab):
    """The jittable twin of the fixture script's ``allowed_by_rule``."""
    assert rule == "mod3", rule

    def allowed(tokens, length):
        last = jax.lax.dynamic_index_in_dim(tokens, length - 1, axis=1)  # int32[B, 1]
        return (jnp.arange(vocab)[None, :] + last) % 3 != 0

    return allowed


def _make(op, kwargs, vocab):
    """The genjax processor for one recorded op spec (genjax's factory and argument names)."""
    kwargs = dict(kwargs)
    if op == "sequence_bias" and kwargs.pop("as_dict", False):
        kwargs["bias"] = {tuple(ids): value for ids, value in kwargs["bias"]}
    if op == "allowed_tokens":
        return P.allowed_tokens(_allowed_rule(kwargs["rule"], vocab), kwargs["group_size"])
    return getattr(P, op)(**kwargs)


def _bucket_context(ids, mask, prompt_length, max_length=None):
    """The context of a recorded input behind OFFSET slots of genjax padding. The padding
    repeats each row's own tokens, so a processor that looked at it would see extra n-grams."""
    batch, size = ids.shape
    padding = jnp.tile(ids[:, -1:], (1, OFFSET))
    return P.LogitsContext(
        tokens=jnp.concatenate([padding, ids], axis=1).astype(jnp.int32),
        length=jnp.asarray(OFFSET + size, jnp.int32),
        offset=jnp.asarray(OFFSET, jnp.int32),
        prompt_end=jnp.asarray(OFFSET + prompt_length, jnp.int32),
        first_valid=(OFFSET + jnp.argmax(mask != 0, axis=1)).astype(jnp.int32),
        max_length=None if max_length is None else jnp.asarray(max_length, jnp.int32),
    )


def _genjax_outputs(spec, arrays):
    """genjax's output for every recorded case, computed in one jitted program."""
    vocab = spec["meta"]["vocab"]
    eos = jnp.asarray(spec["config_cases"][0]["config"]["eos_token_id"], jnp.int32)

    def context(case, ids, mask, max_length=None):
        return _bucket_context(ids, mask, case["prompt_length"], max_length)

    @jax.jit
    def run(inputs):
        mask = inputs["attention_mask"]
        out = {}
        for case in spec["cases"]:
            process = P.chain(*[_make(op, kw, vocab) for op, kw in case["ops"]])
            ctx = context(case, inputs[case["ids"]], mask)
            out[case["name"]] = process(inputs[case["scores"]], ctx)
        for case in spec["config_cases"]:
            config = GenerationConfig(**case["config"]).with_defaults()
            rule = case["allowed_rule"]
            process = P.from_config(
                config,
                eos,
                allowed_tokens_fn=None if rule is None else _allowed_rule(rule, vocab),
                vocab_size=vocab,
            )
            ctx = context(case, inputs["input_ids"], mask, config.max_length)
            out[case["name"]] = process(inputs[case.get("scores", "scores")], ctx)
        return out

    inputs = {k.split("/")[1]: v for k, v in arrays.items() if k.startswith("inputs/")}
    return jax.tree.map(np.asarray, _compile_fast(run, inputs)(inputs))


@functools.cache
def _recorded_outputs():
    return _genjax_outputs(*_recorded())


def _assert_same_scores(got, expected, name):
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected), err_msg=name)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected), err_msg=name)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(got[~finite], expected[~finite], err_msg=name)
    np.testing.assert_allclose(got[finite], expected[finite], atol=1e-5, rtol=0, err_msg=name)


def _recorded_names():
    spec = json.loads((FIXTURES / "processors" / "processors.json").read_text())
    return [case["name"] for case in spec["cases"] + spec["config_cases"]]


@pytest.mark.parametrize("name", _recorded_names())
def test_matches_recorded_transformers(name):
    _, arrays = _recorded()
    _assert_same_scores(_recorded_outputs()[name], arrays[f"{name}/output"], name)


@pytest.mark.parity
def test_matches_live_transformers():
    spec = importlib.util.spec_from_file_location(
        "make_processor_fixtures", FIXTURES / "make_processor_fixtures.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    built = script.build_processor_records()
    meta = {k: v for k, v in built.items() if k != "arrays"}
    outputs = _genjax_outputs(json.loads(json.dumps(meta)), built["arrays"])
    for name, got in outputs.items():
        _assert_same_scores(got, built["arrays"][f"{name}/output"], name)


# --- rules transformers' fixtures do not reach -----------------------------------------------


def test_allowed_tokens_keeps_the_constraint_when_a_group_has_no_finite_allowed_score():
    x = _logits(22, batch=4, vocab=6)
    x[0:2, :3] = -np.inf  # rows 0 and 1 (one group) allow only tokens 0..2, all -inf there
    x[2, :2] = -np.inf  # row 2 still has token 2 finite
    allowed = jnp.asarray(np.tile([True, True, True, False, False, False], (4, 1)))
    got = np.asarray(P.allowed_tokens(lambda tokens, length: allowed, group_size=2)(x, CTX))
    np.testing.assert_array_equal(got[:2], np.tile([0, 0, 0, -np.inf, -np.inf, -np.inf], (2, 1)))
    np.testing.assert_array_equal(got[2:, :3], x[2:, :3])
    assert np.isneginf(got[2:, 3:]).all()


def test_forced_eos_reads_max_length_from_the_context():
    x = _logits(23, batch=1)
    eos = [2, 5]
    forced = np.where(np.isin(np.arange(VOCAB), eos), 0.0, -np.inf)[None]
    # Buffer of 8 slots after 2 slots of padding: transformers' max_length is 6 by default.
    at_end = _context(np.zeros((1, 8)), length=7, offset=2)
    np.testing.assert_array_equal(P.forced_eos_token_id(eos)(x, at_end), forced)
    earlier = _context(np.zeros((1, 8)), length=6, offset=2)
    np.testing.assert_array_equal(P.forced_eos_token_id(eos)(x, earlier), x)
    explicit = earlier.replace(max_length=jnp.asarray(5, jnp.int32))
    np.testing.assert_array_equal(P.forced_eos_token_id(eos)(x, explicit), forced)


def test_begin_suppress_waits_one_token_after_a_forced_bos_on_a_one_token_prompt():
    x = _logits(24, batch=1)
    process = P.begin_suppress_tokens([4], forced_bos=True)
    one_token = _context(np.zeros((1, 3)), length=1, prompt_end=1)
    np.testing.assert_array_equal(process(x, one_token), x)
    after_bos = _context(np.zeros((1, 3)), length=2, prompt_end=1)
    assert np.isneginf(np.asarray(process(x, after_bos))[0, 4])
    longer = _context(np.zeros((1, 3)), length=2, prompt_end=2)
    assert np.isneginf(np.asarray(process(x, longer))[0, 4])


def test_traced_values_do_not_recompile():
    traces = []
    ctx = _context([[1, 2, 3, 1, 2, 3]], first_valid=[0])

    @jax.jit
    def process(x, v):
        traces.append(1)
        return P.chain(
            P.sequence_bias([[[1, 2], v["bias"]], [[4], v["bias"]]]),
            P.repetition_penalty(v["penalty"]),
            P.min_length(v["min_length"], v["eos"]),
            P.min_new_tokens(v["min_new"], v["eos"]),
            P.forced_bos_token_id(v["bos"]),
            P.forced_eos_token_id(v["eos"]),
            P.exponential_decay_length_penalty(v["start"], v["factor"], v["eos"]),
            P.suppress_tokens(v["suppressed"]),
            P.begin_suppress_tokens(v["suppressed"], v["begin"]),
            P.temperature(v["t"]),
            P.top_h(v["h"]),
            P.top_k(v["k"]),
            P.top_p(v["p"]),
            P.min_p(v["m"]),
            P.typical_p(v["mass"]),
            P.epsilon_cutoff(v["eps"]),
            P.eta_cutoff(v["eta"]),
        )(x, ctx)

    def values(i):
        return dict(
            bias=1.0 + i, bos=3 + i, eos=jnp.array([2, 5 + i]), start=1 + i, factor=1.5 + i,
            suppressed=jnp.array([7, 8 + i]), begin=6 + i, h=0.9 - i / 10, k=5 + i,
            p=0.9 - i / 10, mass=0.95 - i / 10, eps=1e-3 * (i + 1), eta=1e-3 * (i + 1),
            penalty=1.2 + i, min_length=3 + i, min_new=1 + i, m=0.05 * (i + 1), t=0.7 + i,
        )  # fmt: skip

    x = _logits(25, batch=1)
    process(x, values(0))
    process(x, values(1))
    assert len(traces) == 1


@pytest.mark.parametrize(
    "factory, words",
    [
        (lambda: P.bad_words_ids([5, 6]), "wrap it as [5]"),
        (lambda: P.bad_words_ids([[5], []]), "bad_words_ids[1]=[] is invalid"),
        (lambda: P.bad_words_ids([]), "non-empty list"),
        (lambda: P.bad_words_ids([[5, -1]]), "ints >= 0"),
        (lambda: P.sequence_bias([]), "non-empty list"),
        (lambda: P.sequence_bias([[5, 1.0]]), "wrap the single id as [5]"),
        (lambda: P.sequence_bias({(5,): "big"}), "the bias must be a number"),
        (lambda: P.sequence_bias([[[5], 1.0, 2.0]]), "pair [token_ids, bias]"),
        (lambda: P.suppress_tokens([1.5]), "suppress_tokens=[1.5]"),
        (lambda: P.no_repeat_ngram_size(0), "int >= 1"),
        (lambda: P.encoder_no_repeat_ngram_size(1.5), "encoder_no_repeat_ngram_size=1.5"),
        (lambda: P.bad_words_ids([[5], [400]])(_logits(0), CTX), "[400] outside the vocabulary"),
        (lambda: P.sequence_bias({(1, 20): 1.0})(_logits(0), CTX), "vocab_size=12"),
    ],
)
def test_bad_processor_settings_raise_clear_errors(factory, words):
    with pytest.raises(ValueError) as info:
        factory()
    assert words in str(info.value)


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(bad_words_ids=[[3], [12]]), GenerationConfigError, "GenerationConfig.bad_words_ids"),
        (dict(forced_eos_token_id=[2, 40]), GenerationConfigError, "[40] outside"),
    ],
)
def test_from_config_validates_before_tracing(change, error, words):
    config = GenerationConfig(eos_token_id=2, **change).with_defaults()
    with pytest.raises(error) as info:
        P.from_config(config, jnp.array([2]), vocab_size=VOCAB)
    assert words in str(info.value)


def test_token_healing_is_not_a_processor():
    """generate heals the prompt on the host (tests/test_token_healing.py); the chain ignores it."""
    x = _logits(27, batch=1)
    ctx = _context([[1, 2, 3]], prompt_end=3)
    plain = GenerationConfig(eos_token_id=2, repetition_penalty=1.5).with_defaults()
    chains = [
        P.from_config(config, jnp.array([2]), vocab_size=VOCAB)
        for config in (plain, plain.replace(token_healing=True))
    ]
    np.testing.assert_array_equal(chains[1](x, ctx), chains[0](x, ctx))


def test_encoder_options_read_only_the_users_prompt():
    # Slots: 2 of genjax padding (token 3), the prompt [1, 2, 1] (slots 2..4), new tokens [4, 1].
    x = np.abs(_logits(26, batch=1)) + 1.0  # positive scores: a reward multiplies them
    ctx = _context([[3, 3, 1, 2, 1, 4, 1]], offset=2, prompt_end=5, first_valid=[2])
    rewarded = np.asarray(P.encoder_repetition_penalty(2.0)(x, ctx))
    expected = x.copy()
    expected[0, [1, 2]] *= 2.0  # prompt tokens only: not 3 (genjax padding), not 4 (new)
    np.testing.assert_allclose(rewarded, expected, rtol=1e-6)
    negative = -x
    expected = negative.copy()
    expected[0, [1, 2]] /= 2.0
    np.testing.assert_allclose(P.encoder_repetition_penalty(2.0)(negative, ctx), expected)
    # The newest token is 1; the prompt's bigrams starting with 1 continue with 2 only ([1, 2]).
    banned = np.isneginf(np.asarray(P.encoder_no_repeat_ngram_size(2)(x, ctx)))
    np.testing.assert_array_equal(np.flatnonzero(banned[0]), [2])
    # Size 1 bans every prompt token; the padding's 3 and the new 4 stay.
    banned = np.isneginf(np.asarray(P.encoder_no_repeat_ngram_size(1)(x, ctx)))
    np.testing.assert_array_equal(np.flatnonzero(banned[0]), [1, 2])


def test_processors_are_pytrees_whose_values_are_traced():
    traces = []

    @jax.jit
    def run(process, x):
        traces.append(1)
        return process(x, CTX)

    def build(t, k, p, penalty, bias):
        return P.chain(
            P.sequence_bias([[[1, 2], bias], [[4], bias]]),
            P.repetition_penalty(penalty),
            P.encoder_repetition_penalty(penalty),
            P.no_repeat_ngram_size(2),
            lambda scores, context: scores,
            P.temperature(t),
            P.top_k(k),
            P.top_p(p),
        )

    x = _logits(27)
    first = build(0.5, 3, 0.9, 1.2, 1.0)
    second = build(1, 5, 0.8, 2.0, -1.0)  # Python ints and floats alike
    assert jax.tree.structure(first) != jax.tree.structure(build(0.5, 3, 0.9, 1.2, 1.0))
    same = first.processors[:4] + first.processors[5:]
    assert jax.tree.structure(P.chain(*same)) == jax.tree.structure(
        P.chain(*(second.processors[:4] + second.processors[5:]))
    )
    fn = first.processors[4].settings[0][1]
    second = P.chain(*second.processors[:4], fn, *second.processors[5:])
    np.testing.assert_allclose(run(first, x), first(x, CTX), rtol=1e-6)
    np.testing.assert_allclose(run(second, x), second(x, CTX), rtol=1e-6)
    assert len(traces) == 1
    # top_k and top_p were merged into one sorted filter with two stages; a new kind of
    # processor, or a new static setting, is a new structure.
    assert isinstance(first.processors[-1], P.SortedFilter)
    assert len(first.processors[-1].stages) == 2
    assert jax.tree.structure(P.top_k(3)) != jax.tree.structure(P.top_k(3, min_tokens_to_keep=2))
    assert jax.tree.structure(P.top_k(3)) != jax.tree.structure(P.top_p(0.3))


def test_transformers_processors_are_rejected_with_a_clear_error():
    class LogitsProcessor:  # the name of transformers' base class
        def __call__(self, input_ids, scores):
            return scores

    class RepetitionPenaltyLogitsProcessor(LogitsProcessor):
        pass

    for bad in ([RepetitionPenaltyLogitsProcessor()], RepetitionPenaltyLogitsProcessor()):
        with pytest.raises(TypeError, match="RepetitionPenaltyLogitsProcessor is a transformers"):
            P.as_processors(bad)
    with pytest.raises(TypeError, match="context.tokens"):
        P.chain(P.temperature(0.5), RepetitionPenaltyLogitsProcessor())
    with pytest.raises(TypeError, match="got int 3"):
        P.as_processors([3])


# --- properties --------------------------------------------------------------------------------

_WIDE = 300  # above the 256-score prefix of the sorted filters: both of their paths run


@functools.cache
def _property_programs():
    """Jitted programs shared by every hypothesis example (values are arguments)."""

    @jax.jit
    def neutral(x):
        unchanged = [P.top_p(1.0)(x), P.top_k(0)(x), P.top_k(x.shape[-1])(x)]
        unchanged.append(P.typical_p(1.0)(x, CTX))
        return unchanged, P.top_k(1)(x)

    @jax.jit
    def chained_and_by_hand(x, v):
        steps = [P.temperature(v["t"]), P.top_k(v["k"]), P.top_p(v["p"])]
        by_hand = x
        for step in steps:
            by_hand = step(by_hand, CTX)
        return P.chain(*steps)(x, CTX), by_hand

    @jax.jit
    def with_invalid_values_removed(x, t):
        config = GenerationConfig(
            do_sample=True,
            remove_invalid_values=True,
            renormalize_logits=True,
            repetition_penalty=1.3,
            temperature=t,
            top_k=20,
            top_p=0.9,
            typical_p=0.9,
            eta_cutoff=1e-3,
        ).with_defaults()
        ctx = _context(np.ones((x.shape[0], 4)))
        return P.from_config(config, jnp.array([1]))(x, ctx)

    narrow, wide = _logits(0), _logits(0, vocab=_WIDE)
    return (
        _compile_fast(neutral, wide),
        _compile_fast(chained_and_by_hand, wide, dict(t=1.0, k=1, p=0.5)),
        _compile_fast(with_invalid_values_removed, narrow, 1.0),
    )


_seeds = st.integers(0, 2**31 - 1)


@settings(max_examples=20, deadline=None)
@given(_seeds, st.sampled_from([0.3, 1.0, 10.0]))
def test_neutral_settings_change_nothing_and_top_k_1_keeps_the_argmax(seed, scale):
    neutral, _, _ = _property_programs()
    x = _logits(seed, vocab=_WIDE) * scale
    unchanged, top_k_1 = neutral(x)
    for out in unchanged:
        np.testing.assert_array_equal(out, x)
    top_k_1 = np.asarray(top_k_1)
    np.testing.assert_array_equal(np.argmax(top_k_1, -1), np.argmax(x, -1))
    assert (np.isfinite(top_k_1).sum(-1) == 1).all()


@settings(max_examples=20, deadline=None)
@given(
    _seeds,
    st.fixed_dictionaries(
        dict(
            t=st.floats(0.3, 3.0),
            k=st.integers(0, _WIDE + 5),
            p=st.floats(0.05, 1.0),
        )
    ),
)
def test_a_chain_equals_its_processors_applied_by_hand(seed, values):
    # Chained, top_k and top_p share one partial sort; by hand, each sorts on its own. k above
    # 256 or a wide nucleus takes the full-sort path.
    _, chained_and_by_hand, _ = _property_programs()
    chained, by_hand = chained_and_by_hand(_logits(seed, vocab=_WIDE), values)
    np.testing.assert_array_equal(chained, by_hand)


@settings(max_examples=20, deadline=None)
@given(
    _seeds,
    st.lists(
        st.tuples(
            st.integers(0, 2), st.integers(0, VOCAB - 1), st.sampled_from([np.nan, np.inf, -np.inf])
        ),
        max_size=8,
    ),
    st.floats(1.0, 2.0),
)
def test_no_nan_once_invalid_values_are_removed(seed, invalid, t):
    # (With temperature < 1, finfo.max / t overflows to inf and renormalizing gives NaN, in
    # transformers too.)
    _, _, with_invalid_values_removed = _property_programs()
    x = _logits(seed)
    for row, column, value in invalid:
        x[row, column] = value
    assert not np.isnan(np.asarray(with_invalid_values_removed(x, t))).any()
