"""The engine's device programs: per step, a prefill program, then a decode program.

One host round trip (:mod:`genjax.serving.engine` describes the state and the inputs) runs two
jitted, pure programs over the donated :class:`~genjax.serving.engine.EngineState`:

* :func:`engine_prefill` applies the host's block tables, releases the rows it stopped, admits
  new requests' settings and runs one prompt chunk of up to ``C_k`` tokens for each of ``P_k``
  slots (one model call of ``P_k`` rows of ``C_k``; skipped with ``lax.cond`` when there is
  none) over the first ``M_p`` blocks of their tables, choosing a slot's first new token after
  its prompt's last chunk: one program per ``(P_k, C_k, M_p)``.
* :func:`engine_decode` decodes the ``B_k`` rows the host names, over the first ``M_s`` blocks
  of their tables, up to ``num_steps`` times: one program per ``(B_k, M_s)`` pair.

Two programs rather than one: the prompt chunk (a model pass over ``C`` positions and a token
choice) is as large to compile as the decode loop, and in one program it was compiled again
for every row bucket and attention span. Split, it compiles once, and each decode program about
half as long. The cost is a second dispatch per step.

:func:`engine_step` is the two in sequence, one pure function (:func:`compile_step` jits it as
one program, for tests and benchmarks that drive a single step).

Static or traced: as :mod:`genjax.serving.engine` lists; the prefill program takes the step
input without ``decode_rows`` and ``decode_tables`` (:func:`prefill_input`), so that its shape
does not depend on the bucket or decode span, and the decode program takes it without the
prompt chunks (:func:`decode_input`), so that its shape depends on neither their count nor
their span.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from genjax.cache import SCRATCH_BLOCK, PagedKVCache
from genjax.constraints import CompressedTable
from genjax.generation.prefill import accepts_logits_to_keep
from genjax.kernels import attention as attention_kernel
from genjax.kernels import cache_writes
from genjax.kernels import rows as rows_kernel
from genjax.models.quantize import LIBRARY_DOT_OPTIONS
from genjax.serving.choosing import Scored, choose_rows, no_scores
from genjax.serving.engine import EngineState, StepInput, StepOutput, state_shardings
from genjax.sharding import Layout
from genjax.typing import Array, PyTree

__all__ = [
    "PrefillOutput",
    "compile_decode",
    "compile_prefill",
    "compile_step",
    "decode_input",
    "with_first",
    "engine_decode",
    "engine_prefill",
    "engine_step",
    "prefill_input",
]


@struct.dataclass
class PrefillOutput:
    """What the prefill program hands the decode program and the host, per lane."""

    first_token: Array  # int32[P_k]: the lane's first new token; -1: none
    first: Scored  # [P_k]: its log-probabilities (see StepOutput)
    ended: Array  # bool[R]: slots whose first token already ends the request (what the decode
    #   program reads: its shapes do not depend on P_k)


def prefill_input(work: StepInput) -> StepInput:
    """``work`` without the decode rows and their tables: the prefill program's input, whose
    shapes are the same for every bucket and decode span."""
    return work.replace(decode_rows=(), decode_tables=())


_CHUNK_FIELDS = (
    "prefill_slot",
    "prefill_start",
    "prefill_tokens",
    "prefill_count",
    "prefill_last",
    "prefill_table",
    "prompt_length",
    "row",
    "admit",
    "constraint_state",
    "history",
)


def decode_input(work: StepInput) -> StepInput:
    """``work`` without the prompt chunks: the decode program's input, whose shapes are the
    same for every count of chunks and their span."""
    return work.replace(**dict.fromkeys(_CHUNK_FIELDS, ()))


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


def _lane_slots(state: EngineState, work: StepInput, lanes: Array) -> Array:
    """int32[P_k]: the slot of each lane in ``lanes`` (bool[P_k]), else ``R``: an index past
    the slots, whose writes ``mode="drop"`` drops."""
    return jnp.where(lanes, work.prefill_slot, state.lengths.shape[0])


def _admit(state: EngineState, work: StepInput) -> EngineState:
    """Writes new requests' settings, and the tokens of their cached prefixes, into their
    slots (on their first chunk)."""
    take = _lane_slots(state, work, work.admit & (work.prefill_slot >= 0))  # [P_k]
    settings = jax.tree.map(
        lambda old, new: old.at[take].set(new, mode="drop"), state.settings, work.row
    )
    before = jnp.arange(work.history.shape[1])[None, :] < work.prefill_start[:, None]
    kept = state.tokens[jnp.minimum(take, state.tokens.shape[0] - 1)]  # [P_k, S]
    history = jnp.where(before, work.history, kept)
    return state.replace(
        settings=settings,
        prompt_lengths=state.prompt_lengths.at[take].set(work.prompt_length, mode="drop"),
        tokens=state.tokens.at[take].set(history, mode="drop"),
        constraint_state=state.constraint_state.at[take].set(work.constraint_state, mode="drop"),
    )


def _diagonal(logits: Array) -> Array:
    """float32[P, V]: row ``p``'s logits at kept position ``p`` of float32[P, P, V]."""
    lanes = jnp.arange(logits.shape[0])
    return logits[lanes, lanes]


def _prefill(model, params, state: EngineState, work: StepInput, pool, top: int):
    """Runs the lanes' chunks (an empty lane's tokens go to the scratch block); returns the
    state, each lane's first new token after a prompt's last chunk (-1 otherwise), whether that
    token already ends the request, and its :class:`Scored` log-probabilities ([P_k])."""
    lanes, chunk = work.prefill_tokens.shape
    real = work.prefill_slot >= 0  # [P_k]
    slots = _lane_slots(state, work, real)  # writes
    rows = jnp.maximum(work.prefill_slot, 0)  # reads
    start, count = work.prefill_start, work.prefill_count
    # Slots past the span are later than the chunk's tokens: causally masked for all of them.
    tables = jnp.where(real[:, None], work.prefill_table, SCRATCH_BLOCK)
    part = state.cache.select_rows(rows).replace(block_tables=tables, index=start)
    positions = start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [P_k, C]
    mask = jnp.ones((lanes, part.length), jnp.int32)
    # Only each lane's last real token's logits are used (after the prompt's last chunk):
    # computing the vocabulary projection of the whole chunk would cost a sixth of SmolLM's
    # prefill. The kept positions are shared by the rows: lane p's is on the diagonal.
    keep = {"logits_to_keep": count - 1} if accepts_logits_to_keep(model) else {}
    logits, part = model.apply(params, work.prefill_tokens, positions, part, mask, **keep)
    cache = state.cache.merge_rows(slots, part.replace(index=start + count))
    width = state.tokens.shape[1]
    columns = jnp.where(jnp.arange(chunk)[None, :] < count[:, None], positions, width)
    tokens = state.tokens.at[slots[:, None], columns].set(work.prefill_tokens, mode="drop")
    length = start + count  # [P_k]
    lengths = state.lengths.at[slots].set(length, mode="drop")
    state = state.replace(cache=cache, tokens=tokens, lengths=lengths)
    ending = real & work.prefill_last

    def first_token(state):
        if keep:
            last = _diagonal(logits)  # [P_k, V]
        else:
            last = jnp.take_along_axis(logits, (count - 1)[:, None, None], axis=1)[:, 0]
        chosen = choose_rows(
            last,
            state.tokens[rows],
            length,
            state.prompt_lengths[rows],
            _rows(state.settings, rows),
            state.constraint_state[rows],
            pool,
            ending,
            top,
        )
        token, done = chosen.token, chosen.done
        target = _lane_slots(state, work, ending)
        state = state.replace(
            tokens=state.tokens.at[target, length].set(token, mode="drop"),
            lengths=state.lengths.at[target].add(1, mode="drop"),
            decoding=state.decoding.at[target].set(~done, mode="drop"),
            constraint_state=state.constraint_state.at[target].set(
                chosen.constraint_state, mode="drop"
            ),
        )
        return state, jnp.where(ending, token, -1), ending & done, chosen.scored

    def not_last(state):
        none = jnp.full((lanes,), -1, jnp.int32)
        return state, none, jnp.zeros((lanes,), bool), no_scores(lanes, top)

    return jax.lax.cond(jnp.any(ending), first_token, not_last, state)


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
        # (PagedKVCache.scatter writes the slots below each row's index). An int8 pool's codes
        # are written as the call goes: rows not decoding write them to the scratch block.
        view = state.cache.replace(index=fed)
        if view.codes is not None:
            tables = jnp.where(live[:, None], view.codes.block_tables, 0)
            view = view.replace(codes=view.codes.replace(block_tables=tables))
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


def engine_prefill(
    model,
    params: PyTree,
    state: EngineState,
    work: StepInput,
    pool: CompressedTable | None = None,
    *,
    max_top_logprobs: int = 0,
    layout: Layout | None = None,
) -> tuple[EngineState, PrefillOutput]:
    """Applies the host's tables and releases, admits, and runs the lanes' prompt chunks.

    Args:
        model: the model (static).
        params: its parameters (traced).
        state: the :class:`~genjax.serving.engine.EngineState` (traced, donated).
        work: the step's :class:`~genjax.serving.engine.StepInput`; its ``decode_rows`` and
            ``decode_tables`` are not read (:func:`prefill_input` drops them); the shape of its
            ``prefill_table`` is the chunk's span ``M_p``.
        pool: the constraint pool (:mod:`genjax.serving.constraint_pool`; traced, not
            donated), or None for an engine without one (static: nothing of it compiles).
        max_top_logprobs: ``L`` (static), the top log-probabilities returned per token.
        layout: the mesh's :class:`~genjax.sharding.Layout` (static), or None on one device:
            the state keeps :func:`~genjax.serving.engine.state_shardings`, the output is
            replicated.

    Returns:
        ``(state, prefilled)``: the new state and a :class:`PrefillOutput`.
    """
    state = _constrain(layout, state)
    state = state.replace(
        cache=state.cache.replace(block_tables=work.block_tables),
        decoding=state.decoding & ~work.release,
    )
    state = _admit(state, work)
    top = max_top_logprobs

    slots, lanes = state.lengths.shape[0], work.prefill_slot.shape[0]

    def with_prefill(state):
        state, first, done, scored = _prefill(model, params, state, work, pool, top)
        ended = jnp.zeros((slots,), bool).at[_lane_slots(state, work, done)].set(True, mode="drop")
        return state, PrefillOutput(first, scored, ended)

    def without(state):
        none = jnp.full((lanes,), -1, jnp.int32)
        return state, PrefillOutput(none, no_scores(lanes, top), jnp.zeros((slots,), bool))

    prefilling = jnp.any(work.prefill_slot >= 0)
    state, prefilled = jax.lax.cond(prefilling, with_prefill, without, state)
    if layout is not None:
        prefilled = jax.lax.with_sharding_constraint(prefilled, layout.sharding())
    return _constrain(layout, state), prefilled


def engine_decode(
    model,
    params: PyTree,
    state: EngineState,
    work: StepInput,
    ended: Array,
    pool: CompressedTable | None = None,
    *,
    max_steps: int,
    max_top_logprobs: int = 0,
    layout: Layout | None = None,
) -> tuple[EngineState, StepOutput]:
    """Up to ``work.num_steps`` decode iterations for the rows ``work.decode_rows``.

    The loop stops after ``work.num_steps`` iterations, when no row decodes, or after an
    iteration in which a row finished (the host can then reuse its slot and blocks); a first
    token that ended its request (``ended``) counts as such a row.

    Args:
        model, params, pool, max_top_logprobs, layout: as :func:`engine_prefill`'s (the decode
            loop's carry keeps the state's shardings too).
        state: the state :func:`engine_prefill` returned (traced, donated).
        work: the step's :class:`~genjax.serving.engine.StepInput` (its prompt-chunk fields
            are not read: :func:`decode_input` drops them).
        ended: bool[R], :attr:`PrefillOutput.ended`.
        max_steps: ``K`` (static), the size of the output buffer; ``work.num_steps <= K``.

    Returns:
        ``(state, output)``: the new state and a :class:`~genjax.serving.engine.StepOutput`
        without the first tokens (``first_token`` and ``first`` None: :func:`with_first`
        adds those of the prefill program).
    """
    top = max_top_logprobs
    slots, rows = state.lengths.shape[0], work.decode_rows
    buffer = jnp.full((max_steps, rows.shape[0]), -1, jnp.int32)
    scores = jax.tree.map(
        lambda x: jnp.zeros((max_steps, *x.shape), x.dtype), no_scores(rows.shape[0], top)
    )
    finished = ended
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

    state = _constrain(layout, state)
    part = _take_rows(state, rows, work.decode_tables)
    paged = part.cache
    in_place = reads_pool_in_place(paged)
    if not in_place:
        # The rows' blocks copied (an int8 pool's dequantized) once for the whole loop, not
        # once per iteration and layer (genjax.cache.gathered).
        part = part.replace(cache=paged.gather())
    start = (jnp.zeros((), jnp.int32), part, buffer, scores, finished[rows])
    steps, part, buffer, scores, done = jax.lax.while_loop(cond, body, start)
    if not in_place:
        part = part.replace(cache=paged.scatter(part.cache, paged.index, max_steps))
    state = _constrain(layout, _put_rows(state, rows, part))
    # Back to one column per slot: the host reads tokens and scores by slot.
    tokens = jnp.full((max_steps, slots), -1, jnp.int32).at[:, rows].set(buffer)
    scores = jax.tree.map(
        lambda x: jnp.zeros((max_steps, slots, *x.shape[2:]), x.dtype).at[:, rows].set(x), scores
    )
    return state, StepOutput(
        tokens=tokens,
        first_token=None,
        finished=finished.at[rows].set(done),
        steps=steps,
        logprobs=scores.logprobs,
        top_ids=scores.top_ids,
        top_logprobs=scores.top_logprobs,
        first=None,
    )


def with_first(output: StepOutput, prefilled: PrefillOutput) -> StepOutput:
    """The decode program's ``output`` with the prefill program's first tokens."""
    return output.replace(first_token=prefilled.first_token, first=prefilled.first)


def reads_pool_in_place(cache) -> bool:
    """Whether the decode loop runs on the paged pool itself (static): a float32 or bfloat16
    pool whose one-token attention genjax's CPU kernel reads in place
    (:mod:`genjax.cache.paged_blocks`), each new slot written into the pool where it lies (a
    bfloat16 pool through :func:`genjax.kernels.cache_writes.write_pages`). Otherwise (an int8
    or float16 pool, off the CPU, on a mesh) the rows' blocks are gathered once per call into
    contiguous slots (:mod:`genjax.cache.gathered`) and the new slots scattered back after the
    loop.

    Why: the gathered copy of every layer (about 260 MB for SmolLM-135M's 8 rows of 44 blocks)
    is a buffer XLA allocates afresh, and the OS maps in afresh, on every call: on the 2-core
    Intel Xeon it cost about 60 ms a call, more than a decode iteration.
    """
    return (
        isinstance(cache, PagedKVCache)
        and not cache.quantized
        and attention_kernel.applies(cache.keys[0], cache.values[0])
        and (jnp.dtype(cache.dtype) == jnp.float32 or cache_writes.applies(cache.keys[0]))
    )


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
    """One host round trip as one pure function: :func:`engine_prefill`, then
    :func:`engine_decode` (arguments as theirs).

    Example:
        >>> step = compile_step(model, max_steps=4)  # doctest: +SKIP
        >>> state, out = step(params, state, work, pool)  # doctest: +SKIP
    """
    sizes = dict(max_top_logprobs=max_top_logprobs, layout=layout)
    state, prefilled = engine_prefill(model, params, state, work, pool, **sizes)
    state, output = engine_decode(
        model, params, state, work, prefilled.ended, pool, max_steps=max_steps, **sizes
    )
    return state, with_first(output, prefilled)


def _jit(function, library_dots: bool, layout: Layout | None):
    """``function`` jitted with its state (argument 1) donated, compiled with
    :data:`~genjax.models.quantize.LIBRARY_DOT_OPTIONS` when ``library_dots`` (int8 params
    multiplying several rows: :func:`~genjax.models.quantize.library_dots`), and traced with
    XLA's products rather than the CPU kernel on a mesh (see :mod:`genjax.kernels.rows`)."""

    @functools.wraps(function)
    def traced(*args, **kwargs):
        with rows_kernel.disabled(layout is not None):
            return function(*args, **kwargs)

    options = LIBRARY_DOT_OPTIONS if library_dots else None
    return jax.jit(traced, donate_argnums=1, compiler_options=options)


@functools.cache
def compile_prefill(
    model, max_top_logprobs: int = 0, library_dots: bool = False, layout: Layout | None = None
):
    """The jitted :func:`engine_prefill` (sizes static, the state donated):
    ``prefill(params, state, prefill_input(work), pool=None) -> (state, prefilled)``. With a
    ``layout`` the program takes the params and the state as they are placed on its mesh."""

    def prefill(params, state, work, pool=None):
        sizes = dict(max_top_logprobs=max_top_logprobs, layout=layout)
        return engine_prefill(model, params, state, work, pool, **sizes)

    return _jit(prefill, library_dots, layout)


@functools.cache
def compile_decode(
    model,
    max_steps: int,
    max_top_logprobs: int = 0,
    library_dots: bool = False,
    layout: Layout | None = None,
):
    """The jitted :func:`engine_decode` (sizes static, the state donated):
    ``decode(params, state, decode_input(work), prefilled.ended, pool=None) -> (state,
    output)``."""

    def decode(params, state, work, ended, pool=None):
        sizes = dict(max_steps=max_steps, max_top_logprobs=max_top_logprobs, layout=layout)
        return engine_decode(model, params, state, work, ended, pool, **sizes)

    return _jit(decode, library_dots, layout)


@functools.cache
def compile_step(
    model,
    max_steps: int,
    max_top_logprobs: int = 0,
    library_dots: bool = False,
    layout: Layout | None = None,
):
    """The jitted :func:`engine_step` as one program (sizes static, the state donated):
    ``step(params, state, work, pool=None) -> (state, output)``."""

    def step(params, state, work, pool=None):
        sizes = dict(max_steps=max_steps, max_top_logprobs=max_top_logprobs, layout=layout)
        return engine_step(model, params, state, work, pool, **sizes)

    return _jit(step, library_dots, layout)
