"""The decoding loop driven by a fake step function with known logits (no model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from genjax import processors as P
from genjax.cache import KVCache
from genjax.decoding.sampling import (
    DecodeRules,
    DecodeState,
    _inverse_cdf,
    decode,
    greedy_chooser,
    highest,
    sample,
    sampling_chooser,
)
from genjax.stopping import stop_string_table, stopping_rules
from genjax.testing import chi_square_p_value

pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py

VOCAB = 8
# The most likely token after t is TABLE[t]: 1 -> 2 -> 3 -> 4 -> 5 -> 1 ...; 6 and 7 -> 1.
TABLE = np.array([1, 2, 3, 4, 5, 1, 1, 1])


def _step(params, tokens, positions, cache, attention_mask):
    """Logits 10 at TABLE[last token], 1 elsewhere; counts calls in the cache index."""
    logits = jax.nn.one_hot(jnp.asarray(TABLE)[tokens], VOCAB) * 9.0 + 1.0
    return logits, cache.advance(tokens.shape[1])


def _run(prompt_last, new_tokens, eos=None, pad=0, process=None, choose=None, key=0, **stopping):
    batch = len(prompt_last)
    prompt = np.stack([np.zeros(batch), prompt_last], 1).astype(np.int32)  # P = 2
    total = 2 + new_tokens
    tokens = jnp.concatenate([prompt, jnp.full((batch, new_tokens), pad, jnp.int32)], 1)
    state = DecodeState(
        tokens=tokens,
        length=jnp.asarray(2, jnp.int32),
        positions=jnp.full((batch,), 2, jnp.int32),
        cache=KVCache.create(1, batch, total, 1, 1).advance(2),
        attention_mask=jnp.ones((batch, total), jnp.int32),
        finished=jnp.zeros((batch,), bool),
        key=jax.random.key(key),
        scores=jnp.zeros((batch, new_tokens, VOCAB)),
        raw_logits=None,
    )
    rules = DecodeRules(
        process=process or P.identity(),
        choose=choose or greedy_chooser(),
        context=P.LogitsContext.for_prompt(tokens[:, :2]),
        pad_token_id=jnp.asarray(pad, jnp.int32),
        stopping=stopping_rules(None if eos is None else jnp.asarray(eos, jnp.int32), **stopping),
    )
    first_logits, _ = _step(None, tokens[:, 1:2], None, state.cache, None)
    return decode(_step, None, state, first_logits[:, -1], rules)


def test_greedy_follows_the_table():
    state = _run([1, 4], new_tokens=4)
    np.testing.assert_array_equal(state.tokens[:, 2:], [[2, 3, 4, 5], [5, 1, 2, 3]])
    # One model call per token after the first (which comes from the prefill logits).
    assert int(state.cache.index) == 2 + 3
    assert int(state.length) == 6


def test_highest_is_argmax_on_ties_infinities_nans_and_signed_zeros():
    rng = np.random.default_rng(0)
    ties = rng.integers(0, 3, (50, 20)).astype(np.float32)  # many equal maxima per row
    odd = np.full((7, 9), -np.inf, np.float32)  # row 0: every score -inf
    odd[1, 3] = np.nan
    odd[2, [2, 5]] = np.inf
    odd[3, [4, 7]] = np.nan
    odd[3, 0] = np.inf
    odd[4, :] = np.nan
    odd[5, :3] = [-0.0, 0.0, -0.0]
    odd[6, [1, 8]] = [np.nan, np.inf]
    for scores in (
        ties,
        odd,
        rng.standard_normal((2, 3, 11)).astype(jnp.bfloat16),
        rng.standard_normal((4, 49152)).astype(np.float32),
    ):
        got = jax.jit(highest)(jnp.asarray(scores))
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, jnp.argmax(jnp.asarray(scores), axis=-1))
    assert np.asarray(jax.jit(highest)(jnp.asarray(odd))).tolist() == [0, 3, 2, 4, 0, 0, 1]


def test_finished_rows_get_pad_and_loop_stops_when_all_finish():
    state = _run([1, 3], new_tokens=6, eos=[4], pad=0)
    # Row 0: 2 3 4(eos) then pad; row 1: 4(eos) then pad. All finish at step 3 of 6.
    np.testing.assert_array_equal(state.tokens[:, 2:], [[2, 3, 4, 0, 0, 0], [4, 0, 0, 0, 0, 0]])
    assert int(state.length) == 2 + 3
    assert state.finished.tolist() == [True, True]
    # Scores of steps that never ran stay 0.
    np.testing.assert_array_equal(state.scores[:, 3:], 0.0)


def test_processors_see_the_buffer():
    # A huge repetition penalty turns every seen token's logit (10 or 1) into ~0, so after
    # 2 3 4 5 the table's 1 (in the prompt) loses to the unseen 6, then 7.
    state = _run([1], new_tokens=6, process=P.repetition_penalty(1e6))
    np.testing.assert_array_equal(state.tokens[0, 2:], [2, 3, 4, 5, 6, 7])


def test_top_k_one_sampling_equals_greedy_and_key_is_reproducible():
    greedy = _run([1, 3, 5], new_tokens=5)
    sampled = _run([1, 3, 5], new_tokens=5, process=P.top_k(1), choose=sampling_chooser(), key=3)
    np.testing.assert_array_equal(sampled.tokens, greedy.tokens)
    a = _run([1, 3], new_tokens=5, choose=sampling_chooser(), process=P.temperature(50.0), key=7)
    b = _run([1, 3], new_tokens=5, choose=sampling_chooser(), process=P.temperature(50.0), key=7)
    c = _run([1, 3], new_tokens=5, choose=sampling_chooser(), process=P.temperature(50.0), key=8)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)


def _last_is(token):
    """A custom criterion: the row is done once its newest token is ``token``."""
    return lambda tokens, length: tokens[:, length - 1] == token


def test_custom_criteria_finish_rows_at_different_steps():
    # Rows 1 -> 2 3 4, 3 -> 4, 5 -> 1 2 3 4: the criterion "newest is 4" ends them at steps
    # 3, 1 and 4; with an EOS id set, finished rows receive pad.
    state = _run([1, 3, 5], new_tokens=6, eos=[7], pad=0, criteria=[_last_is(4)])
    np.testing.assert_array_equal(
        state.tokens[:, 2:], [[2, 3, 4, 0, 0, 0], [4, 0, 0, 0, 0, 0], [1, 2, 3, 4, 0, 0]]
    )
    assert int(state.length) == 2 + 4
    # Any criterion finishes a row: adding "newest is 2" ends rows 0 and 2 at steps 1 and 2.
    state = _run([1, 3, 5], new_tokens=6, eos=[7], criteria=[_last_is(4), _last_is(2)])
    np.testing.assert_array_equal(state.tokens[:, 2:5], [[2, 0, 0], [4, 0, 0], [1, 2, 0]])
    assert int(state.length) == 2 + 2


def test_without_eos_finished_rows_keep_their_tokens_as_in_transformers():
    # transformers writes pad into finished rows only when an EOS id is set.
    state = _run([1, 3], new_tokens=5, pad=0, criteria=[_last_is(4)])
    np.testing.assert_array_equal(state.tokens[:, 2:], [[2, 3, 4, 0, 0], [4, 5, 1, 0, 0]])
    assert state.finished.tolist() == [True, True]


def test_a_criterion_sees_the_whole_buffer():
    def pair_2_3(tokens, length):  # the two newest tokens are 2, 3
        last_two = jax.lax.dynamic_slice_in_dim(tokens, length - 2, 2, axis=1)
        return jnp.all(last_two == jnp.array([2, 3]), axis=1)

    state = _run([1, 2], new_tokens=6, eos=[7], criteria=[pair_2_3])
    # Row 0: 2 3 -> done at step 2. Row 1: prompt ends in 2, first token 3 -> done at step 1.
    np.testing.assert_array_equal(state.tokens[:, 2:4], [[2, 3], [3, 0]])
    assert int(state.length) == 2 + 2


class _Words:
    """A tokenizer with only get_vocab(): token i's text is WORDS[i]."""

    WORDS = ["a", "st", "o", "p", "s", "x", "y", "z"]

    def get_vocab(self):
        return {word: i for i, word in enumerate(self.WORDS)}


def test_stop_strings_end_rows_at_different_steps():
    # Texts: row 0 "st"+"o"+"p" (the stop string spans the prompt); row 1 "p"+"s"+"x"+"st"+"o"+
    # "p"; row 2 "x"+"st"+"o"+"p".
    table = stop_string_table(_Words(), ["stop", "zz"])
    state = _run([1, 3, 5], new_tokens=6, eos=[7], stop_strings=table)
    np.testing.assert_array_equal(
        state.tokens[:, 2:], [[2, 3, 0, 0, 0, 0], [4, 5, 1, 2, 3, 0], [1, 2, 3, 0, 0, 0]]
    )
    assert int(state.length) == 2 + 5


class _FakeClock:
    """Reads 0, 1, 2, ... seconds: one more second at each read."""

    def __init__(self):
        self.reads = 0

    def __call__(self):
        self.reads += 1
        return float(self.reads - 1)


def test_max_time_with_a_fake_clock_stops_after_the_token_that_overran():
    # Start read 0 s; the read after new token n says n s. max_time 2.5 s: stop after token 3.
    clock = _FakeClock()
    state = _run([1, 3], new_tokens=8, eos=[7], max_time=2.5, clock=clock)
    np.testing.assert_array_equal(state.tokens[:, 2:6], [[2, 3, 4, 0], [4, 5, 1, 0]])
    assert int(state.length) == 2 + 3 and clock.reads == 1 + 3
    # Reading every 2nd token (after tokens 1, 3, 5): the third read (2 s) is in time, the
    # fourth (3 s, after token 5) is not.
    clock = _FakeClock()
    state = _run([1], new_tokens=8, eos=[7], max_time=2.5, clock=clock, check_time_every=2)
    assert int(state.length) == 2 + 5 and clock.reads == 1 + 3
    state = _run([1], new_tokens=8, eos=[7], max_time=1e6)
    assert int(state.length) == 2 + 8


_sample = jax.jit(sample)


def _draws(scores, rows=8192, seed=0):
    """Counts float[V] of ``rows`` draws of ``sample`` from one row of scores float32[V]."""
    tokens = _sample(jax.random.key(seed), jnp.tile(jnp.asarray(scores)[None], (rows, 1)))
    return np.bincount(np.asarray(tokens), minlength=len(scores))


def test_sample_follows_softmax_over_the_prefix_and_over_the_whole_vocabulary():
    """``sample`` draws over the 256 largest scores when every row keeps at most 256 tokens, and
    over the whole vocabulary otherwise; both follow softmax(scores) (chi-square), and the
    prefix path never draws a removed token."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(1024).astype(np.float32)
    truncated = np.where(logits >= np.sort(logits)[-40], logits, -np.inf)  # 40 tokens kept
    for scores in (truncated, logits):
        probs = np.asarray(jax.nn.softmax(jnp.asarray(scores)))
        counts = _draws(scores)
        assert counts[~np.isfinite(scores)].sum() == 0
        assert chi_square_p_value(counts, probs * counts.sum()) > 1e-3
    # The test can fail: the draws are far from a flat distribution over the kept tokens.
    kept = np.isfinite(truncated)
    flat = kept / kept.sum() * counts.sum()
    assert chi_square_p_value(_draws(truncated), flat) < 1e-6
    # A batch whose rows keep different numbers of tokens draws every row correctly.
    mixed = jnp.stack([jnp.asarray(truncated), jnp.asarray(logits)])
    assert np.isfinite(truncated[int(_sample(jax.random.key(1), mixed)[0])])


def test_inverse_cdf_draws_only_tokens_of_positive_probability():
    """The whole-vocabulary path maps a uniform number to the token whose cumulative probability
    first exceeds it; removed tokens are never drawn, even at the ends of the unit interval."""
    half = np.array([-np.inf, 0.0, -np.inf, 0.0, -np.inf], np.float32)  # tokens 1 and 3, 1/2 each
    uniforms = np.array([1e-30, 0.49, 0.51, 1 - 2**-24, 1.0], np.float32)
    tokens = _inverse_cdf(jnp.tile(half, (5, 1)), jnp.asarray(uniforms))
    np.testing.assert_array_equal(tokens, [1, 1, 3, 3, 3])
    skewed = np.log(np.array([0.1, 0.2, 0.7], np.float32))  # cumulative 0.1, 0.3, 1.0
    tokens = _inverse_cdf(jnp.tile(skewed, (4, 1)), jnp.asarray([0.05, 0.15, 0.29, 0.31]))
    np.testing.assert_array_equal(tokens, [0, 1, 1, 2])
    nothing = jnp.full((1, 5), -jnp.inf)
    assert int(_inverse_cdf(nothing, jnp.asarray([0.5]))[0]) == 0
