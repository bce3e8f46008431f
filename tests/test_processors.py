"""Logits processors against plain NumPy statements of transformers' rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genjax import processors as P

VOCAB = 12


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


@pytest.mark.parametrize("k", [1, 3, 11, 12, 50])
def test_top_k_matches_reference(k):
    x = _logits(k)
    np.testing.assert_array_equal(P.top_k(k)(x, CTX), _ref_top_k(x, k))


def test_top_k_zero_keeps_everything_and_per_row_k():
    x = _logits(1)
    np.testing.assert_array_equal(P.top_k(0)(x, CTX), x)
    got = P.top_k(jnp.array([1, 2, 0]))(x, CTX)
    np.testing.assert_array_equal(got[0], _ref_top_k(x[:1], 1)[0])
    np.testing.assert_array_equal(got[1], _ref_top_k(x[1:2], 2)[0])
    np.testing.assert_array_equal(got[2], x[2])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_matches_reference(p):
    x = _logits(int(p * 100))
    np.testing.assert_array_equal(P.top_p(p)(x, CTX), _ref_top_p(x, p))


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


def test_chain_equals_processors_applied_by_hand():
    x = _logits(5)
    chained = P.chain(P.temperature(0.7), P.top_k(5), P.top_p(0.8))(x, CTX)
    by_hand = P.top_p(0.8)(P.top_k(5)(P.temperature(0.7)(x, CTX), CTX), CTX)
    np.testing.assert_array_equal(chained, by_hand)


def test_traced_values_do_not_recompile():
    traces = []

    @jax.jit
    def warp(x, t, k, p, m, r):
        traces.append(1)
        chain = P.chain(
            P.repetition_penalty(r), P.temperature(t), P.top_k(k), P.top_p(p), P.min_p(m)
        )
        return chain(x, CTX)

    x = _logits(6)
    warp(x, 0.7, 5, 0.9, 0.05, 1.2)
    warp(x, 1.3, 2, 0.5, 0.1, 1.5)
    assert len(traces) == 1


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_neutral_settings_change_nothing(seed):
    x = _logits(seed)
    np.testing.assert_array_equal(P.top_p(1.0)(x, CTX), x)
    np.testing.assert_array_equal(P.top_k(0)(x, CTX), x)
    np.testing.assert_array_equal(P.top_k(VOCAB)(x, CTX), x)
    kept = np.asarray(P.top_k(1)(x, CTX))
    np.testing.assert_array_equal(np.argmax(kept, -1), np.argmax(x, -1))
    assert (np.isfinite(kept).sum(-1) == 1).all()


@pytest.mark.parity
def test_processors_match_transformers():
    import torch
    from transformers.generation import logits_process as hf

    x = _logits(11, batch=2, vocab=40)
    ids = np.array([[0, 0, 3, 7, 3], [1, 2, 3, 4, 5]])
    ctx = _context(ids, first_valid=[2, 0])
    cases = [
        (P.temperature(0.6), hf.TemperatureLogitsWarper(0.6)),
        (P.top_k(7), hf.TopKLogitsWarper(7)),
        (P.top_p(0.7), hf.TopPLogitsWarper(0.7)),
        (P.min_p(0.1), hf.MinPLogitsWarper(0.1)),
        (
            P.repetition_penalty(1.7),
            hf.RepetitionPenaltyLogitsProcessor(1.7, prompt_ignore_length=torch.tensor([2, 0])),
        ),
    ]
    for ours, theirs in cases:
        expected = theirs(torch.tensor(ids), torch.tensor(x)).numpy()
        np.testing.assert_allclose(ours(x, ctx), expected, rtol=1e-6, atol=1e-6)
