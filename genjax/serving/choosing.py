"""Token choice for the engine's rows: the constraint mask, the processors and warpers, greedy
or sampled choice, the constraint's next state, the end rules and raw log-probabilities.

Token choice per row follows transformers' order: the structured-output mask of a constrained row
(:mod:`genjax.serving.constraint_pool`; before every processor, as ``genjax.generate`` applies it),
the bias table (``sequence_bias``, its multi-token sequences biasing their last token when the rest
ends the row's history; ``suppress_tokens``, ``bad_words_ids`` and, at the first new token only,
``begin_suppress_tokens`` as a bias of -inf, which every later step keeps at -inf, so the place in
the chain does not matter, except to forcing and ``remove_invalid_values``, which
:mod:`genjax.serving.options` therefore refuses beside the suppressions they would part from;
:func:`sequence_biases`), the encoder repetition penalty (the prompt as the encoder input, as
transformers reads it for decoder-only models), repetition penalty, no-repeat n-grams of the
history and of the prompt (``no_repeat_ngram_size``, ``encoder_no_repeat_ngram_size``, each row
its own sizes), EOS blocked until ``min_new_tokens``, forced
BOS and EOS, invalid values removed, the exponential decay length penalty, OpenAI's presence and
frequency penalties (where ``generate`` runs a user's ``logits_processor``), then temperature,
top-H, top-k, top-p, min-p, typical-p, epsilon and eta cutoffs, then ``renormalize_logits``'
log-softmax; greedy rows take the argmax (the warpers never move it), sampling rows draw with
``fold_in(key, new_token_index)`` as :func:`genjax.generate` does, so a preempted and recomputed
request draws the same tokens; the sequence ``j`` of a request's ``num_return_sequences`` draws
the numbers of row ``j`` of ``generate``'s batch (:func:`genjax.decoding.sampling.sample_row`). A
constrained row's automaton state then follows its token; a token the automaton refuses (a
processor removed every allowed one) becomes the constraint's EOS id
(:func:`genjax.decoding.automaton.advance_rows`).

The mask and the automaton step, the bias, the forcing and decay rules, OpenAI's penalties, the
warpers and the draw, the truncation warpers, the renormalization and the log-probabilities each
run under a ``lax.cond`` that skips them in
steps where no row uses them, so requests that do not use an option pay one ``any`` reduction for
it.

Log-probabilities (rows with ``settings.logprobs >= 0``): the chosen token's log-probability
under the model's raw distribution, ``log_softmax(logits)`` before any processor (vLLM's default
``raw_logprobs``; what ``genjax.generate``'s ``output_logits`` give), and the ``L`` most likely
tokens with theirs.

Static or traced:
    Static: ``L``, ``L_b``, the longest biased sequence's prefix ``W``, ``E``, the largest no-repeat
    n-gram size ``N`` (a field of :class:`RowSettings` outside its leaves), whether the engine has a
    constraint pool and its shapes.
    Traced: every :class:`RowSettings` value, the pool's contents and the rows' automaton states.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from genjax.constraints import CompressedTable
from genjax.decoding.automaton import advance_rows, mask_scores
from genjax.decoding.sampling import highest, sample_row
from genjax.processors import (
    LogitsContext,
    chain,
    count_penalties,
    encoder_repetition_penalty,
    epsilon_cutoff,
    eta_cutoff,
    min_p,
    repetition_penalty,
    temperature,
    top_h,
    top_k,
    top_p,
    typical_p,
)
from genjax.processors.base import NEG_INF
from genjax.typing import Array

__all__ = [
    "Chosen",
    "RowSettings",
    "Scored",
    "ban_repeated_ngrams",
    "choose_rows",
    "choose_tokens",
    "no_scores",
    "reached_end",
    "token_logprobs",
]


@struct.dataclass
class RowSettings:
    """Per-request generation values, one entry per row (all traced)."""

    do_sample: Array  # bool[R]: draw tokens (else argmax)
    temperature: Array  # float32[R]: 1.0 = off
    top_h: Array  # float32[R]: 0.0 = off
    top_k: Array  # int32[R]: 0 = off
    top_p: Array  # float32[R]: 1.0 = off
    min_p: Array  # float32[R]: 0.0 = off
    typical_p: Array  # float32[R]: 1.0 = off
    epsilon_cutoff: Array  # float32[R]: 0.0 = off
    eta_cutoff: Array  # float32[R]: 0.0 = off
    repetition_penalty: Array  # float32[R]: 1.0 = off
    encoder_repetition_penalty: Array  # float32[R]: 1.0 = off (rewards the prompt's tokens)
    presence_penalty: Array  # float32[R]: 0.0 = off (OpenAI's, on generated tokens)
    frequency_penalty: Array  # float32[R]: 0.0 = off
    bias_ids: Array  # int32[R, L_b]: biased token ids; -1 fills unused entries
    bias_values: Array  # float32[R, L_b]: their biases
    # int32[R, L_b, W]: the tokens that must end the history for the bias to apply, right-aligned
    # (-1 fills the unused slots on the left; all -1: a single-token entry, always applied)
    bias_prefixes: Array
    bias_first_only: Array  # bool[R, L_b]: applied at the first new token only
    logprobs: Array  # int32[R]: -1: none; k >= 0: the chosen token's logprob and the top k
    max_new_tokens: Array  # int32[R]
    min_new_tokens: Array  # int32[R]: EOS is blocked before this many new tokens
    eos_token_ids: Array  # int32[R, E]: -1 fills unused entries
    seed: Array  # int32[R]: the request's key is jax.random.key(seed)
    sample_row: Array  # int32[R]: the row of genjax.generate's batch whose draws this row
    #   makes: the sequence's index among its request's num_return_sequences (0: the first)
    constraint_eos: Array  # int32[R]: the EOS id of the request's constraint (-1: none)
    no_repeat_ngram_size: Array  # int32[R]: 0 = off; at most max_ngram
    encoder_no_repeat_ngram_size: Array  # int32[R]: 0 = off; n-grams of the prompt; <= max_ngram
    forced_first: Array  # int32[R]: the token forced as the first new one (-1: none)
    forced_last: Array  # int32[R, E]: the tokens forced as the last new one (-1 fills)
    remove_invalid: Array  # bool[R]: NaN and infinities made finite (remove_invalid_values)
    decay_start: Array  # int32[R]: new tokens before the EOS boost starts
    decay_factor: Array  # float32[R]: the EOS boost's factor per token; 1.0 = off
    renormalize: Array  # bool[R]: log-softmax after the warpers (renormalize_logits)
    max_ngram: int = struct.field(pytree_node=False, default=0)  # N (static)

    @classmethod
    def stack(cls, rows: Sequence[RowSettings]) -> RowSettings:
        """The settings of ``rows`` (numpy, each its own rows) one after the other; no
        compilation."""
        return jax.tree.map(lambda *values: np.concatenate(values), *rows)

    @classmethod
    def empty(cls, rows: int, shape) -> RowSettings:
        """Neutral settings (greedy, nothing active) for ``rows`` rows of an engine of
        :class:`~genjax.serving.engine.EngineShape` ``shape``; numpy, no compilation."""
        max_bias = shape.max_bias
        return cls(
            do_sample=np.zeros((rows,), bool),
            temperature=np.ones((rows,), np.float32),
            top_h=np.zeros((rows,), np.float32),
            top_k=np.zeros((rows,), np.int32),
            top_p=np.ones((rows,), np.float32),
            min_p=np.zeros((rows,), np.float32),
            typical_p=np.ones((rows,), np.float32),
            epsilon_cutoff=np.zeros((rows,), np.float32),
            eta_cutoff=np.zeros((rows,), np.float32),
            repetition_penalty=np.ones((rows,), np.float32),
            encoder_repetition_penalty=np.ones((rows,), np.float32),
            presence_penalty=np.zeros((rows,), np.float32),
            frequency_penalty=np.zeros((rows,), np.float32),
            bias_ids=np.full((rows, max_bias), -1, np.int32),
            bias_values=np.zeros((rows, max_bias), np.float32),
            bias_prefixes=np.full((rows, max_bias, shape.max_bias_prefix), -1, np.int32),
            bias_first_only=np.zeros((rows, max_bias), bool),
            logprobs=np.full((rows,), -1, np.int32),
            max_new_tokens=np.zeros((rows,), np.int32),
            min_new_tokens=np.zeros((rows,), np.int32),
            eos_token_ids=np.full((rows, shape.max_eos), -1, np.int32),
            seed=np.zeros((rows,), np.int32),
            sample_row=np.zeros((rows,), np.int32),
            constraint_eos=np.full((rows,), -1, np.int32),
            no_repeat_ngram_size=np.zeros((rows,), np.int32),
            encoder_no_repeat_ngram_size=np.zeros((rows,), np.int32),
            forced_first=np.full((rows,), -1, np.int32),
            forced_last=np.full((rows, shape.max_eos), -1, np.int32),
            remove_invalid=np.zeros((rows,), bool),
            decay_start=np.zeros((rows,), np.int32),
            decay_factor=np.ones((rows,), np.float32),
            renormalize=np.zeros((rows,), bool),
            max_ngram=shape.max_ngram,
        )


@struct.dataclass
class Scored:
    """Chosen tokens with their log-probabilities (:func:`token_logprobs`)."""

    logprobs: Array  # float32[B]: the chosen token's raw log-probability
    top_ids: Array  # int32[B, L]: the L most likely tokens, most likely first (-1: none)
    top_logprobs: Array  # float32[B, L]: their raw log-probabilities


def token_logprobs(logits: Array, token: Array, want: Array, top: int) -> Scored:
    """Raw log-probabilities of the chosen tokens and the ``top`` most likely ones.

    Computed under ``lax.cond`` only when a row has ``want >= 0`` (zeros otherwise), so a step
    where no request asks pays one ``any`` reduction.

    Args:
        logits: float32[B, V], the model's raw next-token logits.
        token: int32[B], the chosen tokens.
        want: int32[B], each row's ``RowSettings.logprobs`` (-1: none).
        top: ``L`` (static), the most top log-probabilities any row may ask.
    """
    batch = logits.shape[0]

    def compute(logits):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
        k = min(top, logp.shape[-1])  # a vocabulary smaller than L: pad with (-1, -inf)
        values, ids = jax.lax.top_k(logp, k) if k else (logp[:, :0], logp[:, :0])
        ids = jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, top - k)), constant_values=-1)
        values = jnp.pad(values, ((0, 0), (0, top - k)), constant_values=-jnp.inf)
        return Scored(chosen, ids, values)

    return jax.lax.cond(jnp.any(want >= 0), compute, lambda _: no_scores(batch, top), logits)


def choose_tokens(
    logits: Array, tokens: Array, lengths: Array, prompt_lengths: Array, settings: RowSettings
) -> Array:
    """Processes float32[B, V] next-token logits per row and chooses int32[B] tokens.

    Args:
        logits: float32[B, V], the logits at each row's last token.
        tokens: int32[B, S], each row's history (valid up to ``lengths``).
        lengths: int32[B], tokens in the history (the next token goes to slot ``lengths``).
        prompt_lengths: int32[B], the request's prompt length.
        settings: the rows' :class:`RowSettings` ([B] each).
    """
    batch, vocab = logits.shape
    num_new = lengths - prompt_lengths  # [B]
    context = LogitsContext(
        tokens=tokens,
        length=lengths[:, None],  # per row: broadcasts against the slots [1, S]
        offset=jnp.zeros((), jnp.int32),
        prompt_end=prompt_lengths[:, None],
        first_valid=jnp.zeros((batch,), jnp.int32),
    )
    # The bias and OpenAI's penalties run under lax.cond: steps where no row uses them skip
    # their [B, V] passes.
    scores = logits
    if settings.bias_ids.shape[-1]:

        def bias(scores):
            return scores + sequence_biases(tokens, lengths, num_new, settings, vocab)

        biased = jnp.any(settings.bias_ids >= 0)
        scores = jax.lax.cond(biased, bias, lambda s: s, scores)
    rewarded = settings.encoder_repetition_penalty
    reward = encoder_repetition_penalty(rewarded)
    scores = jax.lax.cond(
        jnp.any(rewarded != 1.0), lambda s: reward(s, context), lambda s: s, scores
    )
    scores = repetition_penalty(settings.repetition_penalty)(scores, context)
    if settings.max_ngram:  # n-grams of the whole history, then of the prompt alone
        for sizes, ends in (
            (settings.no_repeat_ngram_size, lengths),
            (settings.encoder_no_repeat_ngram_size, prompt_lengths),
        ):

            def ban(scores, sizes=sizes, ends=ends):
                return ban_repeated_ngrams(
                    scores, tokens, lengths, sizes, settings.max_ngram, window_end=ends
                )

            scores = jax.lax.cond(jnp.any(sizes > 0), ban, lambda s: s, scores)
    ids = settings.eos_token_ids  # [B, E]
    is_eos = jnp.any(jnp.arange(vocab)[None, :, None] == ids[:, None, :], axis=-1)  # [B, V]
    blocked = is_eos & (num_new < settings.min_new_tokens)[:, None]
    scores = jnp.where(blocked, NEG_INF, scores)
    scores = _forcing_rules(scores, is_eos, num_new, settings)
    penalties = count_penalties(settings.presence_penalty, settings.frequency_penalty)
    active = jnp.any((settings.presence_penalty != 0) | (settings.frequency_penalty != 0))
    scores = jax.lax.cond(active, lambda s: penalties(s, context), lambda s: s, scores)
    renormalizing = jnp.any(settings.renormalize)
    greedy = highest(_renormalized(scores, settings.renormalize, renormalizing))

    def draw(scores):
        warp = chain(
            temperature(settings.temperature),
            top_h(settings.top_h),
            top_k(settings.top_k),
            top_p(settings.top_p),
            min_p(settings.min_p),
        )
        warped = warp(scores, context)
        # The truncation warpers after min_p, in transformers' order, only on steps where some
        # row uses one: each costs a softmax over V (typical_p also a partial sort).
        truncate = chain(
            typical_p(settings.typical_p),
            epsilon_cutoff(settings.epsilon_cutoff),
            eta_cutoff(settings.eta_cutoff),
        )
        truncating = jnp.any(
            (settings.typical_p < 1) | (settings.epsilon_cutoff > 0) | (settings.eta_cutoff > 0)
        )
        warped = jax.lax.cond(truncating, lambda s: truncate(s, context), lambda s: s, warped)
        warped = _renormalized(warped, settings.renormalize, renormalizing)
        keys = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(
            settings.seed, num_new
        )
        drawn = jax.vmap(sample_row)(keys, warped, settings.sample_row)
        return jnp.where(settings.do_sample, drawn, greedy)

    # The warpers and the draw (top-k and top-p sort the vocabulary: about 2.5 ms a step at
    # [8, 49152]) only on steps where some row samples.
    return jax.lax.cond(jnp.any(settings.do_sample), draw, lambda _: greedy, scores)


def _forcing_rules(scores: Array, is_eos: Array, num_new: Array, settings: RowSettings) -> Array:
    """transformers' forced BOS and EOS, invalid-value removal and exponential decay length
    penalty per row, in its order (after the EOS blocks), each under a ``lax.cond`` that skips it
    in steps where no row uses it.

    A forced token keeps 0 and every other token gets -inf: ``forced_first`` at the first new
    token (set on the host only for one-token prompts, where transformers' ``input_ids`` hold
    one token), ``forced_last`` at the last one (``input_ids`` one short of ``max_length``); the
    EOS forcing runs second, so it wins when both apply. The decay adds ``|s| * (factor**i - 1)``
    to each finite EOS score ``s`` once ``i = num_new - decay_start`` is positive.

    Args:
        scores: float32[B, V].
        is_eos: bool[B, V], each row's EOS ids.
        num_new: int32[B], new tokens so far.
        settings: the rows' :class:`RowSettings`.
    """
    vocab = scores.shape[-1]
    first = (num_new == 0) & (settings.forced_first >= 0)  # [B]
    last = (num_new == settings.max_new_tokens - 1) & jnp.any(settings.forced_last >= 0, axis=-1)

    def force(scores):
        ids = jnp.arange(vocab)[None, :]
        first_mask = ids == settings.forced_first[:, None]
        last_mask = jnp.any(ids[:, :, None] == settings.forced_last[:, None, :], axis=-1)
        forced = jnp.where(jnp.where(last[:, None], last_mask, first_mask), 0.0, NEG_INF)
        return jnp.where((first | last)[:, None], forced, scores)

    scores = jax.lax.cond(jnp.any(first | last), force, lambda s: s, scores)

    def finite(scores):
        info = jnp.finfo(scores.dtype)
        cleaned = jnp.nan_to_num(scores, nan=0.0, posinf=info.max, neginf=info.min)
        return jnp.where(settings.remove_invalid[:, None], cleaned, scores)

    scores = jax.lax.cond(jnp.any(settings.remove_invalid), finite, lambda s: s, scores)
    steps = num_new - settings.decay_start  # [B]

    def decay(scores):
        power = jnp.power(settings.decay_factor, steps.astype(jnp.float32))
        boosted = scores + jnp.abs(scores) * (power - 1.0)[:, None]
        boost = is_eos & jnp.isfinite(scores) & (steps > 0)[:, None]
        return jnp.where(boost, boosted, scores)

    return jax.lax.cond(jnp.any(settings.decay_factor != 1.0), decay, lambda s: s, scores)


def _renormalized(scores: Array, rows: Array, any_rows: Array) -> Array:
    """float32[B, V]: ``log_softmax`` of the rows with ``rows`` (bool[B]) set, the others as
    given; skipped (``lax.cond``) when ``any_rows`` is False."""

    def renormalize(scores):
        return jnp.where(rows[:, None], jax.nn.log_softmax(scores, axis=-1), scores)

    return jax.lax.cond(any_rows, renormalize, lambda s: s, scores)


def sequence_biases(
    tokens: Array, lengths: Array, num_new: Array, settings: RowSettings, vocab: int
) -> Array:
    """float32[B, V]: each row's bias table applied to its history.

    transformers' ``SequenceBiasLogitsProcessor`` (and ``NoBadWordsLogitsProcessor``, its -inf
    form) per row, with traced entries: entry ``k`` adds ``bias_values[b, k]`` to token
    ``bias_ids[b, k]`` when the history ends with the entry's prefix (none for a single token)
    and, as transformers skips a sequence longer than ``input_ids``, the history is longer than
    the prefix; an entry with ``bias_first_only`` (``begin_suppress_tokens``) only at the first
    new token. Biases of entries with the same token add up.

    Args:
        tokens: int32[B, S], the histories (valid up to ``lengths``).
        lengths: int32[B].
        num_new: int32[B], new tokens so far.
        settings: the rows' bias table (``bias_ids``, ``bias_values``, ``bias_prefixes``
            ``[B, L_b, W]``, ``bias_first_only``).
        vocab: ``V`` (static).
    """
    ids, prefixes = settings.bias_ids, settings.bias_prefixes
    live = (ids >= 0) & (~settings.bias_first_only | (num_new == 0)[:, None])  # [B, L_b]
    width = prefixes.shape[-1]
    if width:
        slots = lengths[:, None] - width + jnp.arange(width)[None, :]  # [B, W]: newest W
        recent = jnp.take_along_axis(tokens, jnp.clip(slots, 0, tokens.shape[1] - 1), axis=1)
        recent = jnp.where(slots >= 0, recent, -2)  # before the history: matches no id
        same = (prefixes == recent[:, None, :]) | (prefixes < 0)
        used = jnp.sum(prefixes >= 0, axis=-1)  # [B, L_b]: the prefix's length
        live &= jnp.all(same, axis=-1) & (used < lengths[:, None])
    rows = jnp.arange(ids.shape[0])[:, None]
    columns = jnp.where(live, ids, vocab)  # entries not applied fall out of range: dropped
    values = jnp.where(live, settings.bias_values, 0.0)
    zeros = jnp.zeros((ids.shape[0], vocab), jnp.float32)
    return zeros.at[rows, columns].add(values, mode="drop")


def ban_repeated_ngrams(
    scores: Array,
    tokens: Array,
    lengths: Array,
    sizes: Array,
    max_size: int,
    window_end: Array | None = None,
) -> Array:
    """transformers' ``NoRepeatNGramLogitsProcessor`` with a size per row: bans every token that
    would complete an n-gram already in the row's history (with ``window_end`` the prompt
    lengths, its ``EncoderNoRepeatNGramLogitsProcessor`` for a decoder-only model: n-grams of
    the prompt alone).

    Row ``b`` with ``n = sizes[b]`` (0: off) compares its newest ``n - 1`` tokens with every
    window ``tokens[b, i : i + n - 1]`` whose n-gram lies in the history (``i + n <=
    lengths[b]``) and sets the token after each matching window to -inf; ``n = 1`` bans every
    token present. The sizes are traced, so the comparisons run over ``max_size - 1`` offsets
    (static), those past ``n - 1`` counting as matches.

    Args:
        scores: float32[B, V].
        tokens: int32[B, S], the histories (valid up to ``lengths``).
        lengths: int32[B].
        sizes: int32[B], each row's n-gram size, at most ``max_size``.
        max_size: ``N`` (static).
        window_end: int32[B], where the compared n-grams must end (None: ``lengths``).

    Example:
        >>> scores = jnp.zeros((1, 4))
        >>> history = jnp.asarray([[1, 2, 1, 0]])  # "1 2 1": after "1", 2 would repeat "1 2"
        >>> ban_repeated_ngrams(scores, history, jnp.asarray([3]), jnp.asarray([2]), 4)[0, 2] < 0
        Array(True, dtype=bool)
    """
    batch, vocab = scores.shape
    slots = tokens.shape[1]
    starts = jnp.arange(slots)[None, :]  # [1, S]: window starts
    n = sizes[:, None]  # [B, 1]
    end = lengths if window_end is None else window_end
    match = (n > 0) & (starts + n <= end[:, None])  # [B, S]
    padded = jnp.pad(tokens, ((0, 0), (0, max_size)))
    for k in range(max_size - 1):
        newest = jnp.take_along_axis(
            tokens, jnp.clip(lengths - sizes + 1 + k, 0, slots - 1)[:, None], axis=1
        )
        match &= (k >= n - 1) | (padded[:, k : k + slots] == newest)
    following = jnp.take_along_axis(padded, starts + jnp.maximum(n - 1, 0), axis=1)  # [B, S]
    ids = jnp.where(match, jnp.clip(following, 0, vocab), vocab)  # vocab: a spare column
    banned = jnp.zeros((batch, vocab + 1), bool).at[jnp.arange(batch)[:, None], ids].set(True)
    return jnp.where(banned[:, :vocab], NEG_INF, scores)


def reached_end(token: Array, num_new: Array, settings: RowSettings) -> Array:
    """bool[B]: the row's newest token (``num_new`` counted) ends it: EOS or the length limit."""
    eos = jnp.any(token[:, None] == settings.eos_token_ids, axis=-1)
    return eos | (num_new >= settings.max_new_tokens)


def no_scores(batch: int, top: int) -> Scored:
    zeros = jnp.zeros((batch, top), jnp.float32)
    return Scored(jnp.zeros((batch,), jnp.float32), zeros.astype(jnp.int32), zeros)


@struct.dataclass
class Chosen:
    """What :func:`choose_rows` gives for each row."""

    token: Array  # int32[B]: the chosen token (the constraint's EOS where it refused it)
    done: Array  # bool[B]: the token ends a live row (EOS or the length limit)
    constraint_state: Array  # int32[B]: the automaton state after the token (-1: none)
    scored: Scored  # [B]: its log-probabilities


def choose_rows(
    logits: Array,
    tokens: Array,
    lengths: Array,
    prompt_lengths: Array,
    settings: RowSettings,
    constraint_state: Array,
    pool: CompressedTable | None,
    live: Array,
    top: int,
) -> Chosen:
    """Chooses the next token of every live row and everything that follows from it.

    Args:
        logits: float32[B, V], the model's raw logits at each row's last token.
        tokens: int32[B, S], each row's history (valid up to ``lengths``).
        lengths: int32[B], tokens in the history.
        prompt_lengths: int32[B], the request's prompt length.
        settings: the rows' :class:`RowSettings` ([B] each).
        constraint_state: int32[B], each row's pool state (-1: unconstrained).
        pool: the engine's constraint pool, or None when it has none (static).
        live: bool[B], rows choosing a token; the others keep their automaton state, end
            nothing and ask no log-probabilities.
        top: ``L`` (static), the most top log-probabilities any row may ask.
    """
    scores, state = logits.astype(jnp.float32), constraint_state
    if pool is not None:
        table = pool.replace(eos_token_id=settings.constraint_eos)
        rows = live & (state >= 0)
        any_rows = jnp.any(rows)

        def masked(scores):
            return mask_scores(scores, table, state, rows)

        scores = jax.lax.cond(any_rows, masked, lambda s: s, scores)
    token = choose_tokens(scores, tokens, lengths, prompt_lengths, settings)
    if pool is not None:
        token, state = jax.lax.cond(
            any_rows,
            lambda: advance_rows(table, state, token, rows),
            lambda: (token, state),
        )
    wanted = jnp.where(live, settings.logprobs, -1)
    scored = token_logprobs(logits, token, wanted, top)
    done = live & reached_end(token, lengths + 1 - prompt_lengths, settings)
    return Chosen(token=token, done=done, constraint_state=state, scored=scored)
