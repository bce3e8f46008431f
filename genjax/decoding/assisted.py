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

References:
    Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative Decoding",
    arXiv:2211.17192. Chen et al. 2023, "Accelerating Large Language Model Decoding with
    Speculative Sampling", arXiv:2302.01318. Saxena 2023, "Prompt Lookup Decoding",
    github.com/apoorvumang/prompt-lookup-decoding. Hugging Face transformers' assisted
    generation (``generation/candidate_generator.py``, ``_assisted_decoding``,
    ``_speculative_sampling``, ``ConfidenceCriteria``) defines the semantics matched here.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from genjax.cache import KVCache
from genjax.config import TRACED_FIELDS
from genjax.errors import InputError, UnsupportedError
from genjax.processors import LogitsContext, from_config
from genjax.stopping import StoppingRules, finished_rows, is_eos, time_is_up
from genjax.typing import Array, PyTree

StepFn = Callable[[PyTree, Array, Array, KVCache, Array], tuple[Array, KVCache]]

SCHEDULES = ("constant", "heuristic", "heuristic_transient")

# Config fields that may hold one value per row ([B]); sliced row by row for the processors.
# The traced fields, less the token ids (an EOS list int32[E] is not per row, even when E == B)
# and the fields used outside the processors.
_PER_ROW_FIELDS = frozenset(TRACED_FIELDS) - {
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "assistant_confidence_threshold",
    "max_time",
}


@struct.dataclass
class AssistRules:
    """How candidates are made, scored and committed: fixed for a whole call."""

    config: PyTree  # the resolved GenerationConfig (its traced fields are leaves)
    eos_token_ids: Array | None  # int32[E], or None
    pad_token_id: Array  # int32[]
    context: LogitsContext  # prompt bookkeeping: offset, prompt_end, first_valid int32[B]
    stopping: StoppingRules  # EOS ids, criteria, stop strings, max_time
    threshold: Array  # float32[]: assistant_confidence_threshold; 0 never stops the draft
    num_new_tokens: int = struct.field(pytree_node=False)  # N
    num_candidates: int = struct.field(pytree_node=False)  # G: candidates per iteration, at most
    schedule: str = struct.field(pytree_node=False)  # "constant", "heuristic", ...
    lookup_ngram: int | None = struct.field(pytree_node=False)  # prompt lookup; None: a draft
    do_sample: bool = struct.field(pytree_node=False)
    extra: tuple = struct.field(pytree_node=False, default=())  # the user's processors
    allowed_tokens_fn: Callable | None = struct.field(pytree_node=False, default=None)
    max_position: int | None = struct.field(pytree_node=False, default=None)  # position clamp

    @property
    def prompt_length(self) -> Array:
        """int32[]: the prompt bucket length ``P`` (where new tokens start)."""
        return self.context.prompt_end


@struct.dataclass
class AssistState:
    """Everything the assisted loop carries from one iteration to the next."""

    tokens: Array  # int32[B, S + T]: per row padding, prompt, committed tokens, then pad
    lengths: Array  # int32[B]: filled slots per row; the newest token is not in either cache
    positions: Array  # int32[B]: position id of the newest token
    cache: KVCache  # target keys/values [L, B, C, K, H]; index = next slot to write
    cache_mask: Array  # int32[B, C]: 0 on padding and holes
    draft_cache: KVCache | None  # draft keys/values [L', B, D, K', H'], or None (prompt lookup)
    draft_mask: Array | None  # int32[B, D]
    draft_behind: Array  # bool[B]: the token before the newest is missing from the draft cache
    finished: Array  # bool[B]: rows a stopping rule has finished
    stop_lengths: Array  # int32[B]: the length at which a row finished (S when it has not)
    num_candidates: Array  # int32[B]: this row's candidates per iteration (heuristic schedule)
    num_accepted: Array  # int32[B]: committed candidate tokens so far
    iteration: Array  # int32[]
    key: Array  # key[]
    scores: Array | None  # float32[B, N + T, V] processed scores, when recorded
    raw_logits: Array | None  # float32[B, N + T, V] raw logits, when recorded


def cache_lengths(prompt_length: int, num_new_tokens: int, batch: int, num_candidates: int):
    """The (target, draft) cache lengths a call needs; see the module docstring.

    Example:
        >>> cache_lengths(16, 32, batch=1, num_candidates=4)
        (52, 83)
    """
    block = num_candidates + 1
    rows = min(batch, block)
    loops = max(num_new_tokens - 1, 0)
    target = prompt_length + rows * loops + block
    return target, target + loops


def init_state(
    prompt: Array,
    cache: KVCache,
    cache_mask: Array,
    draft_cache: KVCache | None,
    draft_mask: Array | None,
    key: Array,
    rules: AssistRules,
    *,
    vocab_size: int,
    record_scores: bool,
    record_logits: bool,
) -> AssistState:
    """The state after both prefills, before the first token.

    Args:
        prompt: int32[B, P], the (bucket-padded) prompts.
        cache, cache_mask: the target's prefilled cache (index ``P``) and its mask int32[B, C].
        draft_cache, draft_mask: the draft's, or None for prompt lookup.
        key: the PRNG key of the call.
        rules: the call's :class:`AssistRules`.
        vocab_size: ``V``, for the recorded scores.
        record_scores, record_logits: whether to keep processed scores / raw logits.
    """
    batch, prompt_length = prompt.shape
    block = rules.num_candidates + 1
    size = prompt_length + rules.num_new_tokens
    pad = jnp.full((batch, rules.num_new_tokens + block), rules.pad_token_id, jnp.int32)
    recorded = (batch, rules.num_new_tokens + block, vocab_size)
    return AssistState(
        tokens=jnp.concatenate([prompt.astype(jnp.int32), pad], axis=1),
        lengths=jnp.full((batch,), prompt_length, jnp.int32),
        positions=jnp.sum(cache_mask[:, :prompt_length], axis=-1).astype(jnp.int32) - 1,
        cache=cache,
        cache_mask=cache_mask,
        draft_cache=draft_cache,
        draft_mask=draft_mask,
        draft_behind=jnp.zeros((batch,), bool),
        finished=jnp.zeros((batch,), bool),
        stop_lengths=jnp.full((batch,), size, jnp.int32),
        num_candidates=jnp.full((batch,), rules.num_candidates, jnp.int32),
        num_accepted=jnp.zeros((batch,), jnp.int32),
        iteration=jnp.zeros((), jnp.int32),
        key=key,
        scores=jnp.zeros(recorded) if record_scores else None,
        raw_logits=jnp.zeros(recorded) if record_logits else None,
    )


# ----------------------------------------------------------------------------- row-wise rules


def _split_config(config: PyTree, batch: int) -> tuple[list, list, PyTree]:
    """(leaves, vmap axes, treedef) of the config: axis 0 on per-row values of shape [B]."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(config)
    leaves, axes = [], []
    for path, leaf in with_paths:
        name = getattr(path[-1], "name", None) if path else None
        per_row = name in _PER_ROW_FIELDS and jnp.ndim(leaf) == 1 and jnp.shape(leaf)[0] == batch
        leaves.append(leaf)
        axes.append(0 if per_row else None)
    return leaves, axes, treedef


def _view(row: Array, length: Array, pad: Array, size: int) -> Array:
    """The first ``size`` slots of one row as plain decoding shows them: pad from ``length``."""
    row = row[:size]
    return jnp.where(jnp.arange(size) < length, row, pad)


def _process(rules: AssistRules, logits: Array, tokens: Array, lengths: Array) -> Array:
    """Processed scores float32[B, V] of the token at slot ``lengths`` (int32[B]) of each row,
    with the row's own config values and length, as plain decoding would process them."""
    batch = logits.shape[0]
    size = tokens.shape[1] - rules.num_candidates - 1  # S = P + N, the buffer plain decoding has
    context = rules.context

    leaves, axes, treedef = _split_config(rules.config, batch)

    def one(leaves, scores, row, length, first_valid):
        config = jax.tree_util.tree_unflatten(treedef, leaves)
        process = from_config(
            config, rules.eos_token_ids, rules.extra, allowed_tokens_fn=rules.allowed_tokens_fn
        )
        view = _view(row, length, rules.pad_token_id, size)
        ctx = context.replace(tokens=view[None], length=length, first_valid=first_valid[None])
        return process(scores[None].astype(jnp.float32), ctx)[0]

    in_axes = (axes, 0, 0, 0, 0)
    return jax.vmap(one, in_axes=in_axes)(leaves, logits, tokens, lengths, context.first_valid)


def _process_block(rules: AssistRules, logits: Array, tokens: Array, lengths: Array) -> Array:
    """float32[B, T, V]: :func:`_process` for the ``T`` positions ``lengths[:, None] + t``."""
    starts = lengths[:, None] + jnp.arange(logits.shape[1])[None, :]
    return jax.vmap(
        lambda scores, length: _process(rules, scores, tokens, length), in_axes=1, out_axes=1
    )(logits, starts)


def _stops(rules: AssistRules, tokens: Array, lengths: Array) -> Array:
    """bool[B, T]: whether a stopping rule finishes row ``b`` once ``lengths[b, t]`` slots are
    filled (the newest token at ``lengths[b, t] - 1``). ``max_time`` is checked separately."""
    stopping = rules.stopping.replace(max_time=None, start_time=None)
    size = tokens.shape[1] - rules.num_candidates - 1

    def one(row, length):
        view = _view(row, length, rules.pad_token_id, size)[None]
        step = length - rules.prompt_length - 1
        return finished_rows(stopping, jnp.zeros((1,), bool), view, length, step)[0]

    per_row = jax.vmap(one, in_axes=(None, 0))  # over T
    return jax.vmap(per_row, in_axes=(0, 0))(tokens, lengths)


# ----------------------------------------------------------------------------- small helpers


def _leading(flags: Array) -> Array:
    """int32[B]: the number of leading True values of bool[B, G]."""
    return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=1), axis=1)


def _write(tokens: Array, start: Array, block: Array, count: Array) -> Array:
    """Writes ``block[b, :count[b]]`` (int32[B, G]) at slots ``start[b]..`` of each row."""
    offset = jnp.arange(tokens.shape[1])[None, :] - start[:, None]
    inside = (offset >= 0) & (offset < count[:, None])
    picked = jnp.take_along_axis(block, jnp.clip(offset, 0, block.shape[1] - 1), axis=1)
    return jnp.where(inside, picked, tokens)


def _at(tokens: Array, slots: Array) -> Array:
    """int32[B]: ``tokens[b, slots[b]]``."""
    return jnp.take_along_axis(tokens, slots[:, None], axis=1)[:, 0]


def _positions(rules: AssistRules, positions: Array) -> Array:
    """Position ids, clamped into the model's table (only never-committed slots reach it)."""
    positions = jnp.maximum(positions, 0)
    if rules.max_position is not None:
        positions = jnp.minimum(positions, rules.max_position - 1)
    return positions


def _choose(rules: AssistRules, scores: Array, key: Array) -> Array:
    """int32[...]: argmax, or a sample from ``softmax(scores)`` when sampling."""
    if rules.do_sample:
        return jax.random.categorical(key, scores, axis=-1).astype(jnp.int32)
    return jnp.argmax(scores, axis=-1).astype(jnp.int32)


def _running(state: AssistState, rules: AssistRules) -> Array:
    """bool[B]: rows that still take tokens.

    With EOS ids, a finished row stops (and holds pad). Without them, as in plain decoding, every
    row keeps taking real tokens until all have finished, and then up to the longest finished
    length, where all rows are cut at the end.
    """
    size = state.tokens.shape[1] - rules.num_candidates - 1
    room = state.lengths < size
    if rules.eos_token_ids is not None:
        return room & ~state.finished
    everyone = jnp.all(state.finished)
    return room & (~everyone | (state.lengths < jnp.max(state.stop_lengths)))


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
    running = _running(state, rules)
    count = jnp.where(running, jnp.minimum(count, size - state.lengths), 0)
    tokens = _write(state.tokens, state.lengths, block, count)
    ends = state.lengths[:, None] + 1 + jnp.arange(width)[None, :]  # int32[B, T]
    stops = _stops(rules, tokens, ends) & (jnp.arange(width)[None, :] < count[:, None])
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
    scores = _process(rules, logits, state.tokens, state.lengths)
    key = jax.random.fold_in(state.key, 0)
    token = _choose(rules, scores, key)
    state, _ = commit(
        state, rules, token[:, None], jnp.ones_like(token), scores[:, None], logits[:, None]
    )
    return state


# ----------------------------------------------------------------------------- candidates


def _lookup(state: AssistState, rules: AssistRules, limit: Array) -> tuple[Array, Array]:
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
class _Draft:
    """The draft loop's carry."""

    steps: Array  # int32[]: candidates drawn so far (k)
    logits: Array  # float32[B, V]: the draft's logits for the next candidate
    cache: KVCache
    tokens: Array  # int32[B, S + T]: the buffer with the candidates so far written in
    candidates: Array  # int32[B, G]
    count: Array  # int32[B]: candidates proposed per row
    active: Array  # bool[B]: rows still proposing
    probs: Array | None  # float32[B, G, V]: the draft's distribution q of each candidate


def _draft(
    state: AssistState,
    rules: AssistRules,
    limit: Array,
    key: Array,
    draft: StepFn,
    params: PyTree,
) -> tuple[_Draft, Array]:
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
            _at(state.tokens, jnp.maximum(state.lengths - 2, 0)),
            _at(state.tokens, state.lengths - 1),
        ],
        axis=1,
    )
    where = _positions(rules, state.positions[:, None] + jnp.arange(-1, 1)[None, :])
    logits, cache = draft(params, pair, where, state.draft_cache, mask)
    vocab = logits.shape[-1]
    carry = _Draft(
        steps=jnp.zeros((), jnp.int32),
        logits=logits[:, -1],
        cache=cache,
        tokens=state.tokens,
        candidates=jnp.zeros((batch, width), jnp.int32),
        count=jnp.zeros((batch,), jnp.int32),
        active=limit >= 1,
        probs=jnp.zeros((batch, width, vocab)) if rules.do_sample else None,
    )

    def propose(carry: _Draft) -> _Draft:
        step = carry.steps
        slot = state.lengths + step
        scores = _process(rules, carry.logits, carry.tokens, slot)
        token = _choose(rules, scores, jax.random.fold_in(key, step))
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
            tokens=_write(carry.tokens, slot, token[:, None], one),
            candidates=carry.candidates.at[:, step].set(token),
            count=carry.count + carry.active.astype(jnp.int32),
            active=keep,
            probs=None if carry.probs is None else carry.probs.at[:, step].set(probs),
        )

    def body(carry: _Draft) -> _Draft:
        last = carry.candidates[:, carry.steps - 1]
        where = _positions(rules, state.positions + carry.steps)
        logits, cache = draft(params, last[:, None], where[:, None], carry.cache, mask)
        return propose(carry.replace(logits=logits[:, -1], cache=cache))

    def cond(carry: _Draft) -> Array:
        return (carry.steps < width) & jnp.any(carry.active)

    carry = jax.lax.while_loop(cond, body, propose(carry))
    return carry, mask


# ----------------------------------------------------------------------------- verification


def _speculative(
    rules: AssistRules, scores: Array, draft: _Draft, key: Array
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
    accepted = _leading(proposed & (u * q_x <= p_x))
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
    chosen = _choose(rules, scores, key)  # int32[B, T]
    width = candidates.shape[1]
    proposed = jnp.arange(width)[None, :] < count[:, None]
    accepted = _leading(proposed & (candidates == chosen[:, :width]))
    return accepted, _at(chosen, accepted)


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
    running = _running(state, rules)
    limit = jnp.where(running, jnp.minimum(state.num_candidates, size - state.lengths - 1), 0)
    if draft is None:
        candidates, count = _lookup(state, rules, limit)
        tokens = _write(state.tokens, state.lengths, candidates, count)
        proposal = None
    else:
        proposal, draft_mask = _draft(state, rules, limit, draft_key, draft, draft_params)
        candidates, count, tokens = proposal.candidates, proposal.count, proposal.tokens

    # Verify: the newest token and all candidates in one pass of T = G + 1 tokens.
    index = state.cache.index
    mask = jax.lax.dynamic_update_slice(
        state.cache_mask, jnp.ones((batch, block), jnp.int32), (0, index)
    )
    feed = jnp.concatenate([_at(tokens, state.lengths - 1)[:, None], candidates], axis=1)
    where = _positions(rules, state.positions[:, None] + jnp.arange(block)[None, :])
    logits, cache = target(params, feed, where, state.cache, mask)
    scores = _process_block(rules, logits, tokens, state.lengths)
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
    proposal: _Draft,
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
        return jnp.any(_running(state, rules)) & room

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


# ----------------------------------------------------------------------------- setup and checks


def is_assisted(config, assistant_model=None) -> bool:
    """Whether a call runs assisted generation: an assistant model, or prompt lookup."""
    return assistant_model is not None or config.prompt_lookup_num_tokens is not None


def check_config(config, assistant_model=None) -> None:
    """Raises UnsupportedError for config options assisted generation cannot run with.

    Args:
        config: the resolved :class:`~genjax.GenerationConfig` of an assisted call.
        assistant_model: the draft model, or None for prompt lookup.

    Raises:
        UnsupportedError: beam search (as transformers), ``num_return_sequences > 1`` (as
            transformers), ``assistant_early_exit`` or ``use_mtp``.
        InputError: both a draft and ``prompt_lookup_num_tokens``.

    Example:
        >>> check_config(GenerationConfig(prompt_lookup_num_tokens=4).with_defaults())
    """
    what = "prompt lookup" if assistant_model is None else "assisted generation"
    if config.num_beams > 1:
        raise UnsupportedError(
            f"{what} cannot be combined with beam search (num_beams={config.num_beams}), as in "
            f"transformers. Set num_beams=1, or drop the assistant / prompt_lookup_num_tokens."
        )
    if config.num_return_sequences > 1:
        raise UnsupportedError(
            f"{what} returns one sequence per prompt, as in transformers; got "
            f"num_return_sequences={config.num_return_sequences}. Repeat the prompts instead."
        )
    for name in ("assistant_early_exit", "use_mtp"):
        if getattr(config, name):
            raise UnsupportedError(
                f"generation option `{name}={getattr(config, name)!r}` is not supported by "
                f"genjax yet. Pass a draft model as assistant_model= instead."
            )
    if assistant_model is not None and config.prompt_lookup_num_tokens is not None:
        raise InputError(
            f"got both assistant_model= and prompt_lookup_num_tokens="
            f"{config.prompt_lookup_num_tokens}; candidates come from one source. Drop one."
        )


def check_call(config, model, assistant_model, assistant_params, batch: int) -> None:
    """Raises a clear error for an assisted call genjax cannot run, before anything is traced:
    :func:`check_config`, then the checks that need the models.

    Args:
        config: the resolved :class:`~genjax.GenerationConfig`.
        model: the target model; assistant_model, assistant_params: the draft and its params
            (None for prompt lookup).
        batch: ``B``.

    Raises:
        UnsupportedError: see :func:`check_config`; a sliding-window target with ``B > 1``.
        InputError: a draft without params, or whose vocabulary differs from the target's.

    Example:
        >>> check_call(config, model, draft, draft_params, batch=4)
    """
    check_config(config, assistant_model)
    if assistant_model is None:
        return
    if assistant_params is None:
        raise InputError("assistant_model= needs its parameters: pass assistant_params= too.")
    if assistant_model.vocab_size != model.vocab_size:
        raise InputError(
            f"the assistant's vocabulary has {assistant_model.vocab_size} tokens but the "
            f"target's has {model.vocab_size}; speculative decoding needs the same tokenizer "
            f"and vocabulary (universal assisted generation is not supported). Use a draft "
            f"trained with the target's tokenizer."
        )
    windows = getattr(getattr(model, "config", None), "sliding_windows", ()) or ()
    if batch > 1 and any(w is not None for w in windows):
        raise UnsupportedError(
            f"assisted generation with a sliding-window target ({sorted(set(windows) - {None})}) "
            f"needs batch size 1: with more rows the cache holds holes, which a window counted "
            f"in cache slots would see. Run one prompt at a time."
        )


def make_rules(
    config,
    *,
    eos_token_ids: Array | None,
    pad_token_id: Array,
    context: LogitsContext,
    stopping: StoppingRules,
    num_new_tokens: int,
    with_draft: bool,
    extra: tuple = (),
    allowed_tokens_fn: Callable | None = None,
    max_position: int | None = None,
) -> AssistRules:
    """The :class:`AssistRules` of a call, from its resolved config.

    ``G`` is ``num_assistant_tokens`` with a draft and ``prompt_lookup_num_tokens`` without;
    the n-gram size is ``max_matching_ngram_size`` (2 when unset, as in transformers).

    Example:
        >>> rules = make_rules(config, eos_token_ids=eos, pad_token_id=pad, context=ctx,
        ...                    stopping=stopping, num_new_tokens=32, with_draft=True)
    """
    width = config.num_assistant_tokens if with_draft else config.prompt_lookup_num_tokens
    threshold = config.assistant_confidence_threshold if with_draft else None
    return AssistRules(
        config=config,
        eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id,
        context=context,
        stopping=stopping,
        threshold=jnp.asarray(0.0 if threshold is None else threshold, jnp.float32),
        num_new_tokens=num_new_tokens,
        num_candidates=int(width),
        schedule=config.num_assistant_tokens_schedule or "constant",
        lookup_ngram=None if with_draft else int(config.max_matching_ngram_size or 2),
        do_sample=bool(config.do_sample),
        extra=tuple(extra),
        allowed_tokens_fn=allowed_tokens_fn,
        max_position=max_position,
    )
