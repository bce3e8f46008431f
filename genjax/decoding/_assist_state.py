"""The rules and state of an assisted call, and the row-wise helpers its loop uses.

See :mod:`genjax.decoding.assisted` for the algorithm. Static or traced: as there; the
:class:`AssistRules` fields marked ``pytree_node=False`` are static, every other field traced.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from genjax.cache import KVCache
from genjax.config import TRACED_FIELDS
from genjax.decoding.sampling import highest, sample
from genjax.processors import LogitsContext, from_config
from genjax.stopping import StoppingRules, finished_rows
from genjax.typing import Array, PyTree

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
    # int32[] (traced): the slot after the call's last new token when the buffer has more slots
    # than the call's P + N (max_cache_len: genjax.cache.slots); None: S (static).
    end: Array | None = None

    @property
    def prompt_length(self) -> Array:
        """int32[]: the prompt bucket length ``P`` (where new tokens start)."""
        return self.context.prompt_end


@struct.dataclass
class AssistState:
    """Everything the assisted loop carries from one iteration to the next.

    ``S = P + N`` is the buffer plain decoding has (with ``max_cache_len``, the slot buffer of
    :mod:`genjax.cache.slots`, the call ending at ``AssistRules.end``); the token buffer holds
    ``T`` slots more, so that a block of candidates can be written past a row's end. ``Sc`` and
    ``Sd`` are the target's and the draft's cache lengths (:func:`cache_lengths`). As everywhere
    in :mod:`genjax.cache`, keys keep the slots last and values keep them before the head dim.
    """

    tokens: Array  # int32[B, S + T]: per row padding, prompt, committed tokens, then pad
    lengths: Array  # int32[B]: filled slots per row; the newest token is not in either cache
    positions: Array  # int32[B]: position id of the newest token
    cache: KVCache  # target: keys L x [B, K, H, Sc], values L x [B, K, Sc, H]; index: next slot
    cache_mask: Array  # int32[B, Sc]: 0 on padding and holes
    draft_cache: KVCache | None  # draft: keys L' x [B, K', H', Sd], values L' x [B, K', Sd, H']
    draft_mask: Array | None  # int32[B, Sd]; both None for prompt lookup
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


def ring_margin(num_candidates: int) -> int:
    """The extra slots ``G + 1`` a sliding-window layer's ring keeps in an assisted call (static).

    A verification pass writes ``G + 1`` slots and the index then moves past the accepted ones
    only, so up to ``G + 1`` slots ahead of the index hold rejected tokens when the next pass
    starts; a ring of ``W + G + 1`` slots keeps them out of every later window and loses no
    slot a later query reads (:mod:`genjax.cache.ring`). The draft model's cache, which rolls
    back fewer slots per round, gets the same margin.

    Example:
        >>> ring_margin(4)
        5
    """
    return num_candidates + 1


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
    prompt_end: Array | None = None,
) -> AssistState:
    """The state after both prefills, before the first token.

    Args:
        prompt: int32[B, P], the (bucket-padded) prompts; with ``prompt_end`` the
            ``max_cache_len`` buffer int32[B, S] (:mod:`genjax.cache.slots`), its new slots
            included.
        cache, cache_mask: the target's prefilled cache (index ``P``) and its mask int32[B, C].
        draft_cache, draft_mask: the draft's, or None for prompt lookup.
        key: the PRNG key of the call.
        rules: the call's :class:`AssistRules`.
        vocab_size: ``V``, for the recorded scores.
        record_scores, record_logits: whether to keep processed scores / raw logits.
        prompt_end: int32[] (traced): the slot of the first new token in the ``max_cache_len``
            buffer ``prompt``; None: ``P`` (static), ``N`` new slots are appended.
    """
    batch, width = prompt.shape
    block = rules.num_candidates + 1
    start, new_slots = (width, rules.num_new_tokens) if prompt_end is None else (prompt_end, 0)
    pad = jnp.full((batch, new_slots + block), rules.pad_token_id, jnp.int32)
    tokens = jnp.concatenate([prompt.astype(jnp.int32), pad], axis=1)
    in_prompt = jnp.arange(width)[None, :] < start
    prompt_tokens = jnp.sum(jnp.where(in_prompt, cache_mask[:, :width], 0), axis=-1)
    recorded = (batch, rules.num_new_tokens + block, vocab_size)
    return AssistState(
        tokens=tokens,
        lengths=jnp.full((batch,), start, jnp.int32),
        positions=prompt_tokens.astype(jnp.int32) - 1,
        cache=cache,
        cache_mask=cache_mask,
        draft_cache=draft_cache,
        draft_mask=draft_mask,
        draft_behind=jnp.zeros((batch,), bool),
        finished=jnp.zeros((batch,), bool),
        stop_lengths=jnp.full((batch,), call_end(rules, tokens), jnp.int32),
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


def sequence_slots(rules: AssistRules, tokens: Array) -> int:
    """``S = P + N`` (static): the slots of plain decoding's buffer, the token buffer int32[B,
    S + T] less the ``T`` spare slots that let a block of candidates run past a row's end."""
    return tokens.shape[1] - rules.num_candidates - 1


def call_end(rules: AssistRules, tokens: Array) -> Array | int:
    """The slot after the call's last new token: ``rules.end`` (traced, ``max_cache_len``),
    else ``S`` (:func:`sequence_slots`, static)."""
    return sequence_slots(rules, tokens) if rules.end is None else rules.end


def _plain_view(row: Array, length: Array, pad: Array, num_slots: int) -> Array:
    """The first ``num_slots`` slots of one row as plain decoding shows them: pad from
    ``length`` on (the slots after it may hold candidates)."""
    row = row[:num_slots]
    return jnp.where(jnp.arange(num_slots) < length, row, pad)


def process_rows(rules: AssistRules, logits: Array, tokens: Array, lengths: Array) -> Array:
    """Processed scores float32[B, V] of the token at slot ``lengths`` (int32[B]) of each row,
    with the row's own config values and length, as plain decoding would process them."""
    batch = logits.shape[0]
    num_slots = sequence_slots(rules, tokens)
    context = rules.context

    leaves, axes, treedef = _split_config(rules.config, batch)

    def process_row(leaves, scores, row, length, first_valid):
        config = jax.tree_util.tree_unflatten(treedef, leaves)
        process = from_config(
            config, rules.eos_token_ids, rules.extra, allowed_tokens_fn=rules.allowed_tokens_fn
        )
        view = _plain_view(row, length, rules.pad_token_id, num_slots)
        ctx = context.replace(tokens=view[None], length=length, first_valid=first_valid[None])
        return process(scores[None].astype(jnp.float32), ctx)[0]

    in_axes = (axes, 0, 0, 0, 0)
    return jax.vmap(process_row, in_axes=in_axes)(
        leaves, logits, tokens, lengths, context.first_valid
    )


def process_block(rules: AssistRules, logits: Array, tokens: Array, lengths: Array) -> Array:
    """float32[B, T, V]: :func:`process_rows` for the ``T`` positions ``lengths[:, None] + t``."""
    starts = lengths[:, None] + jnp.arange(logits.shape[1])[None, :]
    return jax.vmap(
        lambda scores, length: process_rows(rules, scores, tokens, length), in_axes=1, out_axes=1
    )(logits, starts)


def stop_flags(rules: AssistRules, tokens: Array, lengths: Array) -> Array:
    """bool[B, T]: whether a stopping rule finishes row ``b`` once ``lengths[b, t]`` slots are
    filled (the newest token at ``lengths[b, t] - 1``). ``max_time`` is checked separately."""
    stopping = rules.stopping.replace(max_time=None, start_time=None)
    num_slots = sequence_slots(rules, tokens)

    def stops_at(row, length):
        view = _plain_view(row, length, rules.pad_token_id, num_slots)[None]
        step = length - rules.prompt_length - 1
        return finished_rows(stopping, jnp.zeros((1,), bool), view, length, step)[0]

    over_lengths = jax.vmap(stops_at, in_axes=(None, 0))  # one row, its T lengths
    return jax.vmap(over_lengths, in_axes=(0, 0))(tokens, lengths)


# ----------------------------------------------------------------------------- small helpers


def count_leading(flags: Array) -> Array:
    """int32[B]: the number of leading True values of bool[B, G] (how many candidates in a row
    pass a test before the first that fails)."""
    return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=1), axis=1)


def write_block(tokens: Array, start: Array, block: Array, count: Array) -> Array:
    """Writes ``block[b, :count[b]]`` (int32[B, G]) at slots ``start[b]..`` of each row of
    ``tokens`` int32[B, S + T]; returns the new buffer."""
    offset = jnp.arange(tokens.shape[1])[None, :] - start[:, None]
    inside = (offset >= 0) & (offset < count[:, None])
    picked = jnp.take_along_axis(block, jnp.clip(offset, 0, block.shape[1] - 1), axis=1)
    return jnp.where(inside, picked, tokens)


def token_at(tokens: Array, slots: Array) -> Array:
    """int32[B]: ``tokens[b, slots[b]]``."""
    return jnp.take_along_axis(tokens, slots[:, None], axis=1)[:, 0]


def clamp_positions(rules: AssistRules, positions: Array) -> Array:
    """Position ids (int32, any shape) clamped into the model's table: at least 0, below
    ``max_position``. Only slots that are never committed reach past the table."""
    positions = jnp.maximum(positions, 0)
    if rules.max_position is not None:
        positions = jnp.minimum(positions, rules.max_position - 1)
    return positions


def choose(rules: AssistRules, scores: Array, key: Array) -> Array:
    """int32[...]: argmax, or a sample from ``softmax(scores)`` when sampling."""
    if rules.do_sample:
        return sample(key, scores)
    return highest(scores)


def running_rows(state: AssistState, rules: AssistRules) -> Array:
    """bool[B]: rows that still take tokens.

    With EOS ids, a finished row stops (and holds pad). Without them, as in plain decoding, every
    row keeps taking real tokens until all have finished, and then up to the longest finished
    length, where all rows are cut at the end.
    """
    room = state.lengths < call_end(rules, state.tokens)
    if rules.eos_token_ids is not None:
        return room & ~state.finished
    everyone = jnp.all(state.finished)
    return room & (~everyone | (state.lengths < jnp.max(state.stop_lengths)))


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
        >>> from genjax.processors import LogitsContext
        >>> from genjax.stopping import stopping_rules
        >>> eos = jnp.array([0])
        >>> rules = make_rules(config.replace(prompt_lookup_num_tokens=3).with_defaults(),
        ...                    eos_token_ids=eos, pad_token_id=jnp.int32(0),
        ...                    context=LogitsContext.for_prompt(ids, mask),
        ...                    stopping=stopping_rules(eos), num_new_tokens=4, with_draft=False)
        >>> rules.num_candidates
        3
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
