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
    ``P + (min(B, T) + 1) * (N - 1) + T`` (the draft first re-reads the token before the newest,
    one extra slot per iteration; with one row it writes that token over its own slot, so the
    draft cache has no holes either): for ``B = 1`` about ``P + N + T`` each, for large
    batches up to ``T`` times plain decoding's ``P + N``. Attention reads the
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

Modules: this one runs the loop. One iteration (:func:`_iteration`) is four phases, one
function each: ``_propose`` (candidates from prompt lookup or the draft), ``_verify`` (one target
pass over the newest token and the candidates) and ``_accept`` (how many candidates each row
keeps, and the target's own next token), then ``commit`` (write the tokens, apply the stopping
rules) followed by the roll-backs of both caches (``_roll_back_target``, ``_roll_back_draft``)
and the schedule (``_resize_rounds``). ``_assist_state`` holds the call's rules and state and the
row-wise helpers, ``_candidates`` the prompt-lookup and draft candidate generators,
``_assist_checks`` the checks made before tracing.

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

from genjax.cache import KVCache
from genjax.decoding._assist_checks import check_call, check_config, is_assisted
from genjax.decoding._assist_state import (
    AssistRules,
    AssistState,
    cache_lengths,
    call_end,
    choose,
    clamp_positions,
    count_leading,
    init_state,
    make_rules,
    process_block,
    process_rows,
    ring_margin,
    running_rows,
    sequence_slots,
    stop_flags,
    token_at,
    write_block,
)
from genjax.decoding._candidates import (
    Proposal,
    StepFn,
    draft_candidates,
    draft_start,
    lookup_candidates,
    lookup_proposal,
    x_slot_valid,
)
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
    "lookup_candidates",
    "make_rules",
    "ring_margin",
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
    running = running_rows(state, rules)
    room = call_end(rules, state.tokens) - state.lengths
    count = jnp.where(running, jnp.minimum(count, room), 0)
    tokens = write_block(state.tokens, state.lengths, block, count)
    count, stopped = _cut_at_stops(rules, tokens, state.lengths, count, block.shape[1])
    # Slots after the committed tokens go back to pad (they may hold candidates).
    slots = jnp.arange(tokens.shape[1])[None, :]
    tokens = jnp.where(slots < (state.lengths + count)[:, None], tokens, rules.pad_token_id)
    lengths = state.lengths + count
    newly_finished = stopped & ~state.finished
    step = state.lengths - rules.prompt_length
    state = state.replace(
        tokens=tokens,
        lengths=lengths,
        positions=state.positions + count,
        finished=state.finished | stopped,
        stop_lengths=jnp.where(newly_finished, lengths, state.stop_lengths),
        scores=_record(state.scores, scores, step),
        raw_logits=_record(state.raw_logits, logits, step),
    )
    return state, count


def _cut_at_stops(
    rules: AssistRules, tokens: Array, lengths: Array, count: Array, width: int
) -> tuple[Array, Array]:
    """Applies the stopping rules after each of the ``count[b]`` (at most ``width``, static)
    tokens written at slot ``lengths[b]`` of ``tokens`` int32[B, S + T]; returns (int32[B] the
    count cut after the first token that finishes the row, bool[B] whether one did)."""
    ends = lengths[:, None] + 1 + jnp.arange(width)[None, :]  # int32[B, width]
    stops = stop_flags(rules, tokens, ends) & (jnp.arange(width)[None, :] < count[:, None])
    stopped = jnp.any(stops, axis=1)
    return jnp.where(stopped, jnp.argmax(stops, axis=1) + 1, count), stopped


def _record(buffer: Array | None, values: Array, step: Array) -> Array | None:
    """Writes float[B, T, V] values at per-row steps int32[B] of a float32[B, N + T, V] buffer
    (entries past a row's committed tokens are overwritten later, or zeroed at the end)."""
    if buffer is None:
        return None

    def write_row(row, block, at):
        return jax.lax.dynamic_update_slice(row, block.astype(row.dtype), (at, 0))

    return jax.vmap(write_row)(buffer, values, step)


def first_token(state: AssistState, logits: Array, rules: AssistRules) -> AssistState:
    """Chooses and commits the first new token from the prefill's last logits float32[B, V]."""
    scores = process_rows(rules, logits, state.tokens, state.lengths)
    key = jax.random.fold_in(state.key, 0)
    token = choose(rules, scores, key)
    one_each = jnp.ones_like(token)
    state, _ = commit(state, rules, token[:, None], one_each, scores[:, None], logits[:, None])
    return state


# ----------------------------------------------------------------------------- one iteration


def _iteration(
    state: AssistState,
    rules: AssistRules,
    target: StepFn,
    params: PyTree,
    draft: StepFn | None,
    draft_params: PyTree,
) -> AssistState:
    """One propose → verify → accept → commit round for every row, then the roll-backs."""
    key = jax.random.fold_in(state.key, state.iteration + 1)
    draft_key, verify_key = jax.random.split(key)
    running = running_rows(state, rules)
    proposal = _propose(state, rules, running, draft_key, draft, draft_params)
    logits, scores, cache, mask = _verify(state, rules, proposal, target, params)
    accepted, token = _accept(rules, scores, proposal, verify_key)
    block = _accepted_block(proposal.candidates, accepted, token)
    state = state.replace(tokens=proposal.tokens)
    state, taken = commit(state, rules, block, accepted + 1, scores, logits)
    state = _roll_back_target(state, rules, cache, mask, taken, running)
    state = state.replace(
        num_accepted=state.num_accepted + jnp.minimum(accepted, taken),
        iteration=state.iteration + 1,
    )
    if draft is not None:
        state = _roll_back_draft(state, rules, proposal, taken, running)
        state = _resize_rounds(state, rules, accepted, proposal.count, running)
    if rules.stopping.max_time is not None:
        late = time_is_up(rules.stopping, state.iteration, jnp.max(state.lengths))
        state = state.replace(finished=state.finished | late)
    return state


def _propose(
    state: AssistState,
    rules: AssistRules,
    running: Array,
    key: Array,
    draft: StepFn | None,
    draft_params: PyTree,
) -> Proposal:
    """Candidates for every running row, from the draft or (``draft`` None) prompt lookup.

    A row proposes at most its ``num_candidates`` and leaves one slot of ``S`` free for the
    target's own token; rows that are done propose none.
    """
    room = call_end(rules, state.tokens) - state.lengths - 1
    limit = jnp.where(running, jnp.minimum(state.num_candidates, room), 0)
    if draft is None:
        return lookup_proposal(state, rules, limit)
    return draft_candidates(state, rules, limit, key, draft, draft_params)


def _verify(
    state: AssistState, rules: AssistRules, proposal: Proposal, target: StepFn, params: PyTree
) -> tuple[Array, Array, KVCache, Array]:
    """Scores the newest token and all ``G`` candidates with the target in one pass of
    ``T = G + 1`` tokens, written at the cache index with their mask slots open.

    Returns:
        (logits float32[B, T, V] raw, scores float32[B, T, V] processed row by row as plain
        decoding would, the target cache after the pass, its mask int32[B, Sc]). Position ``t``
        scores the token that would follow candidate ``t`` (``t = 0``: the newest token).
    """
    batch = state.lengths.shape[0]
    block = rules.num_candidates + 1
    mask = jax.lax.dynamic_update_slice(
        state.cache_mask, jnp.ones((batch, block), jnp.int32), (0, state.cache.index)
    )
    newest = token_at(proposal.tokens, state.lengths - 1)
    feed = jnp.concatenate([newest[:, None], proposal.candidates], axis=1)
    position_ids = clamp_positions(rules, state.positions[:, None] + jnp.arange(block)[None, :])
    logits, cache = target(params, feed, position_ids, state.cache, mask)
    scores = process_block(rules, logits, proposal.tokens, state.lengths)
    return logits, scores, cache, mask


def _accept(
    rules: AssistRules, scores: Array, proposal: Proposal, key: Array
) -> tuple[Array, Array]:
    """(accepted int32[B], next token int32[B]): how many leading candidates each row keeps, and
    the target's token after them. Speculative sampling needs the draft's distribution ``q``,
    which only a draft that samples has; greedy decoding and prompt lookup match tokens."""
    if proposal.probs is not None:
        return _accept_speculative(rules, scores, proposal, key)
    return _accept_matching(rules, scores, proposal, key)


def _accept_speculative(
    rules: AssistRules, scores: Array, proposal: Proposal, key: Array
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
    picked = proposal.candidates[..., None]
    p_x = jnp.take_along_axis(p[:, :width], picked, axis=-1)[..., 0]
    q_x = jnp.take_along_axis(proposal.probs, picked, axis=-1)[..., 0]
    accept_key, next_key = jax.random.split(key)
    u = jax.random.uniform(accept_key, (batch, width))
    proposed = jnp.arange(width)[None, :] < proposal.count[:, None]
    accepted = count_leading(proposed & (u * q_x <= p_x))
    p_a = p[rows, accepted]
    q_a = proposal.probs[rows, jnp.minimum(accepted, width - 1)]
    residual = jnp.maximum(p_a - q_a, 0.0)
    rejected = (accepted < proposal.count) & (jnp.sum(residual, axis=-1) > 0)
    weights = jnp.where(rejected[:, None], residual, p_a)
    token = jax.random.categorical(next_key, jnp.log(weights), axis=-1).astype(jnp.int32)
    return accepted, token


def _accept_matching(
    rules: AssistRules, scores: Array, proposal: Proposal, key: Array
) -> tuple[Array, Array]:
    """Greedy (or prompt-lookup sampling) acceptance: candidates are accepted while they equal
    the target's choice at their position; returns (accepted int32[B], next token int32[B])."""
    chosen = choose(rules, scores, key)  # int32[B, T]
    width = proposal.candidates.shape[1]
    proposed = jnp.arange(width)[None, :] < proposal.count[:, None]
    accepted = count_leading(proposed & (proposal.candidates == chosen[:, :width]))
    return accepted, token_at(chosen, accepted)


def _accepted_block(candidates: Array, accepted: Array, token: Array) -> Array:
    """int32[B, T]: each row's accepted candidates, then the target's token (slots after it
    hold the token again and are never committed)::

        candidates  7 8 9     accepted 2, token 5  ->  7 8 5 5
    """
    offsets = jnp.arange(candidates.shape[1] + 1)[None, :]
    padded = jnp.concatenate([candidates, candidates[:, :1]], axis=1)
    return jnp.where(offsets < accepted[:, None], padded, token[:, None])


# ----------------------------------------------------------------------------- roll-backs


def _roll_back_target(
    state: AssistState,
    rules: AssistRules,
    cache: KVCache,
    mask: Array,
    taken: Array,
    running: Array,
) -> AssistState:
    """Keeps the target's slots of this pass (at ``state.cache.index``) that hold committed
    tokens and makes the rest holes; the index moves past the longest running row's tokens (at
    least one), so the next pass overwrites slots no row kept."""
    index = state.cache.index
    offsets = jnp.arange(rules.num_candidates + 1)[None, :]
    kept = (offsets < taken[:, None]).astype(jnp.int32)
    advance = jnp.maximum(jnp.max(jnp.where(running, taken, 0)), 1)
    return state.replace(
        cache=cache.replace(index=index + advance),
        cache_mask=jax.lax.dynamic_update_slice(mask, kept, (0, index)),
    )


def _roll_back_draft(
    state: AssistState,
    rules: AssistRules,
    proposal: Proposal,
    taken: Array,
    running: Array,
) -> AssistState:
    """Marks the draft's slots ``[x, newest, c_1 .. c_{k-1}]`` of this round: ``x`` as before,
    the newest and the committed candidates kept, the rest holes; advances its index (with one
    row, to just past the kept slots: see :func:`~genjax.decoding._candidates.draft_start`)."""
    width = rules.num_candidates
    index = draft_start(state)
    steps = proposal.draft_steps
    read = jnp.minimum(taken - 1, steps - 1)  # committed candidates the draft has read
    slots = jnp.arange(width + 1)[None, :]
    kept = jnp.where(slots == 0, x_slot_valid(state), (slots - 1 <= read[:, None]))
    kept = kept & (taken[:, None] > 0)
    if taken.shape[0] == 1:
        advance = jnp.maximum(read[0] + 2, 1)
    else:
        advance = jnp.maximum(jnp.max(jnp.where(running, read + 2, 0)), 2)
    return state.replace(
        draft_cache=proposal.draft_cache.replace(index=index + advance),
        draft_mask=jax.lax.dynamic_update_slice(
            proposal.draft_mask, kept.astype(jnp.int32), (0, index)
        ),
        draft_behind=(taken - 1 == steps) & (taken > 0),
    )


def _resize_rounds(
    state: AssistState, rules: AssistRules, accepted: Array, proposed: Array, running: Array
) -> AssistState:
    """The "heuristic" schedules: a running row proposes two more candidates next round after
    one where it accepted all it proposed, one fewer otherwise, within ``[1, G]``."""
    if rules.schedule == "constant":
        return state
    resized = jnp.where(accepted >= proposed, state.num_candidates + 2, state.num_candidates - 1)
    resized = jnp.clip(resized, 1, rules.num_candidates)
    return state.replace(num_candidates=jnp.where(running, resized, state.num_candidates))


# ----------------------------------------------------------------------------- the loop


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
    finished, as plain decoding stops there), steps past a row's end zeroed. With
    ``rules.end`` (``max_cache_len``): the buffer's ``S`` slots, ``pad_token_id`` from the
    call's end on."""
    num_slots = sequence_slots(rules, state.tokens)
    end = jnp.asarray(call_end(rules, state.tokens), jnp.int32)
    if rules.eos_token_ids is None:
        end = jnp.where(jnp.all(state.finished), jnp.max(state.stop_lengths), end)
    slots = jnp.arange(num_slots)[None, :]
    sequences = jnp.where(slots < end, state.tokens[:, :num_slots], rules.pad_token_id)
    steps = jnp.arange(rules.num_new_tokens)[None, :, None]
    num_steps = (jnp.minimum(state.lengths, end) - rules.prompt_length)[:, None, None]

    def cut(buffer):
        if buffer is None:
            return None
        return jnp.where(steps < num_steps, buffer[:, : rules.num_new_tokens], 0.0)

    return sequences, cut(state.scores), cut(state.raw_logits)
