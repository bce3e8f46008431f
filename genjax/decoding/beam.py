"""Beam search and beam sampling in one ``lax.while_loop``, with transformers v5's semantics.

The loop knows nothing about models: like :mod:`genjax.decoding.sampling` it takes a step function

    step(params, tokens int32[B*M, T], positions int32[B*M, T], cache, attention_mask int32[B*M, S])
        -> (logits float32[B*M, T, V], cache)

and a :class:`BeamState`. Row ``b * M + m`` of every ``[B*M, ...]`` array is running beam ``m``
of prompt ``b``; per-prompt arrays are ``[B, M, ...]``, kept sorted best first.

One step, as transformers v5's ``_beam_search`` does it (all on float32):

1. ``log_softmax`` of the next-token logits, then the logits processors (on log-probs, with the
   running beams' own buffers as ``input_ids``). These processed scores are what ``scores``
   records. Then each beam's running score is added.
2. The top ``K = max(2, 1 + E) * M`` continuations over all ``M * V`` (beam, token) pairs of a
   prompt (``E`` EOS ids); beam sampling draws ``K`` without replacement from ``softmax`` of the
   same totals instead (Gumbel top-k), then sorts them by total. ``K`` leaves at least ``M``
   continuations that are not EOS.
3. A continuation "hits a stopping criterion" when the buffer is full or a stopping rule of
   :mod:`genjax.stopping` says so for its sequence (EOS, a custom criterion, a stop string,
   ``max_time``), checked on all ``K`` candidate sequences as transformers v5 does.
   The best ``M`` that do not hit become the running beams; the rows of the KV cache are
   reordered to their source beams with one gather per prompt (:meth:`KVCache.gather_beams`).
4. Among the top ``M`` continuations, those that hit are finished hypotheses with score
   ``total / new_length ** length_penalty``; they enter the ``M`` best finished hypotheses of
   their prompt unless the prompt is already full (``early_stopping=True``) or could not improve.
5. A prompt stops improving when its best running beam, at its best hypothetical length, cannot
   beat its worst finished hypothesis (transformers' heuristic; ``early_stopping="never"`` with
   ``length_penalty > 0`` assumes the full length ``N``). The loop ends when no prompt can
   improve, when every prompt has ``M`` hypotheses and ``early_stopping=True``, or at ``N``:
   the buffer's new slots, or fewer (``BeamRules.num_new_tokens``, traced), so that one buffer
   serves calls of any length up to it.

Index bookkeeping, one prompt, ``M = 2`` beams, ``V = 5``, no EOS so ``K = 4``. Running beams
``a`` (score -1.0, row 0) and ``b`` (score -1.5, row 1); processed log-probs per beam::

    token           0     1     2     3     4
    beam a (-1.0)  -2.3  -0.4  -1.9  -3.0  -2.2      totals a: -3.3 -1.4 -2.9 -4.0 -3.2
    beam b (-1.5)  -0.2  -2.5  -2.6  -3.1  -3.4      totals b: -1.7 -4.0 -4.1 -4.6 -4.9

    flat index f = beam * V + token over the M*V = 10 totals; top K = 4:
        f = 1 (-1.4), 5 (-1.7), 2 (-2.9), 4 (-3.2)
    source beam  = f // V = 0, 1, 0, 0     token = f % V = 1, 0, 2, 4
    new running beams = the best M that are not EOS: "a 1" (-1.4) and "b 0" (-1.7)
    cache rows gathered: [0, 1] (here unchanged; "a 1", "a 2" would give [0, 0])
    beam_indices column of this step: prompt index * M + source beam = 0, 1

``beam_indices[r, t]`` is thus the row of ``scores[:, t]`` (``B*M`` rows) that produced token
``t`` of returned sequence ``r``: ``compute_transition_scores`` reads it there.

Static or traced:
    Static: ``M`` (``num_beams``), the buffer length ``S`` and its new slots, the processors,
    whether continuations are sampled, ``early_stopping``, the number of EOS ids, the output
    flags, whether a token automaton constrains the beams (:mod:`genjax.decoding.automaton`).
    Traced: ``length_penalty`` (scalar or per prompt ``[B]``), the EOS ids, the PRNG key, ``N``
    when ``BeamRules.num_new_tokens`` sets it below the buffer's new slots, the slot of the
    first new token when ``init_state(prompt_end=)`` sets it (``BeamState.start``: the
    ``max_cache_len`` layout of :mod:`genjax.cache.slots`, where the prompt's end changes from
    call to call), the processor settings, the automaton's tables and all state.

The slots of a returned sequence after its end hold transformers v5's fill value
(:func:`fill_token_id`): ``pad_token_id`` when it is set and not 0, else the first EOS id; -1 when
there is no EOS id (no hypothesis can then end early, so it shows only if a stopping criterion
ends the search).

Differences from transformers: every output holds ``N`` steps, a static shape (see
:mod:`genjax.outputs`), transformers cuts them to the longest returned hypothesis; beam sampling
draws with JAX's PRNG, so its tokens differ from torch's for the same seed (its processed scores
match).

Randomness: continuations at new-token index ``i`` are drawn with ``fold_in(key, i)``.

References:
    Hugging Face transformers v5, ``generation/utils.py``: ``_beam_search`` and its helpers
    ``_get_top_k_continuations``, ``_get_running_beams_for_next_iteration``,
    ``_update_finished_beams``, ``_check_early_stop_heuristic``; the semantics matched here.
    t5x ``decoding.py`` ``beam_search``: a model-free beam loop over a tokens-to-logits function.
    Kool et al. 2019, "Stochastic Beams and Where to Find Them: The Gumbel-Top-k Trick for
    Sampling Sequences Without Replacement".
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from genjax.cache import KVCache
from genjax.decoding.automaton import TokenAutomaton, mask_scores
from genjax.decoding.sampling import record_step_outputs
from genjax.errors import UnsupportedError
from genjax.processors import LogitsContext, Processor
from genjax.stopping import StoppingRules, finished_rows, is_eos
from genjax.typing import Array, PyTree

StepFn = Callable[[PyTree, Array, Array, KVCache, Array], tuple[Array, KVCache]]

EXCLUDED = -1.0e9
"""The score transformers adds to exclude a beam (not -inf, so arithmetic stays finite)."""


@struct.dataclass
class BeamState:
    """Everything the beam loop carries from one token to the next."""

    tokens: Array  # int32[B*M, S]: running beams' buffers: padding, prompt, new tokens, pad
    length: Array  # int32[]: slots of `tokens` filled so far (the same in every beam)
    positions: Array  # int32[B*M]: position id of the next token fed to the model
    # L x keys float[B*M, K, H, S] and values float[B*M, K, S, H] (see genjax.cache.kv);
    # row b*M + m holds running beam m of prompt b
    cache: KVCache
    attention_mask: Array  # int32[B*M, S]: 1 where a slot holds a real token
    running_scores: Array  # float32[B, M]: summed processed log-probs, best first
    running_indices: Array  # int32[B, M, N]: beam_indices of the running beams (-1: not yet)
    hyp_tokens: Array  # int32[B, M, N]: new tokens of the best finished hypotheses
    hyp_scores: Array  # float32[B, M]: their length-penalised scores, best first (-1e9: empty)
    hyp_indices: Array  # int32[B, M, N]: their beam_indices (-1 after the end)
    hyp_finished: Array  # bool[B, M]: the slot holds a finished hypothesis
    improvable: Array  # bool[B]: running beams may still beat the worst finished hypothesis
    done: Array  # bool[]: no prompt can change its hypotheses any more
    key: Array  # key[]: the PRNG key of the whole call (beam sampling)
    scores: Array | None  # float32[B*M, N, V]: processed scores, when recorded
    raw_logits: Array | None  # float32[B*M, N, V]: raw logits, when recorded
    # int32[B*M]: each running beam's token-automaton state, when rules.automaton is set
    automaton_state: Array | None = None
    # The step function's extra outputs of each model call, leaves [N - 1, ...], for the B*M
    # running beams as they were fed (not reordered), when recorded (see
    # genjax.decoding.sampling.step_output_buffers); None: the step function returns two values.
    step_outputs: PyTree | None = None
    # int32[] (traced): the slot of the first new token when the buffer's prompt ends at a slot
    # that changes from call to call (max_cache_len, genjax.cache.slots); None: S - N.
    start: Array | None = None

    @property
    def num_beams(self) -> int:
        """``M`` (static)."""
        return self.running_scores.shape[1]

    @property
    def num_new_tokens(self) -> int:
        """``N`` (static)."""
        return self.running_indices.shape[2]

    @property
    def prompt_end(self) -> Array | int:
        """The slot of the first new token: ``S - N`` (static), or ``start`` (traced)."""
        return self.tokens.shape[1] - self.num_new_tokens if self.start is None else self.start


@struct.dataclass
class BeamRules:
    """How continuations are chosen and scored: fixed for a whole call."""

    process: Processor = struct.field(pytree_node=False)  # the logits processor chain
    do_sample: bool = struct.field(pytree_node=False)  # beam sampling instead of top-k
    early_stopping: bool | str = struct.field(pytree_node=False)  # True, False or "never"
    context: LogitsContext  # prompt bookkeeping over B*M rows; tokens and length change per step
    length_penalty: Array  # float32[] or [B]: hypothesis score = total / length**length_penalty
    eos_token_ids: Array | None  # int32[E], or None when only the length ends a hypothesis
    # EOS, custom criteria, stop strings and max_time (genjax.stopping); None: EOS and length.
    stopping: StoppingRules | None = None
    # Applied to the loop carry before the loop and after every step, e.g.
    # genjax.sharding.Layout.constrain, so a sharded carry keeps its shardings; None: nothing.
    constrain: Callable[[BeamState], BeamState] | None = struct.field(
        pytree_node=False, default=None
    )
    # Structured output (genjax.decoding.automaton): masks the log-probs before the processors;
    # each beam's state follows its source beam. Its tables are traced. None: no constraint.
    automaton: TokenAutomaton | None = None
    # int32[] (traced): the new tokens of the call, at most the buffer's N, so that one buffer
    # serves calls of any length without compiling (``max_cache_len``); None: the buffer's N.
    num_new_tokens: Array | None = None

    @property
    def num_eos(self) -> int:
        """``E`` (static)."""
        return 0 if self.eos_token_ids is None else jnp.atleast_1d(self.eos_token_ids).shape[0]


_ASSISTED = ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp", "dola_layers")


def check_supported(config) -> None:
    """Raises UnsupportedError for a beam-search config using an option the beam loop lacks.

    Args:
        config: a :class:`~genjax.GenerationConfig` with ``num_beams > 1``, defaults applied.

    Raises:
        UnsupportedError: assisted generation or DoLa flags (transformers ignores them with a
            warning in beam search; genjax refuses rather than ignore them), ``low_memory``.

    Example:
        >>> from genjax import GenerationConfig
        >>> check_supported(GenerationConfig(num_beams=4).with_defaults())  # passes
    """
    for name in _ASSISTED:
        value = getattr(config, name)
        if value is not None and value is not False:
            raise UnsupportedError(
                f"`{name}={value!r}` (assisted generation / DoLa) cannot be combined with beam "
                f"search (num_beams={config.num_beams}): transformers ignores it there, genjax "
                f"refuses. Unset {name}, or set num_beams=1 to use it."
            )
    if config.low_memory:
        raise UnsupportedError(
            "`low_memory=True` (sequential beam search) is not supported, as in transformers v5. "
            "Unset low_memory."
        )


def fill_token_id(pad_token_id: Array, eos_token_ids: Array | None) -> Array:
    """int32[]: the token transformers v5's beam search writes after a hypothesis' end.

    transformers fills its sequences with ``pad_token_id or eos_token_id[0] if eos_token_id is
    not None else -1``: a pad id of 0 is falsy, so it gives the first EOS id, as does an unset
    pad id (transformers sets it to the first EOS id beforehand, and so does genjax).

    Args:
        pad_token_id: int32[] (traced).
        eos_token_ids: int32[E] (traced), or None (static).

    Example:
        >>> int(fill_token_id(jnp.int32(0), jnp.array([7, 9])))
        7
        >>> int(fill_token_id(jnp.int32(5), jnp.array([7, 9])))
        5
    """
    if eos_token_ids is None:
        return jnp.asarray(-1, jnp.int32)
    pad = jnp.asarray(pad_token_id, jnp.int32)
    return jnp.where(pad != 0, pad, jnp.atleast_1d(eos_token_ids)[0]).astype(jnp.int32)


def init_state(
    tokens: Array,
    cache: KVCache,
    attention_mask: Array,
    key: Array,
    *,
    num_beams: int,
    num_new_tokens: int,
    scores_shape: tuple[int, int, int] | None = None,
    logits_shape: tuple[int, int, int] | None = None,
    fill_token_id: Array | None = None,
    prompt_end: Array | None = None,
) -> BeamState:
    """The state after prefill, with every prompt's row repeated ``M`` times.

    Args:
        tokens: int32[B, S]: the prompt, then ``N`` slots (they become the slots after a
            hypothesis' end, unless ``fill_token_id`` replaces them).
        cache: the prefilled cache with ``B`` rows.
        attention_mask: int32[B, S] over every slot (new slots 1); the first new token's
            position id is the number of real prompt tokens.
        key: the PRNG key (used by beam sampling only).
        num_beams: ``M`` (static).
        num_new_tokens: ``N`` (static).
        scores_shape, logits_shape: ``(B*M, N, V)`` to record processed scores / raw logits.
        fill_token_id: int32[] written into the ``N`` new slots first (see
            :func:`fill_token_id`), so that it follows each hypothesis' end; None keeps them.
        prompt_end: int32[] (traced): the slot of the first new token, for a buffer whose
            prompt ends at a slot that changes from call to call (the ``max_cache_len`` layout
            of :mod:`genjax.cache.slots`: the prompt, then at most ``N`` new slots, which
            ``BeamRules.num_new_tokens`` bounds); None: ``S - N`` (static).

    Returns:
        A :class:`BeamState`; beam 0 of each prompt starts at score 0 and the others at -1e9,
        so the first step only extends one copy of the prompt (as transformers does).

    Example:
        >>> state = init_state(jnp.zeros((1, 4), jnp.int32), model.init_cache(1, 4),
        ...                    jnp.ones((1, 4), jnp.int32), jax.random.key(0),
        ...                    num_beams=2, num_new_tokens=2)
        >>> state.tokens.shape  # [B*M, S] for B = 1, M = 2, S = 4
        (2, 4)
    """
    batch, length = tokens.shape
    start = length - num_new_tokens if prompt_end is None else prompt_end
    prompt = jnp.arange(length)[None, :] < start  # bool[1, S]
    if fill_token_id is not None:
        tokens = jnp.where(prompt, tokens, fill_token_id)
    new = jnp.repeat(_new_slots(tokens, start, num_new_tokens)[:, None], num_beams, axis=1)
    running = jnp.full((batch, num_beams), EXCLUDED, jnp.float32).at[:, 0].set(0.0)
    no_indices = jnp.full((batch, num_beams, num_new_tokens), -1, jnp.int32)
    return BeamState(
        tokens=jnp.repeat(tokens, num_beams, axis=0),  # a reshape: sharded rows stay local
        length=jnp.asarray(start, jnp.int32),
        positions=jnp.repeat(
            jnp.sum(jnp.where(prompt, attention_mask, 0), axis=-1), num_beams, axis=0
        ).astype(jnp.int32),
        cache=cache.repeat_rows(num_beams),
        attention_mask=jnp.repeat(attention_mask, num_beams, axis=0),
        running_scores=running,
        running_indices=no_indices,
        hyp_tokens=jnp.asarray(new, jnp.int32),
        hyp_scores=jnp.full((batch, num_beams), EXCLUDED, jnp.float32),
        hyp_indices=no_indices,
        hyp_finished=jnp.zeros((batch, num_beams), bool),
        improvable=jnp.ones((batch,), bool),
        done=jnp.zeros((), bool),
        key=key,
        scores=None if scores_shape is None else jnp.zeros(scores_shape, jnp.float32),
        raw_logits=None if logits_shape is None else jnp.zeros(logits_shape, jnp.float32),
        start=None if prompt_end is None else jnp.asarray(prompt_end, jnp.int32),
    )


def _new_slots(tokens: Array, start: Array | int, count: int) -> Array:
    """int32[..., count]: ``tokens[..., start : start + count]``. A traced ``start`` reads by a
    gather whose slots past the buffer's end repeat its last slot: the ``max_cache_len``
    layout has fewer than ``count`` slots after a long prompt, and those columns are never
    returned (:func:`best_hypotheses` reads only the buffer's slots)."""
    if isinstance(start, int):
        return tokens[..., start : start + count]
    return jnp.take(tokens, start + jnp.arange(count), axis=-1, mode="clip")


def _take(values: Array, index: Array) -> Array:
    """values[b, index[b, k], ...] for values [B, J, ...] and index int32[B, K] -> [B, K, ...]."""
    return values[jnp.arange(index.shape[0])[:, None], index]


def _record(buffer: Array | None, values: Array, step: Array) -> Array | None:
    """Writes float32[R, V] values at step ``step`` of a float32[R, N, V] buffer."""
    if buffer is None:
        return None
    return jax.lax.dynamic_update_slice(buffer, values[:, None].astype(buffer.dtype), (0, step, 0))


def _per_prompt(value: Array) -> Array:
    """A scalar stays a scalar; a per-prompt float[B] becomes float[B, 1]."""
    value = jnp.asarray(value, jnp.float32)
    return value[:, None] if value.ndim == 1 else value


def _top_continuations(state: BeamState, totals: Array, rules: BeamRules, step: Array):
    """Picks K continuations per prompt from float32[B, M*V] totals.

    Returns (total float32[B, K] best first, source beam int32[B, K], token int32[B, K]).
    """
    num_beams = state.num_beams
    count = max(2, 1 + rules.num_eos) * num_beams
    if rules.do_sample:
        noise = jax.random.gumbel(jax.random.fold_in(state.key, step), totals.shape)
        _, flat = jax.lax.top_k(totals + noise, count)
        picked, order = jax.lax.top_k(jnp.take_along_axis(totals, flat, axis=-1), count)
        flat = jnp.take_along_axis(flat, order, axis=-1)
    else:
        picked, flat = jax.lax.top_k(totals, count)
    vocab = totals.shape[-1] // num_beams
    return picked, (flat // vocab).astype(jnp.int32), (flat % vocab).astype(jnp.int32)


def _add_hypotheses(state, picked, tokens, indices, hits, step, rules) -> BeamState:
    """Merges the top-M continuations that just finished into the best finished hypotheses.

    ``picked`` float32[B, K] totals, ``tokens``/``indices`` int32[B, K, N], ``hits`` bool[B, K].
    """
    num_beams = state.num_beams
    just_finished = hits & (jnp.arange(hits.shape[1]) < num_beams)[None, :]
    score = picked / (step + 1).astype(jnp.float32) ** _per_prompt(rules.length_penalty)
    if rules.early_stopping is True:
        full = jnp.all(state.hyp_finished, axis=-1, keepdims=True)
        score = score + full.astype(jnp.float32) * EXCLUDED
    score = score + (~state.improvable[:, None]).astype(jnp.float32) * EXCLUDED
    score = score + (~just_finished).astype(jnp.float32) * EXCLUDED
    merged = jnp.concatenate([state.hyp_scores, score], axis=1)  # [B, M + K]
    best_scores, best = jax.lax.top_k(merged, num_beams)
    return state.replace(
        hyp_tokens=_take(jnp.concatenate([state.hyp_tokens, tokens], axis=1), best),
        hyp_scores=best_scores,
        hyp_indices=_take(jnp.concatenate([state.hyp_indices, indices], axis=1), best),
        hyp_finished=_take(jnp.concatenate([state.hyp_finished, just_finished], axis=1), best),
    )


def _limit(state: BeamState, rules: BeamRules) -> Array | int:
    """The call's new tokens ``N``: ``rules.num_new_tokens`` (traced) when set, else the
    buffer's (static)."""
    return state.num_new_tokens if rules.num_new_tokens is None else rules.num_new_tokens


def _still_improvable(state: BeamState, step: Array, rules: BeamRules) -> Array:
    """bool[B]: transformers' early-stop heuristic, after ``step + 1`` new tokens."""
    penalty = _per_prompt(rules.length_penalty)
    length = jnp.asarray(step + 1, jnp.float32)
    if rules.early_stopping == "never":
        length = jnp.where(penalty > 0, jnp.asarray(_limit(state, rules), jnp.float32), length)
    best_possible = state.running_scores[:, :1] / length**penalty  # [B, 1]
    worst = jnp.min(state.hyp_scores, axis=-1, keepdims=True)
    worst = jnp.where(state.hyp_finished, worst, EXCLUDED)  # [B, M]
    return state.improvable & jnp.any(best_possible > worst, axis=-1)


def _next_automaton_state(state, rules, source, token, keep) -> Array | None:
    """int32[B*M]: the automaton states of the new running beams: each of the ``K``
    continuations (source row ``source`` int32[B, K], ``token`` int32[B, K]) advances its source
    beam's state (a refused token, scored -inf, keeps it), then the kept ones (``keep`` int32[B,
    M]) are taken."""
    if rules.automaton is None:
        return state.automaton_state
    before = state.automaton_state[source.reshape(-1)]
    after = rules.automaton.advance(before, token.reshape(-1))
    after = jnp.where(after >= 0, after, before).reshape(source.shape)
    return _take(after, keep).reshape(-1).astype(jnp.int32)


def advance(state: BeamState, logits: Array, rules: BeamRules) -> BeamState:
    """One beam step: scores the next tokens of every running beam and updates all beams.

    Args:
        state: the state before the step.
        logits: float32[B*M, V] raw next-token logits of the running beams.
        rules: the processors, the sampling switch, ``early_stopping``, ``length_penalty``.

    Returns:
        The state with one more token in every running beam, the finished hypotheses updated,
        the cache rows reordered, and ``done`` set when the search is over.

    Example:
        >>> state = init_state(jnp.zeros((1, 4), jnp.int32), model.init_cache(1, 4),
        ...                    jnp.ones((1, 4), jnp.int32), jax.random.key(0),
        ...                    num_beams=2, num_new_tokens=2)
        >>> rules = BeamRules(process=genjax.processors.identity(), do_sample=False,
        ...                   early_stopping=False, length_penalty=1.0, eos_token_ids=None,
        ...                   context=genjax.processors.LogitsContext.for_prompt(state.tokens))
        >>> logits = jnp.log(jnp.array([[0.1, 0.6, 0.3]] * 2))  # float32[B*M, V], V = 3
        >>> state = jax.jit(advance)(state, logits, rules)  # the first token, from the prefill
        >>> state.tokens[:, 2].tolist()  # beam 0 took the best token, beam 1 the second best
        [1, 2]
    """
    batch, num_beams = state.running_scores.shape
    prompt_length = state.prompt_end
    step = state.length - prompt_length
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    context = rules.context.replace(tokens=state.tokens, length=state.length)
    if rules.automaton is not None:
        log_probs = mask_scores(log_probs, rules.automaton, state.automaton_state)
    processed = rules.process(log_probs, context)  # float32[B*M, V]
    totals = processed.reshape(batch, num_beams, -1) + state.running_scores[:, :, None]
    picked, beam, token = _top_continuations(state, totals.reshape(batch, -1), rules, step)

    source = beam + jnp.arange(batch)[:, None] * num_beams  # int32[B, K]: rows in B*M
    tokens = _take(state.tokens.reshape(batch, num_beams, -1), beam)  # int32[B, K, S]
    tokens = jax.lax.dynamic_update_slice(tokens, token[:, :, None], (0, 0, state.length))
    indices = _take(state.running_indices, beam)  # int32[B, K, N]
    indices = jax.lax.dynamic_update_slice(indices, source[:, :, None], (0, 0, step))
    if rules.stopping is None:
        hits = is_eos(token.reshape(-1), rules.eos_token_ids).reshape(token.shape)
    else:  # every rule, on each of the K candidate sequences (transformers v5 does the same)
        candidates = tokens.reshape(-1, tokens.shape[-1])
        not_yet = jnp.zeros(candidates.shape[0], bool)
        hits = finished_rows(rules.stopping, not_yet, candidates, state.length + 1, step)
        hits = hits.reshape(token.shape)
    hits = hits | (step + 1 >= _limit(state, rules))

    alive = picked + hits.astype(jnp.float32) * EXCLUDED
    running_scores, keep = jax.lax.top_k(alive, num_beams)  # [B, M]
    new = state.replace(
        tokens=_take(tokens, keep).reshape(batch * num_beams, -1),
        length=state.length + 1,
        cache=state.cache.gather_beams(_take(beam, keep)),
        running_scores=running_scores,
        running_indices=_take(indices, keep),
        scores=_record(state.scores, processed, step),
        raw_logits=_record(state.raw_logits, logits, step),
        automaton_state=_next_automaton_state(state, rules, source, token, keep),
    )
    hypotheses = _new_slots(tokens, prompt_length, state.num_new_tokens)  # int32[B, K, N]
    new = _add_hypotheses(new, picked, hypotheses, indices, hits, step, rules)
    new = new.replace(improvable=_still_improvable(new, step, rules))
    searching = jnp.any(new.improvable) & ~jnp.all(hits)
    if rules.early_stopping is True:
        searching = searching & ~jnp.all(new.hyp_finished)
    return new.replace(done=~searching)


def beam_search(
    step_fn: StepFn,
    params: PyTree,
    state: BeamState,
    first_logits: Array,
    rules: BeamRules,
) -> BeamState:
    """Runs beam search (or beam sampling) until it is over or the buffer is full.

    Args:
        step_fn: the model's step function (see the module docstring).
        params: the model parameters, passed to ``step_fn``.
        state: from :func:`init_state`; ``state.cache`` holds the prompt in all ``B*M`` rows.
        first_logits: float32[B*M, V], the prefill's logits at the last prompt slot, per beam.
        rules: :class:`BeamRules`.

    Returns:
        The final state; read the results with :func:`best_hypotheses`.

    Example:
        ``tests/test_beam.py`` drives it with a fake step function; ``genjax.generate`` with a
        model::

            state = beam_search(model.apply, params, state, logits, rules)
            sequences, sequences_scores, beam_indices = best_hypotheses(state, 2)
    """
    constrain = rules.constrain or (lambda state: state)
    state = constrain(advance(state, first_logits, rules))
    max_length = state.tokens.shape[1]
    prompt_length = state.prompt_end

    def body(state: BeamState) -> BeamState:
        last = jax.lax.dynamic_slice_in_dim(state.tokens, state.length - 1, 1, axis=1)
        outputs = step_fn(params, last, state.positions[:, None], state.cache, state.attention_mask)
        logits, cache = outputs[:2]
        call = state.length - 1 - prompt_length  # the new token fed to the model
        state = state.replace(
            cache=cache,
            positions=state.positions + 1,
            step_outputs=record_step_outputs(state.step_outputs, outputs, call),
        )
        return constrain(advance(state, logits[:, -1], rules))

    def cond(state: BeamState) -> Array:
        return ~state.done & (state.length < max_length)

    return jax.lax.while_loop(cond, body, state)


def best_hypotheses(state: BeamState, num_return_sequences: int) -> tuple[Array, Array, Array]:
    """The ``R`` best finished hypotheses of each prompt, best first.

    Args:
        state: the final state of :func:`beam_search`.
        num_return_sequences: ``R <= M`` (static).

    Returns:
        ``(sequences int32[B*R, S], sequences_scores float32[B*R], beam_indices int32[B*R, N])``;
        ``sequences`` holds the prompt then the hypothesis' new tokens, then the value of the new
        slots given to :func:`init_state` (``fill_token_id``) after its end; ``beam_indices``
        holds -1 after the end.

    Example:
        >>> state = init_state(jnp.zeros((1, 4), jnp.int32), model.init_cache(1, 4),
        ...                    jnp.ones((1, 4), jnp.int32), jax.random.key(0),
        ...                    num_beams=2, num_new_tokens=2)
        >>> rules = BeamRules(process=genjax.processors.identity(), do_sample=False,
        ...                   early_stopping=False, length_penalty=1.0, eos_token_ids=None,
        ...                   context=genjax.processors.LogitsContext.for_prompt(state.tokens))
        >>> logits = jnp.log(jnp.array([[0.1, 0.6, 0.3]] * 2))  # float32[B*M, V], V = 3
        >>> state = jax.jit(advance)(state, logits, rules)
        >>> state = jax.jit(advance)(state, logits, rules)  # N = 2 tokens: done
        >>> sequences, sequences_scores, beam_indices = best_hypotheses(state, 2)
        >>> sequences.tolist()
        [[0, 0, 1, 1], [0, 0, 1, 2]]
    """
    batch, num_beams = state.running_scores.shape
    count = num_return_sequences
    buffer = state.tokens.reshape(batch, num_beams, -1)[:, 0]  # int32[B, S]: the prompt first
    new_tokens = state.hyp_tokens[:, :count].reshape(batch * count, -1)  # int32[B*R, N]
    slot = jnp.arange(buffer.shape[1])
    new_slot = jnp.clip(slot - state.prompt_end, 0, state.num_new_tokens - 1)
    sequences = jnp.where(
        slot[None, :] < state.prompt_end,
        jnp.repeat(buffer, count, axis=0),
        jnp.take(new_tokens, new_slot, axis=1),
    )
    return (
        sequences,
        state.hyp_scores[:, :count].reshape(-1),
        state.hyp_indices[:, :count].reshape(batch * count, -1),
    )
