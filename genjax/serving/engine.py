"""The device side of continuous batching: the engine's state, its sizes and a step's inputs.

The engine holds ``R`` slots (rows). A slot is free, prefilling (its prompt goes through the
model ``C`` tokens per step) or decoding (one token per step). One step
(:func:`genjax.serving.step.engine_step`, run as a prefill program and a decode program over
the donated state):

1. applies the host's block tables and releases the rows the host stopped (cancelled, a stop
   string, preempted);
2. runs one prompt chunk of ``C`` tokens for each of up to ``P`` slots (chunked prefill; one
   model call of ``P_k`` rows, ``P_k`` the smallest of the powers of two below ``P``
   (``max_prefill_requests``) and ``P`` holding them; skipped with ``lax.cond`` when there is none);
   after a prompt's last chunk it chooses the slot's first new token and the slot starts
   decoding. A prompt whose first blocks are shared from the prefix cache starts its chunks
   after them (their tokens come in ``StepInput.history``). The chunks attend over the first
   ``M_p`` blocks of their slots' tables, the shortest of the same spans that holds their
   tokens (a 64-token chunk of SmolLM-135M over 256 slots rather than 768 took 98 against
   125 ms on the 2-core Intel Xeon), in lanes of ``C_k`` tokens, the shortest of
   :attr:`EngineShape.chunks` holding every lane's chunk (a prompt's last chunk is often much
   shorter than ``C``): one compiled prefill program per ``(P_k, C_k, M_p)``;
3. decodes one token for every decoding slot, up to ``num_steps`` times in a
   ``lax.while_loop`` that ends early when a row finishes (a scheduling event). Only the slots
   the host names in ``StepInput.decode_rows`` go through the model (``B = B_k``, ``T = 1``):
   they are gathered before the loop and written back after it, so a step with two requests
   in flight multiplies two rows of activations, not ``R``. Their blocks are copied into logical
   order (an int8 pool's dequantized) once for the loop (:class:`~genjax.cache.GatheredKVCache`),
   and only the slots decoded go back into the pool. ``B_k`` is one of a few bucket
   sizes (:func:`decode_buckets`), and the loop attends over the first ``M_s`` blocks of the
   rows' tables, the shortest of a few spans that holds every decoding row's blocks
   (:func:`~genjax.serving.config.attention_spans`): one compiled decode program per pair.

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
    decoded ``B_k`` and their attention span ``M_s`` blocks (one program per pair), the prompt
    chunks' count ``P_k``, length ``C_k`` and span ``M_p`` blocks (one prefill program per
    triple), the pool
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

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from genjax.cache import PagedKVCache
from genjax.serving.choosing import RowSettings, Scored
from genjax.sharding import Layout, layout_for
from genjax.typing import Array

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
    prefill_lanes: int = 1  # P: the most prompts prefilled in one step, a chunk of C each
    chunk_sizes: tuple[int, ...] = ()  # shorter chunk lengths below C for prompts' last
    #   chunks (see `chunks`)

    @property
    def spans(self) -> tuple[int, ...]:
        """The block counts ``M_s`` the decode loop may attend over, one program each,
        ascending, the last ``max_blocks_per_row``: a step whose decoding rows hold at most
        ``M_s`` blocks reads only those (:func:`~genjax.serving.config.attention_spans`)."""
        return tuple(sorted({*self.span_blocks, self.max_blocks_per_row}))

    @property
    def chunks(self) -> tuple[int, ...]:
        """The chunk lengths ``C_k`` a prefill program runs, ascending, the last ``C``: a step
        runs its lanes' chunks in the shortest that holds each lane's (every chunk but a
        prompt's last has ``C`` tokens), so a prompt's last few tokens do not pay for ``C``
        rows of products."""
        return tuple(sorted({*self.chunk_sizes, self.chunk}))

    def prefill_spans(self, chunk: int | None = None) -> tuple[int, ...]:
        """The block counts ``M_p`` a prompt chunk of ``chunk`` tokens (None: ``C``) may attend
        over, one prefill program each: the :attr:`spans` that hold the whole chunk (its tokens
        all go through the model, the padding too), and ``max_blocks_per_row``."""
        chunk = self.chunk if chunk is None else chunk
        fits = (s for s in self.spans if s * self.block_size >= chunk)
        return tuple(sorted({*fits, self.max_blocks_per_row}))

    @property
    def prefill_programs(self) -> tuple[tuple[int, int, int], ...]:
        """Every ``(P_k, C_k, M_p)``: the compiled prefill programs."""
        return tuple(
            (lanes, chunk, span)
            for lanes in self.lane_buckets
            for chunk in self.chunks
            for span in self.prefill_spans(chunk)
        )

    @property
    def lane_buckets(self) -> tuple[int, ...]:
        """The prompt counts ``P_k`` a prefill program runs (one program per count and span):
        the powers of two below ``prefill_lanes``, then ``prefill_lanes``
        (:func:`decode_buckets`)."""
        return decode_buckets(self.prefill_lanes)

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
    # The prompt chunks: one lane per prefilling request, P_k lanes (EngineShape.lane_buckets).
    prefill_slot: Array  # int32[P_k]: the slot whose prompt chunk each lane runs; -1: none
    prefill_start: Array  # int32[P_k]: the chunk's first position
    prefill_tokens: Array  # int32[P_k, C_k]: the chunk (tokens past prefill_count are ignored;
    #   C_k from EngineShape.chunks, the shortest holding every lane's count)
    prefill_count: Array  # int32[P_k]: real tokens in the chunk, 1..C_k
    prefill_last: Array  # bool[P_k]: the chunk ends the prompt: choose the first new token
    prefill_table: Array  # int32[P_k, M_p]: the lanes' block tables cut to the span their
    #   chunks attend over (M_p from EngineShape.prefill_spans: every chunk's tokens fit)
    prompt_length: Array  # int32[P_k]: the request's own prompt length (for a recomputed
    #   one, shorter than the tokens prefilled)
    row: RowSettings  # [P_k]: the prefilling requests' settings, written on their first chunk
    admit: Array  # bool[P_k]: first chunk of a request: write `row`, `prompt_length`,
    #   `history`, `constraint_state`
    constraint_state: Array  # int32[P_k]: on admission, the automaton state (-1: none)
    history: Array  # int32[P_k, S]: on admission, the tokens before `prefill_start` (a cached
    #   prefix, whose blocks are shared and not prefilled again); later tokens are ignored
    decode_rows: Array  # int32[B_k]: distinct slots, every decoding one (the prefilled slot
    #   too when its chunk is the last); the others fill the bucket and decode nothing
    decode_tables: Array  # int32[B_k, M_s]: those rows' block tables cut to the span the decode
    #   loop attends over (M_s from EngineShape.spans: every decoding row's blocks fit)


@struct.dataclass
class StepOutput:
    """What one step returns to the host."""

    tokens: Array  # int32[K, R]: the token each decode iteration chose per row; -1: none
    first_token: Array  # int32[P_k]: each lane's first new token; -1: none
    finished: Array  # bool[R]: rows that hit EOS or max_new_tokens during this step
    steps: Array  # int32[]: decode iterations run
    # Log-probabilities, meaningful for rows with settings.logprobs >= 0 (else 0):
    logprobs: Array  # float32[K, R]: of each token in `tokens`
    top_ids: Array  # int32[K, R, L]: the L most likely tokens, most likely first
    top_logprobs: Array  # float32[K, R, L]: their log-probabilities
    first: Scored  # [P_k]: the first tokens', as above


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
    return tree.replace(cache=_cache_shardings(layout, state.cache, tree.cache))


def _cache_shardings(layout: Layout, cache, tree):
    """``tree`` (``cache``'s leaves, replicated) with the keys, values and scales split over
    KV heads; for a gathered view of an int8 pool, its pool too."""
    pool = layout.sharding(None, "kv_heads", None, None)
    scales = layout.sharding(None, "kv_heads", None)
    split = {"keys": tuple(pool for _ in cache.keys), "values": tuple(pool for _ in cache.values)}
    if isinstance(cache, PagedKVCache):
        split["key_scales"] = tuple(scales for _ in cache.key_scales)
        split["value_scales"] = tuple(scales for _ in cache.value_scales)
    elif cache.codes is not None:
        split["codes"] = _cache_shardings(layout, cache.codes, tree.codes)
    return tree.replace(**split)


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
