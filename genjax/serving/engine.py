"""The device side of continuous batching: one pure jitted step over a donated engine state.

The engine holds ``R`` slots (rows). A slot is free, prefilling (its prompt goes through the
model ``C`` tokens per step) or decoding (one token per step). One call of :func:`engine_step`:

1. applies the host's block tables and releases the rows the host stopped (cancelled, a stop
   string, preempted);
2. runs one prompt chunk of ``C`` tokens for one slot (chunked prefill; skipped with
   ``lax.cond`` when there is none); after the prompt's last chunk it chooses the slot's first
   new token and the slot starts decoding. A prompt whose first blocks are shared from the
   prefix cache starts its chunks after them (their tokens come in ``StepInput.history``);
3. decodes one token for every decoding slot, up to ``num_steps`` times in a
   ``lax.while_loop`` that ends early when a row finishes (a scheduling event). Only the slots
   the host names in ``StepInput.decode_rows`` go through the model (``B = B_k``, ``T = 1``):
   they are gathered before the loop and written back after it, so a step with two requests
   in flight multiplies two rows of activations, not ``R``. Their blocks of a float pool are
   copied into logical order once for the loop (:class:`~genjax.cache.GatheredKVCache`),
   and only the slots decoded go back into the pool after it. ``B_k`` is one of a few bucket
   sizes (:func:`decode_buckets`), and the loop attends over the first ``M_s`` blocks of the
   rows' tables, the shortest of a few spans that holds every decoding row's blocks
   (:func:`~genjax.serving.config.attention_spans`): one compiled program per pair.

So a long prompt never stalls the decoding rows: each step decodes while it prefills a chunk.

The pool holds the model's dtype, or with ``kv_cache_dtype="int8"`` int8 codes and one scale per
head vector (:mod:`genjax.cache.paged`): each model call then attends to its own tokens' exact
keys and values (a prompt chunk's, a decoded token's) and to the dequantized earlier ones, as
``genjax.generate`` with ``cache_implementation="quantized"`` and ``prefill_chunk_size=C``.
The host (:mod:`genjax.serving.scheduler`) owns the block tables and chooses what each step does
through a small :class:`StepInput`.

Every request's tokens sit in its slot's history ``tokens[r, :lengths[r]]`` (prompt, then new
tokens) so that history-dependent processors (the repetition penalty) see whole sequences. A
decoding row's newest token is in the history but not yet in the cache::

    history   p0 p1 p2 p3 g0 g1          lengths = 6, prompt_lengths = 4
    cache     p0 p1 p2 p3 g0             index = 5; the next step feeds g1 at position 5

Token choice (:mod:`genjax.serving.choosing`): per row, in transformers' order, the same
processors and warpers as ``genjax.generate``, greedy or sampled with ``fold_in(key,
new_token_index)`` (a preempted and recomputed request draws the same tokens), and raw
log-probabilities for the rows that ask.

Structured output (:mod:`genjax.serving.constraint_pool`): the step takes the engine's pool of
token automata as a separate argument (traced, not donated, fixed shapes), and each row carries
its automaton state in ``EngineState.constraint_state`` (-1: unconstrained), gathered with the
other per-row state for the decode loop. A request's first chunk writes its starting state
(``StepInput.constraint_state``: the automaton's initial state, or, for a recomputed request,
the state after the tokens it already generated); every token choice masks the constrained rows
before the processors and advances their states, under a ``lax.cond`` that costs an unconstrained
step one ``any`` reduction.

Static or traced:
    Static (the shape of a compiled program): the model, ``R`` (``max_batch_size``), the rows
    decoded ``B_k`` and their attention span ``M_s`` blocks (one program per pair), the pool
    (``num_blocks``, ``block_size``, ``max_blocks_per_row``, and ``kv_cache_dtype``: the
    model's dtype or int8 codes with scales), the chunk ``C``, the most decode steps per call
    ``K``, the most EOS ids per request ``E``, the most biased tokens per request ``L_b`` and
    the longest biased prefix ``W``, the most top log-probabilities ``L``, and the constraint
    pool's sizes (``S_p`` states, ``E_p`` transitions; none when ``S_p`` is 0), and on a
    mesh its :class:`~genjax.sharding.Layout` (the pool split over KV heads on ``model``, the
    rest of the state replicated: :func:`state_shardings`). Traced:
    everything in :class:`EngineState` and :class:`StepInput`: the requests' tokens, lengths,
    sampling values (``do_sample`` included), seeds, EOS ids, biased ids and biases,
    penalties, how many top log-probabilities a row wants, limits, which slot prefills and
    which slots decode, the number of steps, the rows' automaton states and the constraint
    pool's contents.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from genjax.cache import PagedKVCache
from genjax.constraints import CompressedTable
from genjax.generation.prefill import accepts_logits_to_keep
from genjax.models.quantize import LIBRARY_DOT_OPTIONS
from genjax.serving.choosing import RowSettings, Scored, choose_rows, no_scores
from genjax.sharding import Layout, layout_for
from genjax.typing import Array, PyTree

__all__ = [
    "EngineShape",
    "EngineState",
    "RowSettings",
    "Scored",
    "StepInput",
    "StepOutput",
    "decode_buckets",
    "engine_layout",
    "state_shardings",
]


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """The static sizes of the engine (hashable: part of the compiled program)."""

    max_batch_size: int  # R: slots decoded together
    num_blocks: int  # blocks in the pool, the scratch block 0 included
    block_size: int  # slots per block
    max_blocks_per_row: int  # the longest request, in blocks
    chunk: int  # C: prompt tokens prefilled per step
    max_steps: int  # K: the most decode steps per call
    max_eos: int  # E: the most EOS ids per request
    max_bias: int = 0  # L_b: the most biased tokens (logit_bias) per request
    max_bias_prefix: int = 0  # W: the longest biased sequence's prefix (its length - 1)
    max_ngram: int = 0  # N: the largest no_repeat_ngram_size of a request
    max_top_logprobs: int = 0  # L: the most top log-probabilities per token
    constraint_states: int = 0  # S_p: states in the constraint pool (0: no pool)
    constraint_edges: int = 0  # E_p: transitions in the constraint pool
    kv_cache_dtype: str = "auto"  # the pool: "auto" (the model's dtype) or "int8" (codes+scales)
    span_blocks: tuple[int, ...] = ()  # the decode loop's attention spans, in blocks (empty:
    #   the whole table only); see `spans`

    @property
    def spans(self) -> tuple[int, ...]:
        """The block counts ``M_s`` the decode loop may attend over, one program each,
        ascending, the last ``max_blocks_per_row``: a step whose decoding rows hold at most
        ``M_s`` blocks reads only those (:func:`~genjax.serving.config.attention_spans`)."""
        return tuple(sorted({*self.span_blocks, self.max_blocks_per_row}))

    @property
    def programs(self) -> tuple[tuple[int, int], ...]:
        """Every ``(B_k, M_s)`` pair: the compiled step programs."""
        return tuple((rows, span) for rows in self.buckets for span in self.spans)

    @property
    def quantized(self) -> bool:
        """Whether the pool holds int8 codes with scales (``kv_cache_dtype="int8"``)."""
        return self.kv_cache_dtype == "int8"

    @property
    def max_length(self) -> int:
        """``S``: the most tokens (prompt plus new) of one request."""
        return self.max_blocks_per_row * self.block_size

    @property
    def buckets(self) -> tuple[int, ...]:
        """The decoded-row counts ``B_k`` with a program of their own (:func:`decode_buckets`)."""
        return decode_buckets(self.max_batch_size)


def decode_buckets(max_batch_size: int) -> tuple[int, ...]:
    """The powers of two below ``max_batch_size``, then ``max_batch_size``: the row counts a
    step may decode. A step decodes the smallest bucket holding its decoding slots, so its cost
    follows the requests in flight (at most twice them) while only ``log2(R) + 1`` programs are
    compiled.

    Example:
        >>> decode_buckets(12)
        (1, 2, 4, 8, 12)
    """
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return (*sizes, max_batch_size)


@struct.dataclass
class EngineState:
    """Everything the device keeps between steps (donated to each step)."""

    cache: PagedKVCache  # pools; block_tables int32[R, M]; index int32[R] = slots written
    tokens: Array  # int32[R, S]: per slot, the prompt then the new tokens
    lengths: Array  # int32[R]: tokens in `tokens` per slot
    prompt_lengths: Array  # int32[R]: the request's own prompt (new tokens are counted after it)
    decoding: Array  # bool[R]: the slot has a token to feed and decodes each step
    constraint_state: Array  # int32[R]: the row's state in the constraint pool; -1: none
    settings: RowSettings  # [R] per-request values


@struct.dataclass
class StepInput:
    """What the host asks of one step (small; not donated)."""

    block_tables: Array  # int32[R, M]: the host's block tables (0: scratch)
    release: Array  # bool[R]: rows to stop decoding before anything else
    num_steps: Array  # int32[]: decode iterations to run, 1..K
    prefill_slot: Array  # int32[]: the slot whose prompt chunk runs; -1: none
    prefill_start: Array  # int32[]: the chunk's first position
    prefill_tokens: Array  # int32[C]: the chunk (tokens past prefill_count are ignored)
    prefill_count: Array  # int32[]: real tokens in the chunk, 1..C
    prefill_last: Array  # bool[]: the chunk ends the prompt: choose the first new token
    prompt_length: Array  # int32[]: the request's own prompt length (for a recomputed one,
    #   shorter than the tokens prefilled)
    row: RowSettings  # [1]: the prefilling request's settings, written on its first chunk
    admit: Array  # bool[]: first chunk of a request: write `row`, `prompt_length`, `history`,
    #   `constraint_state`
    constraint_state: Array  # int32[]: on admission, the request's automaton state (-1: none)
    history: Array  # int32[S]: on admission, the tokens before `prefill_start` (a cached
    #   prefix, whose blocks are shared and not prefilled again); later tokens are ignored
    decode_rows: Array  # int32[B_k]: distinct slots, every decoding one (the prefilled slot
    #   too when its chunk is the last); the others fill the bucket and decode nothing
    decode_tables: Array  # int32[B_k, M_s]: those rows' block tables cut to the span the decode
    #   loop attends over (M_s from EngineShape.spans: every decoding row's blocks fit)


@struct.dataclass
class StepOutput:
    """What one step returns to the host."""

    tokens: Array  # int32[K, R]: the token each decode iteration chose per row; -1: none
    first_token: Array  # int32[]: the prefilled slot's first new token; -1: none
    finished: Array  # bool[R]: rows that hit EOS or max_new_tokens during this step
    steps: Array  # int32[]: decode iterations run
    # Log-probabilities, meaningful for rows with settings.logprobs >= 0 (else 0):
    logprobs: Array  # float32[K, R]: of each token in `tokens`
    top_ids: Array  # int32[K, R, L]: the L most likely tokens, most likely first
    top_logprobs: Array  # float32[K, R, L]: their log-probabilities
    first: Scored  # [1]: the first token's, as above


def init_state(model, shape: EngineShape, dtype=None, layout: Layout | None = None) -> EngineState:
    """An empty engine state: every slot free, a zero pool; the pool's float dtype is ``dtype``
    or the model's, int8 codes with scales in that dtype when ``shape.quantized``.

    Without ``layout`` the state goes to the default device. With one (a mesh), each device
    receives its part directly (:func:`state_shardings`: the pool split over KV heads), so no
    device ever holds the whole pool.
    """

    def empty_cache():
        return PagedKVCache.create(
            num_layers=model.num_layers,
            num_blocks=shape.num_blocks,
            block_size=shape.block_size,
            max_blocks_per_row=shape.max_blocks_per_row,
            batch=shape.max_batch_size,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=model.dtype if dtype is None else jnp.dtype(dtype),
            quantized=shape.quantized,
        )

    rows = shape.max_batch_size
    state = EngineState(
        cache=None,
        tokens=np.zeros((rows, shape.max_length), np.int32),
        lengths=np.zeros((rows,), np.int32),
        prompt_lengths=np.zeros((rows,), np.int32),
        decoding=np.zeros((rows,), bool),
        constraint_state=np.full((rows,), -1, np.int32),
        settings=RowSettings.empty(rows, shape),
    )
    if layout is None:
        return jax.device_put(state.replace(cache=empty_cache()))
    shardings = state_shardings(layout, state.replace(cache=jax.eval_shape(empty_cache)))
    cache = jax.jit(empty_cache, out_shardings=shardings.cache)()
    return jax.device_put(state, shardings.replace(cache=None)).replace(cache=cache)


def state_shardings(layout: Layout, state: EngineState) -> EngineState:
    """The sharding of every leaf of an engine state on ``layout``'s mesh.

    The pool's keys float[num_blocks, K, H, block_size] and values float[num_blocks, K,
    block_size, H] (and an int8 pool's scales float[num_blocks, K, block_size]) have ``K`` on
    the ``kv_heads`` rule's axis (``model``; replicated when :func:`~genjax.sharding.layout_for`
    fell back because ``K`` does not divide it), as ``genjax.generate`` splits its KV cache
    (so do the decode loop's gathered blocks, :class:`~genjax.cache.GatheredKVCache`, whose
    ``K`` is axis 1 too); every other leaf (tables, histories, per-row settings) is replicated:
    the engine's rows are not split over ``data``.

    Example:
        >>> shardings = state_shardings(layout, state)  # doctest: +SKIP
        >>> shardings.cache.keys[0].spec  # doctest: +SKIP
        PartitionSpec(None, 'model', None, None)
    """
    replicated = layout.sharding()
    tree = jax.tree.map(lambda _: replicated, state)
    pool = layout.sharding(None, "kv_heads", None, None)
    scales = layout.sharding(None, "kv_heads", None)
    cache = state.cache
    split = {"keys": tuple(pool for _ in cache.keys), "values": tuple(pool for _ in cache.values)}
    if isinstance(cache, PagedKVCache):
        split["key_scales"] = tuple(scales for _ in cache.key_scales)
        split["value_scales"] = tuple(scales for _ in cache.value_scales)
    return tree.replace(cache=tree.cache.replace(**split))


def engine_layout(model, mesh) -> Layout | None:
    """The :class:`~genjax.sharding.Layout` the engine runs with on ``mesh`` (None: one device),
    checked as ``genjax.generate(..., mesh=)`` checks it (:func:`~genjax.sharding.layout_for`).

    Raises:
        TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
        ShardingError: the query heads do not divide over ``model`` (naming both sizes). KV
            heads that do not divide fall back as in ``generate``: the pool is replicated.
    """
    if mesh is None:
        return None
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh (e.g. genjax.sharding.make_mesh((1, 4))), got "
            f"{type(mesh).__name__}. Pass None to run the engine on one device."
        )
    return layout_for(model, mesh)


def _constrain(layout: Layout | None, state: EngineState) -> EngineState:
    """Inside the step: keeps the state on :func:`state_shardings` (no-op without a mesh)."""
    if layout is None:
        return state
    shardings = state_shardings(layout, state)
    return jax.tree.map(jax.lax.with_sharding_constraint, state, shardings)


def _rows(tree: PyTree, rows: Array) -> PyTree:
    return jax.tree.map(lambda x: x[rows], tree)


def _take_rows(state: EngineState, rows: Array, tables: Array) -> EngineState:
    """The state of slots ``rows`` alone: the pools whole, the per-row arrays gathered, the
    block tables ``tables`` (int32[B_k, M_s], the rows' own cut to the span)."""
    cache = state.cache.select_rows(rows).replace(block_tables=tables)
    per_row = state.replace(cache=None)
    return _rows(per_row, rows).replace(cache=cache)


def _put_rows(state: EngineState, rows: Array, part: EngineState) -> EngineState:
    """Writes ``part`` (made by :func:`_take_rows`) back into slots ``rows``."""
    cache = state.cache.merge_rows(rows, part.cache)
    per_row = _set_rows(state.replace(cache=None), rows, part.replace(cache=None))
    return per_row.replace(cache=cache)


def _set_rows(tree: PyTree, rows: Array, values: PyTree) -> PyTree:
    return jax.tree.map(lambda x, v: x.at[rows].set(v), tree, values)


def _admit(state: EngineState, work: StepInput) -> EngineState:
    """Writes a new request's settings, and the tokens of its cached prefix, into its slot (on
    its first chunk)."""
    slot = jnp.maximum(work.prefill_slot, 0)[None]
    take = work.admit & (work.prefill_slot >= 0)
    settings = _set_rows(
        state.settings,
        slot,
        jax.tree.map(
            lambda new, old: jnp.where(take, new, old), work.row, _rows(state.settings, slot)
        ),
    )
    prompt = jnp.where(take, work.prompt_length, state.prompt_lengths[slot])
    before = jnp.arange(work.history.shape[0]) < work.prefill_start
    history = jnp.where(take & before, work.history, state.tokens[slot[0]])
    automaton = jnp.where(take, work.constraint_state, state.constraint_state[slot])
    return state.replace(
        settings=settings,
        prompt_lengths=state.prompt_lengths.at[slot].set(prompt),
        tokens=state.tokens.at[slot[0]].set(history),
        constraint_state=state.constraint_state.at[slot].set(automaton),
    )


def _prefill(model, params, state: EngineState, work: StepInput, pool, top: int):
    """Runs the chunk of ``work.prefill_slot``; returns the state, the first new token after a
    prompt's last chunk (-1 otherwise), whether that token already ends the request, and its
    :class:`Scored` log-probabilities ([1])."""
    chunk = work.prefill_tokens.shape[0]
    slot = work.prefill_slot[None]  # [1]
    start, count = work.prefill_start, work.prefill_count
    part = state.cache.select_rows(slot).replace(index=start[None])
    positions = (start + jnp.arange(chunk, dtype=jnp.int32))[None]  # [1, C]
    mask = jnp.ones((1, part.length), jnp.int32)
    # Only the last real token's logits are used (after the prompt's last chunk): computing
    # the vocabulary projection of the whole chunk would cost a sixth of SmolLM's prefill.
    keep = {"logits_to_keep": (count - 1)[None]} if accepts_logits_to_keep(model) else {}
    logits, part = model.apply(params, work.prefill_tokens[None], positions, part, mask, **keep)
    cache = state.cache.merge_rows(slot, part.replace(index=(start + count)[None]))
    columns = jnp.where(jnp.arange(chunk) < count, positions[0], state.tokens.shape[1])
    tokens = state.tokens.at[slot[0], columns].set(work.prefill_tokens, mode="drop")
    length = start + count
    state = state.replace(cache=cache, tokens=tokens, lengths=state.lengths.at[slot].set(length))

    def first_token(state):
        if keep:
            last = logits[0]  # [1, V]
        else:
            last = jax.lax.dynamic_index_in_dim(logits[0], count - 1, keepdims=True)
        chosen = choose_rows(
            last,
            state.tokens[slot],
            length[None],
            state.prompt_lengths[slot],
            _rows(state.settings, slot),
            state.constraint_state[slot],
            pool,
            jnp.ones((1,), bool),
            top,
        )
        token, done = chosen.token, chosen.done
        state = state.replace(
            tokens=state.tokens.at[slot, length].set(token, mode="drop"),
            lengths=state.lengths.at[slot].add(1),
            decoding=state.decoding.at[slot].set(~done),
            constraint_state=state.constraint_state.at[slot].set(chosen.constraint_state),
        )
        return state, token[0], done[0], chosen.scored

    def not_last(state):
        return state, jnp.full((), -1, jnp.int32), jnp.zeros((), bool), no_scores(1, top)

    return jax.lax.cond(work.prefill_last, first_token, not_last, state)


def _decode_once(model, params, state: EngineState, pool, top: int):
    """One token for every decoding row; returns the state, int32[R] tokens (-1 for rows not
    decoding), bool[R] rows that finished and the tokens' :class:`Scored` ([R])."""
    live = state.decoding
    rows = jnp.arange(state.lengths.shape[0])
    fed = jnp.maximum(state.lengths - 1, 0)  # position of the token fed
    if isinstance(state.cache, PagedKVCache):
        # Rows not decoding write to the scratch block and read nothing that matters.
        tables = jnp.where(live[:, None], state.cache.block_tables, 0)
        view = state.cache.replace(block_tables=tables, index=fed)
    else:
        # Gathered: every row writes its own copy; only live rows' slots go back to the pool
        # (PagedKVCache.scatter writes the slots below each row's index).
        view = state.cache.replace(index=fed)
    mask = jnp.ones((live.shape[0], view.length), jnp.int32)
    logits, view = model.apply(params, state.tokens[rows, fed][:, None], fed[:, None], view, mask)
    cache = state.cache.with_pools(view).replace(index=jnp.where(live, fed + 1, state.cache.index))
    chosen = choose_rows(
        logits[:, 0],
        state.tokens,
        state.lengths,
        state.prompt_lengths,
        state.settings,
        state.constraint_state,
        pool,
        live,
        top,
    )
    token, done = chosen.token, chosen.done
    columns = jnp.where(live, state.lengths, state.tokens.shape[1])
    state = state.replace(
        cache=cache,
        tokens=state.tokens.at[rows, columns].set(token, mode="drop"),
        lengths=state.lengths + live,
        decoding=live & ~done,
        constraint_state=chosen.constraint_state,
    )
    return state, jnp.where(live, token, -1), done, chosen.scored


def engine_step(
    model,
    params: PyTree,
    state: EngineState,
    work: StepInput,
    pool: CompressedTable | None = None,
    *,
    max_steps: int,
    max_top_logprobs: int = 0,
    layout: Layout | None = None,
) -> tuple[EngineState, StepOutput]:
    """One host round trip: releases, one prefill chunk, then up to ``num_steps`` decode steps.

    Pure; :func:`compile_step` jits it with ``model`` and ``max_steps`` static and ``state``
    donated. The decode loop stops after ``work.num_steps`` iterations, when no row decodes, or
    after an iteration in which a row finished (the host can then reuse its slot and blocks).

    Args:
        model: the model (static).
        params: its parameters (traced).
        state: the :class:`EngineState` (traced, donated).
        work: the :class:`StepInput` (traced).
        pool: the constraint pool (:mod:`genjax.serving.constraint_pool`; traced, not
            donated), or None for an engine without one (static: nothing of it compiles).
        max_steps: ``K`` (static), the size of the output buffer; ``work.num_steps <= K``.
        max_top_logprobs: ``L`` (static), the top log-probabilities returned per token.
        layout: the mesh's :class:`~genjax.sharding.Layout` (static), or None on one device:
            the state, the decode loop's carry and the returned state keep
            :func:`state_shardings` (the pool split over KV heads), so a step returns its state
            as it took it and the next step's program accepts it.

    Returns:
        ``(state, output)``: the new state and a :class:`StepOutput`.

    Example:
        >>> step = compile_step(model, max_steps=4)  # doctest: +SKIP
        >>> state, out = step(params, state, work, pool)  # doctest: +SKIP
    """
    state = _constrain(layout, state)
    state = state.replace(
        cache=state.cache.replace(block_tables=work.block_tables),
        decoding=state.decoding & ~work.release,
    )
    state = _admit(state, work)

    top = max_top_logprobs

    def with_prefill(state):
        return _prefill(model, params, state, work, pool, top)

    def without(state):
        return state, jnp.full((), -1, jnp.int32), jnp.zeros((), bool), no_scores(1, top)

    state, first, first_done, first_scored = jax.lax.cond(
        work.prefill_slot >= 0, with_prefill, without, state
    )
    slots, rows = state.lengths.shape[0], work.decode_rows
    buffer = jnp.full((max_steps, rows.shape[0]), -1, jnp.int32)
    scores = jax.tree.map(
        lambda x: jnp.zeros((max_steps, *x.shape), x.dtype), no_scores(rows.shape[0], top)
    )
    finished = jnp.zeros((slots,), bool).at[jnp.maximum(work.prefill_slot, 0)].set(first_done)
    limit = jnp.minimum(work.num_steps, max_steps)

    def cond(carry):
        i, state, _, _, finished = carry
        return (i < limit) & jnp.any(state.decoding) & ~(jnp.any(finished) & (i > 0))

    def body(carry):
        i, state, buffer, scores, finished = carry
        state, tokens, done, scored = _decode_once(model, params, state, pool, top)
        state = _constrain(layout, state)
        scores = jax.tree.map(lambda all_, new: all_.at[i].set(new), scores, scored)
        return i + 1, state, buffer.at[i].set(tokens), scores, finished | done

    part = _take_rows(state, rows, work.decode_tables)
    paged = part.cache
    if not paged.quantized:
        # The rows' blocks copied once for the whole loop, not once per iteration and layer
        # (genjax.cache.gathered); an int8 pool keeps reading its blocks dequantized.
        part = part.replace(cache=paged.gather())
    start = (jnp.zeros((), jnp.int32), part, buffer, scores, finished[rows])
    steps, part, buffer, scores, done = jax.lax.while_loop(cond, body, start)
    if not paged.quantized:
        part = part.replace(cache=paged.scatter(part.cache, paged.index, max_steps))
    state = _constrain(layout, _put_rows(state, rows, part))
    # Back to one column per slot: the host reads tokens and scores by slot.
    tokens = jnp.full((max_steps, slots), -1, jnp.int32).at[:, rows].set(buffer)
    scores = jax.tree.map(
        lambda x: jnp.zeros((max_steps, slots, *x.shape[2:]), x.dtype).at[:, rows].set(x), scores
    )
    return state, StepOutput(
        tokens=tokens,
        first_token=first,
        finished=finished.at[rows].set(done),
        steps=steps,
        logprobs=scores.logprobs,
        top_ids=scores.top_ids,
        top_logprobs=scores.top_logprobs,
        first=first_scored,
    )


@functools.cache
def compile_step(
    model,
    max_steps: int,
    max_top_logprobs: int = 0,
    library_dots: bool = False,
    layout: Layout | None = None,
):
    """The jitted :func:`engine_step` for ``model`` with ``K = max_steps``, ``L =
    max_top_logprobs`` and ``layout`` (all static), the state donated: ``step(params, state,
    work, pool=None) -> (state, output)``; compiled with
    :data:`~genjax.models.quantize.LIBRARY_DOT_OPTIONS` when ``library_dots`` (int8 params:
    :func:`~genjax.models.quantize.library_dots`). With a ``layout`` the program takes the
    params and the state as they are placed on its mesh (the other arguments replicated)."""

    def step(params, state, work, pool=None):
        return engine_step(
            model,
            params,
            state,
            work,
            pool,
            max_steps=max_steps,
            max_top_logprobs=max_top_logprobs,
            layout=layout,
        )

    options = LIBRARY_DOT_OPTIONS if library_dots else None
    return jax.jit(step, donate_argnums=1, compiler_options=options)
