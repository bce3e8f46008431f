"""Assisted generation in one ``lax.while_loop``: speculative decoding and prompt lookup.

Each iteration proposes up to ``G`` candidate tokens per row, scores the row's newest token and
all candidates with the target model in one forward pass of ``T = G + 1`` tokens, and commits,
per row, the accepted candidates plus one token chosen by the target (the correction after the
first rejection, or a bonus token when every candidate was accepted). Rows accept different
numbers of tokens, so each row has its own length in the token buffer.

Candidates come from a draft model (``assistant_model``: speculative decoding) or from the
sequence itself (``prompt_lookup_num_tokens``: the tokens that followed the most recent n-gram's
earliest earlier occurrence, transformers' ``PromptLookupCandidateGenerator``).

Acceptance:
    * Greedy: a candidate is accepted while it equals the target's argmax, so the output equals
      plain greedy decoding of the target, token for token.
    * Sampling with a draft model: the speculative sampling rule (accept candidate ``x`` with
      probability ``min(1, p(x) / q(x))``; after a rejection sample from ``normalize(max(0, p -
      q))``; if all are accepted sample a bonus token from ``p``), where ``p`` and ``q`` are the
      target's and the draft's *processed* distributions (every processor and warper applied), so
      the output follows the target's sampling distribution.
    * Sampling with prompt lookup (no draft distribution): the target samples a token at every
      position and candidates are accepted while they equal it, as transformers does.

Processors and stopping rules see, for each committed token, the same buffer and length plain
decoding would show them (they are applied row by row, each with its own length); a row that
finishes inside an accepted block stops there and the rest of the block is not written.

KV caches and the memory cost:
    Models write ``T`` slots at one shared cache index (the model protocol), so rows cannot each
    keep their own index. Each target pass writes ``[newest, c_1 .. c_G]`` at the index; slots of
    rejected candidates get ``attention_mask`` 0 ("holes") and position ids count only accepted
    tokens, so nothing is ever copied. The index then advances by the largest number of tokens a
    running row committed, so slots nobody accepted are overwritten by the next pass. With one row
    there are no holes at all; with ``B`` rows the rows that committed fewer tokens leave holes.
    The target cache therefore holds ``P + min(B, T) * (N - 1) + T`` slots, and the draft's
    ``P + (min(B, T) + 1) * (N - 1) + T`` (the draft first re-reads the token before the newest
    when it had not seen it, one extra slot per iteration): for ``B = 1`` about ``P + N + T`` and
    ``P + 2N``, for large batches up to ``T`` times plain decoding's ``P + N``. Attention reads the
    whole cache, so its cost grows the same way. The alternative, a per-row cache index, needs
    per-row cache writes in every model; the holes keep the model protocol unchanged.

Differences from transformers (which runs assisted generation for batch size 1 only):
    * ``num_assistant_tokens`` is the static upper bound ``G``; the "heuristic" schedule (+2 after
      an iteration where every candidate was accepted, -1 otherwise, at least 1) runs per row and
      never goes above ``G``. Each call starts again from ``num_assistant_tokens``, so
      "heuristic" behaves as "heuristic_transient" (a pure function keeps no state across calls).
      The settings come from the generation config, not from the assistant's own config.
    * ``assistant_confidence_threshold`` is fixed for the call (transformers re-tunes it from a
      ROC curve when scikit-learn is installed).
    * Prompt lookup does not run the processors on dummy logits to drop forbidden candidates
      (that changes which candidates are tried, never the output).
    * ``max_time`` is checked once per iteration; ``scores``/``logits`` of a row after it finished
      hold 0 (plain decoding records the steps other rows still run).
    * Processors and stopping criteria run with one row at a time (batch size 1), each with the
      row's own length; user processors (``logits_processor``, ``allowed_tokens_fn``, stopping
      criteria) must therefore not depend on the batch size.

Static or traced:
    Static: ``G`` (``num_assistant_tokens`` or ``prompt_lookup_num_tokens``), the schedule, the
    n-gram size, whether tokens are sampled, the processors and stopping rules present, the cache
    lengths and the buffer length. Traced: the per-row lengths and draft lengths, the confidence
    threshold, the PRNG key, every processor setting, the pad and EOS ids.

Randomness: the first token draws with ``fold_in(key, 0)`` and iteration ``i`` with
``fold_in(key, i + 1)`` (then one stream each for the draft,
the acceptance test and the correction), so the same key gives the same tokens; the tokens differ
from plain sampling with the same key, while their distribution is the same.

Modules: this one runs the loop (commit, verify, decode, finish); ``_assist_state`` holds the
call's rules and state and the row-wise helpers, ``_candidates`` the prompt-lookup and draft
candidate generators, ``_assist_checks`` the checks made before tracing.

References:
    Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative Decoding",
    arXiv:2211.17192. Chen et al. 2023, "Accelerating Large Language Model Decoding with
    Speculative Sampling", arXiv:2302.01318. Saxena 2023, "Prompt Lookup Decoding",
    github.com/apoorvumang/prompt-lookup-decoding. Hugging Face transformers' assisted
    generation (``generation/candidate_generator.py``, ``_assisted_decoding``,
    ``_speculative_sampling``, ``ConfidenceCriteria``) defines the semantics matched here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from genjax.decoding._assist_checks import check_call, check_config, is_assisted
from genjax.decoding._assist_state import (
    AssistRules,
    AssistState,
    cache_lengths,
    choose,
    clamp_positions,
    init_state,
    leading,
    make_rules,
    process_block,
    process_rows,
    running_rows,
    stop_flags,
    token_at,
    write_block,
)
from genjax.decoding._candidates import DraftCarry, StepFn, draft_candidates, lookup_candidates
from genjax.stopping import time_is_up
from genjax.typing import Array, PyTree

__all__ = [
    "AssistRules",
    "AssistState",
    "cache_lengths",
    "check_call",
    "check_config",
    "decode",
    "finish",
    "first_token",
    "init_state",
    "is_assisted",
    "make_rules",
]

# ----------------------------------------------------------------------------- committing


def commit(
    state: AssistState,
    rules: AssistRules,
    block: Array,
    count: Array,
    scores: Array,
    logits: Array,
) -> tuple[AssistState, Array]:
    """Commits ``block[b, :count[b]]`` (int32[B, T]) to each running row, applying the stopping
    rules to each token in turn: a row that finishes at token ``t`` keeps ``t + 1`` tokens.

    Args:
        state: the state before the tokens.
        rules: the call's rules.
        block: int32[B, T], tokens to commit.
        count: int32[B], how many of them (before stopping rules cut it).
        scores: float32[B, T, V] processed scores of the block's tokens.
        logits: float32[B, T, V] their raw logits.

    Returns:
        The new state and int32[B], the tokens each row committed.
    """
    size = state.tokens.shape[1] - rules.num_candidates - 1
    width = block.shape[1]
    running = running_rows(state, rules)
    count = jnp.where(running, jnp.minimum(count, size - state.lengths), 0)
    tokens = write_block(state.tokens, state.lengths, block, count)
    ends = state.lengths[:, None] + 1 + jnp.arange(width)[None, :]  # int32[B, T]
    stops = stop_flags(rules, tokens, ends) & (jnp.arange(width)[None, :] < count[:, None])
    stopped = jnp.any(stops, axis=1)
    count = jnp.where(stopped, jnp.argmax(stops, axis=1) + 1, count)
    # Slots after the committed tokens go back to pad (they may hold candidates).
    slots = jnp.arange(tokens.shape[1])[None, :]
    tokens = jnp.where(slots < (state.lengths + count)[:, None], tokens, rules.pad_token_id)
    lengths = state.lengths + count
    newly = stopped & ~state.finished
    step = state.lengths - rules.prompt_length
    state = state.replace(
        tokens=tokens,
        lengths=lengths,
        positions=state.positions + count,
        finished=state.finished | stopped,
        stop_lengths=jnp.where(newly, lengths, state.stop_lengths),
        scores=_record(state.scores, scores, step),
        raw_logits=_record(state.raw_logits, logits, step),
    )
    return state, count


def _record(buffer: Array | None, values: Array, step: Array) -> Array | None:
    """Writes float[B, T, V] values at per-row steps int32[B] of a float32[B, N + T, V] buffer
    (entries past a row's committed tokens are overwritten later, or zeroed at the end)."""
    if buffer is None:
        return None

    def one(row, block, at):
        return jax.lax.dynamic_update_slice(row, block.astype(row.dtype), (at, 0))

    return jax.vmap(one)(buffer, values, step)


def first_token(state: AssistState, logits: Array, rules: AssistRules) -> AssistState:
    """Chooses and commits the first new token from the prefill's last logits float32[B, V]."""
    scores = process_rows(rules, logits, state.tokens, state.lengths)
    key = jax.random.fold_in(state.key, 0)
    token = choose(rules, scores, key)
    state, _ = commit(
        state, rules, token[:, None], jnp.ones_like(token), scores[:, None], logits[:, None]
    )
    return state


# ----------------------------------------------------------------------------- verification


def _speculative(
    rules: AssistRules, scores: Array, draft: DraftCarry, key: Array
) -> tuple[Array, Array]:
    """The speculative sampling rule: (accepted int32[B], next token int32[B]).

    Candidate ``j`` is accepted with probability ``min(1, p_j(x) / q_j(x))``; after the first
    rejection at ``a`` the next token is drawn from ``normalize(max(0, p_a - q_a))``, and when all
    proposed candidates are accepted, from ``p_a`` (the bonus token).
    """
    width = rules.num_candidates
    batch = scores.shape[0]
    rows = jnp.arange(batch)
    p = jax.nn.softmax(scores, axis=-1)  # float32[B, T, V]
    picked = draft.candidates[..., None]
    p_x = jnp.take_along_axis(p[:, :width], picked, axis=-1)[..., 0]
    q_x = jnp.take_along_axis(draft.probs, picked, axis=-1)[..., 0]
    accept_key, next_key = jax.random.split(key)
    u = jax.random.uniform(accept_key, (batch, width))
    proposed = jnp.arange(width)[None, :] < draft.count[:, None]
    accepted = leading(proposed & (u * q_x <= p_x))
    p_a = p[rows, accepted]
    q_a = draft.probs[rows, jnp.minimum(accepted, width - 1)]
    residual = jnp.maximum(p_a - q_a, 0.0)
    rejected = (accepted < draft.count) & (jnp.sum(residual, axis=-1) > 0)
    weights = jnp.where(rejected[:, None], residual, p_a)
    token = jax.random.categorical(next_key, jnp.log(weights), axis=-1).astype(jnp.int32)
    return accepted, token


def _matching(
    rules: AssistRules, scores: Array, candidates: Array, count: Array, key: Array
) -> tuple[Array, Array]:
    """Greedy (or prompt-lookup sampling) acceptance: candidates are accepted while they equal
    the target's choice at their position; returns (accepted int32[B], next token int32[B])."""
    chosen = choose(rules, scores, key)  # int32[B, T]
    width = candidates.shape[1]
    proposed = jnp.arange(width)[None, :] < count[:, None]
    accepted = leading(proposed & (candidates == chosen[:, :width]))
    return accepted, token_at(chosen, accepted)


def _iteration(
    state: AssistState,
    rules: AssistRules,
    target: StepFn,
    params: PyTree,
    draft: StepFn | None,
    draft_params: PyTree,
) -> AssistState:
    """One draft → verify → commit round for every row."""
    batch = state.lengths.shape[0]
    width = rules.num_candidates
    block = width + 1
    size = state.tokens.shape[1] - block
    key = jax.random.fold_in(state.key, state.iteration + 1)
    draft_key, verify_key = jax.random.split(key)
    running = running_rows(state, rules)
    limit = jnp.where(running, jnp.minimum(state.num_candidates, size - state.lengths - 1), 0)
    if draft is None:
        candidates, count = lookup_candidates(state, rules, limit)
        tokens = write_block(state.tokens, state.lengths, candidates, count)
        proposal = None
    else:
        proposal, draft_mask = draft_candidates(state, rules, limit, draft_key, draft, draft_params)
        candidates, count, tokens = proposal.candidates, proposal.count, proposal.tokens

    # Verify: the newest token and all candidates in one pass of T = G + 1 tokens.
    index = state.cache.index
    mask = jax.lax.dynamic_update_slice(
        state.cache_mask, jnp.ones((batch, block), jnp.int32), (0, index)
    )
    feed = jnp.concatenate([token_at(tokens, state.lengths - 1)[:, None], candidates], axis=1)
    where = clamp_positions(rules, state.positions[:, None] + jnp.arange(block)[None, :])
    logits, cache = target(params, feed, where, state.cache, mask)
    scores = process_block(rules, logits, tokens, state.lengths)
    if proposal is not None and rules.do_sample:
        accepted, token = _speculative(rules, scores, proposal, verify_key)
    else:
        accepted, token = _matching(rules, scores, candidates, count, verify_key)
    offsets = jnp.arange(block)[None, :]
    padded = jnp.concatenate([candidates, candidates[:, :1]], axis=1)
    chosen = jnp.where(offsets < accepted[:, None], padded, token[:, None])
    state = state.replace(tokens=tokens)
    state, taken = commit(state, rules, chosen, accepted + 1, scores, logits)

    # Roll back: holes where a row committed fewer tokens; the index moves past the longest.
    kept = (offsets < taken[:, None]).astype(jnp.int32)
    advance = jnp.maximum(jnp.max(jnp.where(running, taken, 0)), 1)
    state = state.replace(
        cache=cache.replace(index=index + advance),
        cache_mask=jax.lax.dynamic_update_slice(mask, kept, (0, index)),
        num_accepted=state.num_accepted + jnp.minimum(accepted, taken),
        iteration=state.iteration + 1,
    )
    if proposal is not None:
        state = _roll_back_draft(state, rules, proposal, draft_mask, taken, running)
        if rules.schedule != "constant":
            grown = jnp.where(accepted >= count, state.num_candidates + 2, state.num_candidates - 1)
            grown = jnp.clip(grown, 1, width)
            state = state.replace(num_candidates=jnp.where(running, grown, state.num_candidates))
    if rules.stopping.max_time is not None:
        late = time_is_up(rules.stopping, state.iteration, jnp.max(state.lengths))
        state = state.replace(finished=state.finished | late)
    return state


def _roll_back_draft(
    state: AssistState,
    rules: AssistRules,
    proposal: DraftCarry,
    mask: Array,
    taken: Array,
    running: Array,
) -> AssistState:
    """Marks the draft's slots ``[x, newest, c_1 .. c_{k-1}]`` of this round: ``x`` as before,
    the newest and the committed candidates kept, the rest holes; advances its index."""
    width = rules.num_candidates
    index = state.draft_cache.index
    seen = jnp.minimum(taken - 1, proposal.steps - 1)  # committed candidates the draft has read
    slots = jnp.arange(width + 1)[None, :]
    kept = jnp.where(slots == 0, state.draft_behind[:, None], (slots - 1 <= seen[:, None]))
    kept = kept & (taken[:, None] > 0)
    advance = jnp.maximum(jnp.max(jnp.where(running, seen + 2, 0)), 2)
    return state.replace(
        draft_cache=proposal.cache.replace(index=index + advance),
        draft_mask=jax.lax.dynamic_update_slice(mask, kept.astype(jnp.int32), (0, index)),
        draft_behind=(taken - 1 == proposal.steps) & (taken > 0),
    )


def decode(
    target: StepFn,
    params: PyTree,
    draft: StepFn | None,
    draft_params: PyTree,
    state: AssistState,
    first_logits: Array,
    rules: AssistRules,
) -> AssistState:
    """Runs assisted generation until every row is done or full.

    Args:
        target: the target model's step function (see :mod:`genjax.decoding.sampling`).
        params: the target's parameters.
        draft: the draft model's step function, or None for prompt lookup.
        draft_params: the draft's parameters (None for prompt lookup).
        state: from :func:`init_state`, after both prefills.
        first_logits: float32[B, V], the target prefill's logits at the last prompt slot.
        rules: the call's :class:`AssistRules`.

    Returns:
        The final state; use :func:`finish` for the outputs.

    Example:
        ``genjax.generate(model, params, ids, config, assistant_model=draft,
        assistant_params=draft_params)`` builds the state and rules and calls this.
    """
    state = first_token(state, first_logits, rules)
    block = rules.num_candidates + 1

    def cond(state: AssistState) -> Array:
        room = state.cache.index + block <= state.cache.length
        if state.draft_cache is not None:
            room = room & (state.draft_cache.index + block <= state.draft_cache.length)
        return jnp.any(running_rows(state, rules)) & room

    def body(state: AssistState) -> AssistState:
        return _iteration(state, rules, target, params, draft, draft_params)

    return jax.lax.while_loop(cond, body, state)


def finish(state: AssistState, rules: AssistRules) -> tuple[Array, Array | None, Array | None]:
    """Returns (sequences int32[B, P+N], scores, logits float32[B, N, V] or None): the buffer
    cut to ``P + N`` slots (and, without EOS ids, at the longest finished length once every row
    finished, as plain decoding stops there), steps past a row's end zeroed."""
    size = state.tokens.shape[1] - rules.num_candidates - 1
    end = jnp.full((), size, jnp.int32)
    if rules.eos_token_ids is None:
        end = jnp.where(jnp.all(state.finished), jnp.max(state.stop_lengths), end)
    slots = jnp.arange(size)[None, :]
    sequences = jnp.where(slots < end, state.tokens[:, :size], rules.pad_token_id)
    steps = jnp.arange(rules.num_new_tokens)[None, :, None]
    done = (jnp.minimum(state.lengths, end) - rules.prompt_length)[:, None, None]

    def cut(buffer):
        if buffer is None:
            return None
        return jnp.where(steps < done, buffer[:, : rules.num_new_tokens], 0.0)

    return sequences, cut(state.scores), cut(state.raw_logits)
