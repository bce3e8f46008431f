"""Greedy and multinomial sampling in one ``lax.while_loop``.

The loop knows nothing about models: it takes a step function

    step(params, tokens int32[B, T], positions int32[B, T], cache, attention_mask int32[B, S])
        -> (logits float32[B, T, V], cache)

and a :class:`DecodeState` holding everything that changes from step to step. Greedy decoding
is sampling whose token choice is ``argmax``. A step function may return a third value, a pytree
of arrays it computed besides the logits (a model's hidden states or attention weights): when
``DecodeState.step_outputs`` holds buffers for them (:func:`step_output_buffers`), the loop
writes each model call's values there.

Each iteration feeds the last chosen token to the model, processes the next-token logits,
chooses a token, writes it into the buffer, then applies the stopping rules
(:mod:`genjax.stopping`: EOS, custom criteria, stop strings, ``max_time``) to the buffer, as
transformers applies its ``StoppingCriteriaList`` after appending each token. The loop ends when
every row is finished or the buffer is full. The first token is chosen from the prefill logits
before the loop, so the loop makes exactly one model call per token and never a wasted one.

Finished rows receive ``pad_token_id`` from then on when EOS ids are set; as in transformers,
without EOS ids a row finished by another rule keeps receiving real tokens until the loop ends.

Static or traced:
    Static: the buffer length ``S`` (so the most new tokens; ``DecodeRules.end`` can stop the
    loop earlier, traced), the processors in the chain,
    whether tokens are sampled, which outputs are recorded, which stopping rules are present
    (custom criteria, stop-string table shapes, the ``max_time`` clock), the ``on_token`` hook
    (streaming; see :mod:`genjax.streaming`), whether a token automaton constrains the output
    and its table's format and shapes (:mod:`genjax.decoding.automaton`), whether a
    classifier-free guidance branch runs (:mod:`genjax.decoding.guidance`).
    Traced: the PRNG key, the processor settings, the pad and EOS ids, the stop-string tables,
    ``max_time``, the automaton's tables, and all state.

Randomness: the token at new-token index ``i`` is drawn with ``fold_in(key, i)``, so the same key
gives the same tokens however the loop is driven (jitted or not, streamed or not).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.extend.random import threefry2x32_p

from genjax.cache import KVCache
from genjax.decoding.automaton import TokenAutomaton, advance_rows, mask_scores
from genjax.decoding.guidance import GuidanceState, guide
from genjax.decoding.guidance import advance as advance_guidance
from genjax.processors import LogitsContext, Processor
from genjax.processors.base import NEG_INF
from genjax.processors.warpers import PREFIX
from genjax.stopping import StoppingRules, finished_rows, should_continue, start_timer
from genjax.typing import Array, PyTree

StepFn = Callable[[PyTree, Array, Array, KVCache, Array], tuple[Array, KVCache]]
TokenChooser = Callable[[Array, Array], Array]
TokenHook = Callable[[Array, Array], None]  # (tokens int32[B], active bool[B]) -> None


@struct.dataclass
class DecodeState:
    """Everything the decoding loop carries from one token to the next."""

    tokens: Array  # int32[B, S]: padding, prompt, then generated tokens
    length: Array  # int32[]: slots of `tokens` filled so far
    positions: Array  # int32[B]: position id of the next token fed to the model
    cache: KVCache  # L x keys float[B, K, H, S], values [B, K, S, H]; index = slots seen
    attention_mask: Array  # int32[B, S]: 1 where a slot holds a real token (new slots are 1)
    finished: Array  # bool[B]: rows a stopping rule has finished
    key: Array  # key[]: the PRNG key of the whole call
    scores: Array | None  # float32[B, N, V]: processed scores, when recorded
    raw_logits: Array | None  # float32[B, N, V]: raw logits, when recorded
    # int32[B]: each row's token-automaton state (structured output), when rules.automaton is set
    automaton_state: Array | None = None
    # The classifier-free guidance branch (genjax.decoding.guidance), when guidance_scale is set
    guidance: GuidanceState | None = None
    # The step function's extra outputs of each model call in the loop, when recorded: a pytree
    # whose leaves are [N - 1, ...] (call i feeds new token i and computes the logits of token
    # i + 1; token 0 comes from the prefill); None: the step function returns two values.
    step_outputs: PyTree | None = None


@struct.dataclass
class DecodeRules:
    """How tokens are chosen and when rows finish: fixed for a whole call."""

    process: Processor = struct.field(pytree_node=False)  # the logits processor chain
    choose: TokenChooser = struct.field(pytree_node=False)  # (scores[B, V], key) -> int32[B]
    context: LogitsContext  # prompt bookkeeping; tokens and length are replaced each step
    pad_token_id: Array  # int32[]: written into rows that have finished (when EOS ids are set)
    stopping: StoppingRules  # EOS ids, custom criteria, stop strings, max_time
    # Called with each new token and the rows still running when it was chosen (e.g. an ordered
    # host callback that streams it); None compiles no call at all.
    on_token: TokenHook | None = struct.field(pytree_node=False, default=None)
    # Applied to the loop carry before the loop and after every step, e.g.
    # genjax.sharding.Layout.constrain, so a sharded carry keeps its shardings; None: nothing.
    constrain: Callable[[DecodeState], DecodeState] | None = struct.field(
        pytree_node=False, default=None
    )
    # int32[] (traced): the loop stops once `length` reaches it, so the number of new tokens
    # can change without compiling (genjax.cache.slots); None: at the end of the buffer.
    end: Array | None = None
    # Structured output (genjax.decoding.automaton): masks the logits before the processors and
    # advances `DecodeState.automaton_state`; its tables are traced. None: no constraint.
    automaton: TokenAutomaton | None = None

    @property
    def eos_token_ids(self) -> Array | None:
        """int32[E], or None when no EOS id is set."""
        return self.stopping.eos_token_ids


def greedy_chooser() -> TokenChooser:
    """Chooses the highest score (the first one on ties, as ``torch.argmax``)."""
    return lambda scores, key: highest(scores)


def highest(scores: Array) -> Array:
    """int32[...]: ``jnp.argmax(scores, axis=-1)`` for float scores [..., V]: the first index of
    the largest score, or of the first NaN where a row holds one (as ``torch.argmax``).

    Computed as the maximum, then the smallest index that holds it: XLA:CPU runs argmax's
    reduction over (value, index) pairs about 3x slower than these two plain reductions (at
    SmolLM's vocabulary of 49152 and batch 32 on the 2-core Intel Xeon, 5.6 against 1.9 ms).
    """
    top = jnp.max(scores, axis=-1, keepdims=True)  # NaN where the row holds one
    hits = jnp.where(jnp.isnan(top), jnp.isnan(scores), scores == top)
    index = jax.lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1)
    return jnp.min(jnp.where(hits, index, scores.shape[-1]), axis=-1)


def sampling_chooser() -> TokenChooser:
    """Draws a token from ``softmax(scores)`` for each row (see :func:`sample`)."""
    return lambda scores, key: sample(key, scores)


def sample(key: Array, scores: Array) -> Array:
    """int32[...]: one draw from ``softmax(scores)`` over the last axis of float32[..., V].

    Drawing Gumbel noise for every token of a large vocabulary is the costly part of sampling on
    a CPU. After top-k, top-p or another truncation most scores are -inf, and those tokens have
    probability 0: when every row keeps at most ``PREFIX`` (256) tokens, the draw is the
    Gumbel-max trick over the row's ``PREFIX`` largest scores only, which hold all of its kept
    tokens, so the distribution is exactly the same. Otherwise (no truncation, or a wider one) a
    ``lax.cond`` draws over the whole vocabulary by inverting the cumulative distribution with
    one uniform number per row (:func:`_inverse_cdf`): no noise per token, less than half the
    time of Gumbel-max over a large vocabulary on CPU. Both paths read the same uniform
    numbers, drawn once per step. The same key gives the same tokens on both paths only in
    distribution, not draw for draw; it always gives the same tokens for the same scores.
    """
    vocab = scores.shape[-1]
    if vocab <= PREFIX:
        return jax.random.categorical(key, scores, axis=-1).astype(jnp.int32)
    rows = scores.reshape(-1, vocab)  # float32[R, V]
    kept = jnp.sum(rows > NEG_INF, axis=-1)  # int32[R]
    tiny = jnp.finfo(jnp.float32).tiny
    uniforms = jax.random.uniform(key, (rows.shape[0], PREFIX), minval=tiny)  # (0, 1)[R, PREFIX]

    def over_prefix(rows: Array) -> Array:
        values, indices = jax.lax.top_k(rows, PREFIX)  # [R, PREFIX], descending
        picked = jnp.argmax(values - jnp.log(-jnp.log(uniforms)), axis=-1)  # Gumbel-max
        return jnp.take_along_axis(indices, picked[:, None], axis=-1)[:, 0]

    def over_vocabulary(rows: Array) -> Array:
        return _inverse_cdf(rows, uniforms[:, 0])

    tokens = jax.lax.cond(jnp.all(kept <= PREFIX), over_prefix, over_vocabulary, rows)
    return tokens.astype(jnp.int32).reshape(scores.shape[:-1])


def sample_row(key: Array, scores: Array, row: Array) -> Array:
    """int32[]: the token :func:`sample` draws for row ``row`` of a batch whose row ``row``
    holds ``scores`` float32[V], without drawing the other rows' noise.

    ``sample(key, batch)`` reads its random numbers from one draw over the whole batch
    (``[B, PREFIX]`` uniforms, or ``[B, V]`` Gumbel noise for a vocabulary of at most
    ``PREFIX``). With JAX's default threefry keys and ``jax_threefry_partitionable`` (on by
    default), position ``i`` of a draw hashes the counter ``i`` alone, so row ``row`` of any
    batch of more than ``row`` rows holds the same numbers: those are computed here directly
    (:func:`row_uniforms`). This lets the serving engine draw each of a request's
    ``num_return_sequences`` sequences as ``genjax.generate`` draws that row. One difference
    remains: over a vocabulary larger than ``PREFIX``, :func:`sample` picks its path (prefix or
    whole vocabulary) for the whole batch and this function for the row alone, so the tokens
    agree when every row of the batch keeps at most ``PREFIX`` tokens or every row keeps more.

    Other keys (``rbg``), or threefry with ``jax_threefry_partitionable`` off, draw as row 0
    (``sample(key, scores[None])[0]``) whatever ``row`` is: their rows' numbers depend on the
    batch size (:func:`rows_drawn_alone` says which case holds).

    Args:
        key: a typed key.
        scores: float32[V], the row's processed scores.
        row: int32[], the row's index in the batch (traced).
    """
    if not rows_drawn_alone(key):
        return sample(key, scores[None])[0]
    vocab = scores.shape[-1]
    tiny = jnp.finfo(jnp.float32).tiny
    if vocab <= PREFIX:  # jax.random.categorical: Gumbel-max, "low" mode
        uniforms = row_uniforms(key, row, vocab, tiny)
        return jnp.argmax(-jnp.log(-jnp.log(uniforms)) + scores).astype(jnp.int32)
    uniforms = row_uniforms(key, row, PREFIX, tiny)[None]  # [1, PREFIX]
    rows = scores[None]

    def over_prefix(rows: Array) -> Array:
        values, indices = jax.lax.top_k(rows, PREFIX)
        picked = jnp.argmax(values - jnp.log(-jnp.log(uniforms)), axis=-1)
        return jnp.take_along_axis(indices, picked[:, None], axis=-1)[:, 0]

    def over_vocabulary(rows: Array) -> Array:
        return _inverse_cdf(rows, uniforms[:, 0])

    kept = jnp.sum(rows > NEG_INF, axis=-1)
    tokens = jax.lax.cond(jnp.all(kept <= PREFIX), over_prefix, over_vocabulary, rows)
    return tokens[0].astype(jnp.int32)


def rows_drawn_alone(key: Array | None = None) -> bool:
    """Whether :func:`sample_row` draws row ``row``'s own numbers for ``key`` (static): a
    threefry key (``key``'s, or for None JAX's default implementation) with
    ``jax_threefry_partitionable`` on (JAX's defaults)."""
    impl = jax.config.jax_default_prng_impl if key is None else str(jax.random.key_impl(key))
    return impl == "threefry2x32" and bool(jax.config.jax_threefry_partitionable)


def row_uniforms(key: Array, row: Array, width: int, minval: float) -> Array:
    """float32[width]: row ``row`` of ``jax.random.uniform(key, (B, width), minval=minval)``
    for any ``B > row``, computed alone (partitionable threefry: see :func:`sample_row`).

    Example:
        >>> key = jax.random.key(0)
        >>> bool(jnp.all(row_uniforms(key, 2, 5, 0.0) == jax.random.uniform(key, (4, 5))[2]))
        True
    """
    high, low = jax.random.key_data(key)  # the threefry key's two words
    counts = jnp.asarray(row, jnp.uint32) * jnp.uint32(width) + jnp.arange(width, dtype=jnp.uint32)
    # Every operand of the primitive computed from `counts`, so that under vmap all four are
    # batched alike (its vmap rule does not broadcast an unbatched key against them).
    zeros = counts * jnp.uint32(0)
    bits1, bits2 = threefry2x32_p.bind(zeros + high, zeros + low, zeros, counts)
    bits = bits1 ^ bits2
    # jax.random.uniform's float32 conversion: 23 random mantissa bits of a number in [1, 2).
    one = np.array(1.0, np.float32).view(np.uint32)
    floats = jax.lax.bitcast_convert_type((bits >> jnp.uint32(9)) | one, jnp.float32) - 1.0
    minval = jnp.float32(minval)
    return jnp.maximum(minval, floats * (jnp.float32(1.0) - minval) + minval)


def _inverse_cdf(rows: Array, uniform: Array) -> Array:
    """int32[R]: per row, the first token whose cumulative probability exceeds ``uniform``.

    Inverse transform sampling over float32[R, V] scores with one number in (0, 1) per row:
    token ``i`` is drawn with probability ``softmax(rows)[i]``. Only tokens of positive
    probability can be drawn; should rounding leave the uniform's share above every cumulative
    sum, the last such token is drawn. A row without any finite score draws token 0.
    """
    vocab = rows.shape[-1]
    probs = jnp.exp(rows - jnp.max(rows, axis=-1, keepdims=True))  # unnormalised, 0 at -inf
    cumulative = jnp.cumsum(probs, axis=-1)  # float32[R, V]
    positive = probs > 0
    crossing = positive & (cumulative > uniform[:, None] * cumulative[:, -1:])
    last = jnp.where(jnp.any(positive, -1), vocab - 1 - jnp.argmax(positive[:, ::-1], -1), 0)
    return jnp.where(jnp.any(crossing, -1), jnp.argmax(crossing, -1), last)


def _record(buffer: Array | None, values: Array, step: Array) -> Array | None:
    """Writes float32[B, V] values at step ``step`` of a float32[B, N, V] buffer."""
    if buffer is None:
        return None
    return jax.lax.dynamic_update_slice(
        buffer, values[:, None, :].astype(buffer.dtype), (0, step, 0)
    )


def step_output_buffers(step_fn: StepFn, params: PyTree, state, calls: int) -> PyTree:
    """Zero buffers for the extra outputs (the third value) of ``calls`` calls of ``step_fn`` on
    one token per row of ``state`` (a :class:`DecodeState` or a beam state): leaves
    ``[calls, ...]`` of the shapes and dtypes ``step_fn`` returns. Nothing runs: the shapes
    come from ``jax.eval_shape``."""
    last = state.tokens[:, :1]
    shapes = jax.eval_shape(
        step_fn, params, last, state.positions[:, None], state.cache, state.attention_mask
    )[2]
    return jax.tree.map(lambda s: jnp.zeros((calls, *s.shape), s.dtype), shapes)


def record_step_outputs(buffers: PyTree | None, outputs: tuple, index: Array) -> PyTree | None:
    """``buffers`` with the extra outputs of one step function call (``outputs[2:]``) written
    at ``index`` of their first axis; None when nothing is recorded."""
    if buffers is None:
        return None
    return jax.tree.map(
        lambda buffer, value: jax.lax.dynamic_update_index_in_dim(
            buffer, value.astype(buffer.dtype), index, axis=0
        ),
        buffers,
        outputs[2],
    )


def choose_next(state: DecodeState, logits: Array, rules: DecodeRules) -> DecodeState:
    """Processes the next-token logits, picks a token per row and writes it into the buffer.

    Args:
        state: the state before the token is chosen.
        logits: float32[B, V] raw next-token logits.
        rules: the processors, the token chooser, the pad id and the stopping rules.

    Returns:
        The state with one more token.
    """
    context = rules.context.replace(tokens=state.tokens, length=state.length)
    scores = logits.astype(jnp.float32)
    if state.guidance is not None:  # first in the chain, as in transformers
        scores = guide(scores, state.guidance)
    if rules.automaton is not None:  # before every processor and warper
        scores = mask_scores(scores, rules.automaton, state.automaton_state)
    scores = rules.process(scores, context)
    step = state.length - context.prompt_end
    tokens = rules.choose(scores, jax.random.fold_in(state.key, step))
    automaton_state = state.automaton_state
    if rules.automaton is not None:
        tokens, automaton_state = advance_rows(
            rules.automaton, automaton_state, tokens, ~state.finished
        )
    if rules.eos_token_ids is not None:  # transformers pads finished rows only when EOS is set
        tokens = jnp.where(state.finished, jnp.asarray(rules.pad_token_id, jnp.int32), tokens)
    if rules.on_token is not None:
        rules.on_token(tokens, ~state.finished)
    buffer = jax.lax.dynamic_update_slice(state.tokens, tokens[:, None], (0, state.length))
    length = state.length + 1
    return state.replace(
        tokens=buffer,
        length=length,
        finished=finished_rows(rules.stopping, state.finished, buffer, length, step),
        scores=_record(state.scores, scores, step),
        raw_logits=_record(state.raw_logits, logits, step),
        automaton_state=automaton_state,
    )


def decode(
    step_fn: StepFn,
    params: PyTree,
    state: DecodeState,
    first_logits: Array,
    rules: DecodeRules,
) -> DecodeState:
    """Runs the decoding loop until every row finished or the buffer is full.

    Args:
        step_fn: the model's step function (see the module docstring).
        params: the model parameters, passed to ``step_fn``.
        state: the state after prefill; ``state.cache`` holds the prompt.
        first_logits: float32[B, V], the prefill's logits at the last prompt slot.
        rules: how tokens are chosen and when rows finish (:class:`DecodeRules`). With
            ``max_time`` and no start time yet (:func:`genjax.stopping.start_timer`), the time
            counts from here, so the prefill is not counted.

    Returns:
        The final state; ``state.tokens`` holds the generated tokens and ``pad_token_id`` after a
        row finished (when EOS ids are set); slots never reached (all rows finished early) hold
        ``pad_token_id`` too if the buffer was initialised with it.

    Example:
        A test drives it with a fake step function returning fixed logits; see
        ``tests/test_decoding.py``.
    """
    max_length = state.tokens.shape[1]
    if rules.stopping.max_time is not None and rules.stopping.start_time is None:
        stopping, (first_logits,) = start_timer(rules.stopping, first_logits)
        rules = rules.replace(stopping=stopping)
    constrain = rules.constrain or (lambda state: state)
    state = constrain(choose_next(state, first_logits, rules))

    def body(state: DecodeState) -> DecodeState:
        last = jax.lax.dynamic_slice_in_dim(state.tokens, state.length - 1, 1, axis=1)
        outputs = step_fn(params, last, state.positions[:, None], state.cache, state.attention_mask)
        logits, cache = outputs[:2]
        call = state.length - 1 - rules.context.prompt_end  # the new token fed to the model
        state = state.replace(
            cache=cache,
            positions=state.positions + 1,
            step_outputs=record_step_outputs(state.step_outputs, outputs, call),
        )
        if state.guidance is not None:
            state = state.replace(guidance=advance_guidance(step_fn, params, state.guidance, last))
        return constrain(choose_next(state, logits[:, -1], rules))

    if rules.end is not None:
        max_length = jnp.minimum(rules.end, max_length)

    def cond(state: DecodeState) -> Array:
        return should_continue(state.length, max_length, state.finished)

    return jax.lax.while_loop(cond, body, state)
