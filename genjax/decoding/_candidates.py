"""Where candidate tokens come from: prompt lookup, or a draft model's own decoding loop.

See :mod:`genjax.decoding.assisted` for the algorithm and its references. Static: ``G``, the
n-gram size, whether tokens are sampled. Traced: the per-row limits, lengths and the key.
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


def lookup_candidates(state: AssistState, rules: AssistRules, limit: Array) -> tuple[Array, Array]:
    """Prompt-lookup candidates: (int32[B, G] tokens, int32[B] how many, at most ``limit``).

    For n from ``max_matching_ngram_size`` down to 1, the row's last n tokens are searched for
    in the row (left padding excluded); the earliest occurrence followed by at least one token
    gives up to ``G`` candidates, ending before the row's end and before any EOS token.
    """
    width = rules.num_candidates
    first_valid = rules.context.first_valid

    def one(row, length, first):
        slots = jnp.arange(row.shape[0])
        found = jnp.zeros((), bool)
        start = jnp.zeros((), jnp.int32)
        for size in range(rules.lookup_ngram, 0, -1):
            match = (slots >= first) & (slots + size < length) & (size <= length - first - 1)
            for k in range(size):
                target = row[jnp.maximum(length - size + k, 0)]
                match = match & (row[jnp.minimum(slots + k, row.shape[0] - 1)] == target)
            here = jnp.any(match)
            start = jnp.where(found | ~here, start, jnp.argmax(match) + size)
            found = found | here
        picked = row[jnp.minimum(start + jnp.arange(width), row.shape[0] - 1)]
        count = jnp.minimum(width, length - start)
        if rules.eos_token_ids is not None:
            eos = is_eos(picked, rules.eos_token_ids)
            count = jnp.minimum(count, jnp.where(jnp.any(eos), jnp.argmax(eos), width))
        return picked, jnp.where(found, count, 0)

    picked, count = jax.vmap(one)(state.tokens, state.lengths, first_valid)
    return picked, jnp.minimum(count, limit)


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
) -> tuple[DraftCarry, Array]:
    """Runs the draft for up to ``G`` tokens; returns the final carry and the draft mask.

    The draft first reads ``[x, newest]`` (``x``: the token before the newest, a hole unless the
    draft had not seen it), then one token per step; a row stops proposing after ``limit[b]``
    candidates, after an EOS, or when the candidate's probability under the draft's processed
    distribution falls below ``assistant_confidence_threshold`` (that candidate is kept, as in
    transformers' ``ConfidenceCriteria``). The loop ends when no row is proposing.
    """
    batch = state.lengths.shape[0]
    width = rules.num_candidates
    index = state.draft_cache.index
    opened = jnp.concatenate(
        [state.draft_behind[:, None], jnp.ones((batch, width), bool)], axis=1
    ).astype(jnp.int32)
    mask = jax.lax.dynamic_update_slice(state.draft_mask, opened, (0, index))
    pair = jnp.stack(
        [
            token_at(state.tokens, jnp.maximum(state.lengths - 2, 0)),
            token_at(state.tokens, state.lengths - 1),
        ],
        axis=1,
    )
    where = clamp_positions(rules, state.positions[:, None] + jnp.arange(-1, 1)[None, :])
    logits, cache = draft(params, pair, where, state.draft_cache, mask)
    vocab = logits.shape[-1]
    carry = DraftCarry(
        steps=jnp.zeros((), jnp.int32),
        logits=logits[:, -1],
        cache=cache,
        tokens=state.tokens,
        candidates=jnp.zeros((batch, width), jnp.int32),
        count=jnp.zeros((batch,), jnp.int32),
        active=limit >= 1,
        probs=jnp.zeros((batch, width, vocab)) if rules.do_sample else None,
    )

    def propose(carry: DraftCarry) -> DraftCarry:
        step = carry.steps
        slot = state.lengths + step
        scores = process_rows(rules, carry.logits, carry.tokens, slot)
        token = choose(rules, scores, jax.random.fold_in(key, step))
        probs = jax.nn.softmax(scores, axis=-1)
        confidence = jnp.take_along_axis(probs, token[:, None], axis=1)[:, 0]
        one = jnp.ones_like(token)
        keep = (
            carry.active
            & (confidence >= rules.threshold)
            & (step + 1 < limit)
            & ~is_eos(token, rules.eos_token_ids)
        )
        return carry.replace(
            steps=step + 1,
            tokens=write_block(carry.tokens, slot, token[:, None], one),
            candidates=carry.candidates.at[:, step].set(token),
            count=carry.count + carry.active.astype(jnp.int32),
            active=keep,
            probs=None if carry.probs is None else carry.probs.at[:, step].set(probs),
        )

    def body(carry: DraftCarry) -> DraftCarry:
        last = carry.candidates[:, carry.steps - 1]
        where = clamp_positions(rules, state.positions + carry.steps)
        logits, cache = draft(params, last[:, None], where[:, None], carry.cache, mask)
        return propose(carry.replace(logits=logits[:, -1], cache=cache))

    def cond(carry: DraftCarry) -> Array:
        return (carry.steps < width) & jnp.any(carry.active)

    carry = jax.lax.while_loop(cond, body, propose(carry))
    return carry, mask
