"""The decoding loop driven by a fake step function with known logits (no model)."""

import jax
import jax.numpy as jnp
import numpy as np

from genjax import processors as P
from genjax.cache import KVCache
from genjax.decoding.sampling import (
    DecodeRules,
    DecodeState,
    decode,
    greedy_chooser,
    sampling_chooser,
)

VOCAB = 8
# The most likely token after t is TABLE[t]: 1 -> 2 -> 3 -> 4 -> 5 -> 1 ...; 6 and 7 -> 1.
TABLE = np.array([1, 2, 3, 4, 5, 1, 1, 1])


def _step(params, tokens, positions, cache, attention_mask):
    """Logits 10 at TABLE[last token], 1 elsewhere; counts calls in the cache index."""
    logits = jax.nn.one_hot(jnp.asarray(TABLE)[tokens], VOCAB) * 9.0 + 1.0
    return logits, cache.advance(tokens.shape[1])


def _run(prompt_last, new_tokens, eos=None, pad=0, process=None, choose=None, key=0):
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
        eos_token_ids=None if eos is None else jnp.asarray(eos, jnp.int32),
    )
    first_logits, _ = _step(None, tokens[:, 1:2], None, state.cache, None)
    return decode(_step, None, state, first_logits[:, -1], rules)


def test_greedy_follows_the_table():
    state = _run([1, 4], new_tokens=4)
    np.testing.assert_array_equal(state.tokens[:, 2:], [[2, 3, 4, 5], [5, 1, 2, 3]])
    # One model call per token after the first (which comes from the prefill logits).
    assert int(state.cache.index) == 2 + 3
    assert int(state.length) == 6


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
