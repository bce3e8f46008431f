"""Where candidate tokens come from: prompt lookup, or a draft model's own decoding loop.

Both give a :class:`Proposal`: up to ``G`` candidates per row, written into the token buffer
after the row's end, for the target to verify. See :mod:`genjax.decoding.assisted` for the
algorithm and its references. Static: ``G``, the n-gram size, whether tokens are sampled.
Traced: the per-row limits, lengths and the key.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from genjax.cache import KVCache
from genjax.decoding._assist_state import (
    AssistRules,
    AssistState,
    choose,
    clamp_positions,
    process_rows,
    token_at,
    write_block,
)
from genjax.stopping import is_eos
from genjax.typing import Array, PyTree

StepFn = Callable[[PyTree, Array, Array, KVCache, Array], tuple[Array, KVCache]]


@struct.dataclass
class Proposal:
    """One iteration's candidates, from prompt lookup or from the draft."""

    candidates: Array  # int32[B, G]: the first count[b] are proposed, the rest unused
    count: Array  # int32[B]: candidates proposed per row
    tokens: Array  # int32[B, S + T]: the buffer with the candidates written after each row's end
    probs: Array | None = None  # float32[B, G, V]: the draft's distribution q (draft, sampling)
    draft_steps: Array | None = None  # int32[]: candidates the draft loop drew (k); draft only
    draft_cache: KVCache | None = None  # the draft's cache after the loop, index not rolled back
    draft_mask: Array | None = None  # int32[B, Sd]: the draft's mask with this round's slots open


# ----------------------------------------------------------------------------- prompt lookup


def lookup_candidates(state: AssistState, rules: AssistRules, limit: Array) -> tuple[Array, Array]:
    """Prompt-lookup candidates: (int32[B, G] tokens, int32[B] how many, at most ``limit``).

    For n from ``max_matching_ngram_size`` down to 1, the row's last n tokens are searched for
    in the row (left padding excluded); the earliest occurrence followed by at least one token
    gives up to ``G`` candidates, ending before the row's end and before any EOS token.
    """
    candidates, count = jax.vmap(lambda row, length, first: _lookup_row(rules, row, length, first))(
        state.tokens, state.lengths, rules.context.first_valid
    )
    return candidates, jnp.minimum(count, limit)


def lookup_proposal(state: AssistState, rules: AssistRules, limit: Array) -> Proposal:
    """:func:`lookup_candidates` as a :class:`Proposal`, the candidates written into the buffer."""
    candidates, count = lookup_candidates(state, rules, limit)
    tokens = write_block(state.tokens, state.lengths, candidates, count)
    return Proposal(candidates=candidates, count=count, tokens=tokens)


def _lookup_row(
    rules: AssistRules, row: Array, length: Array, first_valid: Array
) -> tuple[Array, Array]:
    """One row's candidates int32[G] and their count int32[], before the per-row limit."""
    width = rules.num_candidates
    last = row.shape[0] - 1
    found, start = _continuation_start(rules, row, length, first_valid)
    candidates = row[jnp.minimum(start + jnp.arange(width), last)]
    count = jnp.minimum(width, length - start)
    if rules.eos_token_ids is not None:
        eos = is_eos(candidates, rules.eos_token_ids)
        count = jnp.minimum(count, jnp.where(jnp.any(eos), jnp.argmax(eos), width))
    return candidates, jnp.where(found, count, 0)


def _continuation_start(
    rules: AssistRules, row: Array, length: Array, first_valid: Array
) -> tuple[Array, Array]:
    """(bool[] found, int32[] slot): where the tokens after the earliest earlier occurrence of
    the row's last n-gram start, for the largest n (up to ``lookup_ngram``) that occurs.

    An occurrence at slot ``i`` must lie in the row (``i >= first_valid``) and be followed by
    at least one token before the row's end (``i + n < length``).
    """
    starts = jnp.arange(row.shape[0])
    last = row.shape[0] - 1
    found = jnp.zeros((), bool)
    start = jnp.zeros((), jnp.int32)
    # an n-gram as long as the buffer can never occur before the row's end (transformers stops
    # at the input's length - 1 too), so larger sizes unroll nothing
    for ngram in range(min(rules.lookup_ngram, row.shape[0] - 1), 0, -1):
        matches = (starts >= first_valid) & (starts + ngram < length)
        matches = matches & (ngram <= length - first_valid - 1)
        for offset in range(ngram):
            wanted = row[jnp.maximum(length - ngram + offset, 0)]
            matches = matches & (row[jnp.minimum(starts + offset, last)] == wanted)
        occurs = jnp.any(matches)
        start = jnp.where(found | ~occurs, start, jnp.argmax(matches) + ngram)
        found = found | occurs
    return found, start


# ----------------------------------------------------------------------------- draft model


@struct.dataclass
class DraftCarry:
    """The draft loop's carry."""

    steps: Array  # int32[]: candidates drawn so far (k)
    logits: Array  # float32[B, V]: the draft's logits for the next candidate
    cache: KVCache
    tokens: Array  # int32[B, S + T]: the buffer with the candidates so far written in
    candidates: Array  # int32[B, G]
    count: Array  # int32[B]: candidates proposed per row
    active: Array  # bool[B]: rows still proposing
    probs: Array | None  # float32[B, G, V]: the draft's distribution q of each candidate


def draft_candidates(
    state: AssistState,
    rules: AssistRules,
    limit: Array,
    key: Array,
    draft: StepFn,
    params: PyTree,
) -> Proposal:
    """Runs the draft for up to ``G`` tokens; returns its candidates, cache and mask.

    The draft first reads ``[x, newest]`` (``x``: the token before the newest, a hole unless the
    draft had not seen it), then one token per step; a row stops proposing after ``limit[b]``
    candidates, after an EOS, or when the candidate's probability under the draft's processed
    distribution falls below ``assistant_confidence_threshold`` (that candidate is kept, as in
    transformers' ``ConfidenceCriteria``). The loop ends when no row is proposing.

    Args:
        state: the loop state before this iteration.
        rules: the call's rules.
        limit: int32[B], the most candidates each row may propose (0 for rows that are done).
        key: the iteration's draft key; candidate ``k`` draws with ``fold_in(key, k)``.
        draft, params: the draft's step function and parameters.
    """
    state = state.replace(draft_cache=state.draft_cache.replace(index=draft_start(state)))
    mask = _open_draft_slots(state, rules)
    carry = _read_newest(state, rules, limit, draft, params, mask)

    def body(carry: DraftCarry) -> DraftCarry:
        carry = _read_last_candidate(carry, state, rules, draft, params, mask)
        return _draw_candidate(carry, state, rules, limit, key)

    def cond(carry: DraftCarry) -> Array:
        return (carry.steps < rules.num_candidates) & jnp.any(carry.active)

    carry = jax.lax.while_loop(cond, body, _draw_candidate(carry, state, rules, limit, key))
    return Proposal(
        candidates=carry.candidates,
        count=carry.count,
        tokens=carry.tokens,
        probs=carry.probs,
        draft_steps=carry.steps,
        draft_cache=carry.cache,
        draft_mask=mask,
    )


def draft_start(state: AssistState) -> Array:
    """int32[]: the draft slot where this round writes ``x``, the token before the newest.

    With several rows, the draft's index (past every slot written): ``x`` is a hole where the
    draft had read it already. With one row the draft cache has no holes at all: its index is
    one past the last token it holds, and ``x`` goes to ``index - 1`` (written again, the same
    keys and values) unless the draft is behind (``x`` unread), then to ``index``. A sliding
    window counts cache slots, so holes would shorten it: a windowed draft with holes proposes
    tokens the target rejects."""
    index = state.draft_cache.index
    if state.lengths.shape[0] > 1:
        return index
    return index - 1 + state.draft_behind[0].astype(jnp.int32)


def x_slot_valid(state: AssistState) -> Array:
    """bool[B, 1]: whether this round's ``x`` slot (see :func:`draft_start`) holds a token the
    draft reads: where it had not read ``x``, and always with one row (``x`` written again)."""
    return state.draft_behind[:, None] | (state.lengths.shape[0] == 1)


def _open_draft_slots(state: AssistState, rules: AssistRules) -> Array:
    """int32[B, Sd]: the draft mask with this round's ``T`` slots from :func:`draft_start`
    open: slot 0 (``x``) only where the draft had not read it (always with one row), the rest
    for the newest token and the candidates."""
    batch = state.lengths.shape[0]
    opened = jnp.concatenate(
        [x_slot_valid(state), jnp.ones((batch, rules.num_candidates), bool)], axis=1
    ).astype(jnp.int32)
    return jax.lax.dynamic_update_slice(state.draft_mask, opened, (0, state.draft_cache.index))


def _read_newest(
    state: AssistState,
    rules: AssistRules,
    limit: Array,
    draft: StepFn,
    params: PyTree,
    mask: Array,
) -> DraftCarry:
    """Feeds the draft ``[x, newest]`` (the tokens at slots ``lengths - 2`` and ``lengths - 1``)
    and returns the draft loop's first carry, with the draft's logits for candidate 1."""
    batch = state.lengths.shape[0]
    width = rules.num_candidates
    last_two = jnp.stack(
        [
            token_at(state.tokens, jnp.maximum(state.lengths - 2, 0)),
            token_at(state.tokens, state.lengths - 1),
        ],
        axis=1,
    )
    position_ids = clamp_positions(rules, state.positions[:, None] + jnp.arange(-1, 1)[None, :])
    logits, cache = draft(params, last_two, position_ids, state.draft_cache, mask)
    vocab = logits.shape[-1]
    return DraftCarry(
        steps=jnp.zeros((), jnp.int32),
        logits=logits[:, -1],
        cache=cache,
        tokens=state.tokens,
        candidates=jnp.zeros((batch, width), jnp.int32),
        count=jnp.zeros((batch,), jnp.int32),
        active=limit >= 1,
        probs=jnp.zeros((batch, width, vocab)) if rules.do_sample else None,
    )


def _read_last_candidate(
    carry: DraftCarry,
    state: AssistState,
    rules: AssistRules,
    draft: StepFn,
    params: PyTree,
    mask: Array,
) -> DraftCarry:
    """Feeds the draft its latest candidate (position ``positions + k``); stores the logits for
    the next one and the cache."""
    last = carry.candidates[:, carry.steps - 1]
    position_ids = clamp_positions(rules, state.positions + carry.steps)
    logits, cache = draft(params, last[:, None], position_ids[:, None], carry.cache, mask)
    return carry.replace(logits=logits[:, -1], cache=cache)


def _draw_candidate(
    carry: DraftCarry, state: AssistState, rules: AssistRules, limit: Array, key: Array
) -> DraftCarry:
    """Draws candidate ``k = carry.steps`` from the draft's processed logits for every row,
    writes it at slot ``lengths + k`` and decides which rows go on proposing."""
    step = carry.steps
    slot = state.lengths + step
    scores = process_rows(rules, carry.logits, carry.tokens, slot)
    token = choose(rules, scores, jax.random.fold_in(key, step))
    probs = jax.nn.softmax(scores, axis=-1)
    confidence = jnp.take_along_axis(probs, token[:, None], axis=1)[:, 0]
    one_each = jnp.ones_like(token)
    still_active = (
        carry.active
        & (confidence >= rules.threshold)
        & (step + 1 < limit)
        & ~is_eos(token, rules.eos_token_ids)
    )
    return carry.replace(
        steps=step + 1,
        tokens=write_block(carry.tokens, slot, token[:, None], one_each),
        candidates=carry.candidates.at[:, step].set(token),
        count=carry.count + carry.active.astype(jnp.int32),
        active=still_active,
        probs=None if carry.probs is None else carry.probs.at[:, step].set(probs),
    )
