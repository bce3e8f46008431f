"""Processors that apply rules on token ids and lengths; re-exported by :mod:`genjax.processors`.

Each reads the :class:`~genjax.processors.LogitsContext` it is given: transformers' ``input_ids``
are ``context.tokens[:, offset:length]``, its ``input_ids_seq_length`` is
``context.prompt_length`` and its ``max_length`` is ``context.max_input_length``.

References:
    Keskar et al. 2019, "CTRL: A Conditional Transformer Language Model" (repetition penalty).
    Hugging Face transformers' ``generation/logits_process.py`` defines the semantics matched here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from genjax.processors.base import (
    NEG_INF,
    LogitsContext,
    Transform,
    as_count,
    as_float,
    as_int,
    check_id_list,
    is_concrete,
    per_row,
    row_token_mask,
    token_mask,
)
from genjax.typing import Array


def repetition_penalty(penalty: float | Array) -> Transform:
    """Penalizes every token id already in a row's input: divides positive scores by ``penalty``
    and multiplies negative ones, once per distinct token.

    As in transformers v5, left padding (slots before ``first_valid``) is ignored. ``penalty``
    traced, scalar or float[B]. Cost: one scatter of the ``B * S`` buffer into a ``[B, V]`` mask.

    Example:
        >>> process = repetition_penalty(1.2)

    References:
        Keskar et al. 2019, "CTRL: A Conditional Transformer Language Model".
    """
    return Transform(_repetition_penalty, {"penalty": as_float(penalty)})


def _seen_tokens(tokens: Array, counted: Array, vocab: int) -> Array:
    """bool[B, V]: True at each id of ``tokens`` int32[B, S] in a ``counted`` bool[B, S] slot."""
    batch = tokens.shape[0]
    # Ids that do not count go to an extra column, dropped after the scatter.
    ids = jnp.where(counted, jnp.clip(tokens, 0, vocab), vocab)
    seen = jnp.zeros((batch, vocab + 1), bool).at[jnp.arange(batch)[:, None], ids].set(True)
    return seen[:, :vocab]


def _repetition_penalty(scores: Array, context: LogitsContext, penalty: Array) -> Array:
    slots = jnp.arange(context.tokens.shape[1])[None, :]
    counted = (slots >= context.first_valid[:, None]) & (slots < context.length)
    seen = _seen_tokens(context.tokens, counted, scores.shape[-1])
    strength = per_row(penalty).astype(scores.dtype)
    penalized = jnp.where(scores < 0, scores * strength, scores / strength)
    return jnp.where(seen, penalized, scores)


def count_penalties(presence: float | Array = 0.0, frequency: float | Array = 0.0) -> Transform:
    """OpenAI's additive penalties on the tokens generated so far (the prompt does not count).

    For each token ``t`` generated ``c[t]`` times so far in the row (slots ``prompt_end`` to
    ``length``)::

        score[t] -= presence * (c[t] > 0) + frequency * c[t]

    Positive values discourage repeats, negative ones encourage them; OpenAI and vLLM accept
    ``[-2, 2]``. Both strengths are traced, scalar or float[B]. Cost: one scatter-add of the
    ``B * S`` buffer into ``[B, V]`` counts (the two penalties share it).

    Example:
        >>> import jax.numpy as jnp
        >>> ctx = LogitsContext.for_prompt(jnp.asarray([[2, 1, 1]], jnp.int32))
        >>> ctx = ctx.replace(prompt_end=jnp.asarray(1, jnp.int32))  # slots 1, 2 are new
        >>> count_penalties(presence=0.5, frequency=0.25)(jnp.zeros((1, 3)), ctx).tolist()
        [[0.0, -1.0, 0.0]]

    References:
        OpenAI, "Parameter details: frequency and presence penalties" (API reference); vLLM's
        ``apply_penalties`` (counts over output tokens only).
    """
    values = {"presence": as_float(presence), "frequency": as_float(frequency)}
    return Transform(_count_penalties, values)


def presence_penalty(penalty: float | Array) -> Transform:
    """Subtracts ``penalty`` from every token already generated (prompt excluded), once.

    OpenAI's ``presence_penalty``: :func:`count_penalties` with ``frequency=0``. Traced, scalar or
    float[B]. Cost: one scatter-add of the ``B * S`` buffer.

    Example:
        >>> process = presence_penalty(0.6)
    """
    return count_penalties(presence=penalty)


def frequency_penalty(penalty: float | Array) -> Transform:
    """Subtracts ``penalty`` times the number of times each token was generated (prompt
    excluded).

    OpenAI's ``frequency_penalty``: :func:`count_penalties` with ``presence=0``. Traced, scalar
    or float[B]. Cost: one scatter-add of the ``B * S`` buffer.

    Example:
        >>> process = frequency_penalty(0.6)
    """
    return count_penalties(frequency=penalty)


def _count_penalties(
    scores: Array, context: LogitsContext, presence: Array, frequency: Array
) -> Array:
    batch, vocab = scores.shape
    tokens = context.tokens
    slots = jnp.arange(tokens.shape[1])[None, :]
    # prompt_end and length may be scalars or per row [B, 1] (the serving engine's rows).
    counted = (slots >= context.prompt_end) & (slots < context.length)
    ids = jnp.where(counted, jnp.clip(tokens, 0, vocab), vocab)  # vocab: a spare column
    rows = jnp.arange(batch)[:, None]
    counts = jnp.zeros((batch, vocab + 1), jnp.float32).at[rows, ids].add(1.0)[:, :vocab]
    penalty = per_row(presence) * (counts > 0) + per_row(frequency) * counts
    return scores - penalty.astype(scores.dtype)


def encoder_repetition_penalty(penalty: float | Array) -> Transform:
    """Rewards every token id of the prompt: the inverse of :func:`repetition_penalty`.

    For an encoder-decoder model the encoder input is the source (``context.encoder_tokens``).
    For a decoder-only model transformers applies it with the prompt as the "encoder input":
    each score of a token in the user's ``input_ids`` (slots ``offset`` to ``prompt_end``; the
    user's own left padding included, as transformers gathers the whole prompt; genjax's bucket
    padding excluded) is multiplied by ``penalty`` when positive and divided by it when negative,
    so ``penalty > 1`` makes the prompt's tokens more likely. New tokens do not count.
    ``penalty`` traced, scalar or float[B]. Cost: one scatter of the ``B * S`` buffer into a
    ``[B, V]`` mask.

    Example:
        >>> process = encoder_repetition_penalty(1.5)

    References:
        Keskar et al. 2019, "CTRL: A Conditional Transformer Language Model" (the penalty it
        inverts); transformers' ``EncoderRepetitionPenaltyLogitsProcessor``.
    """
    return Transform(_encoder_repetition_penalty, {"penalty": as_float(penalty)})


def _encoder_repetition_penalty(scores: Array, context: LogitsContext, penalty: Array) -> Array:
    if context.encoder_tokens is not None:  # an encoder-decoder model's source ids
        source = context.encoder_tokens
        seen = _seen_tokens(source, source >= 0, scores.shape[-1])
    else:
        slots = jnp.arange(context.tokens.shape[1])[None, :]
        counted = (slots >= context.offset) & (slots < context.prompt_end)
        seen = _seen_tokens(context.tokens, counted, scores.shape[-1])
    # transformers stores 1 / penalty and multiplies negative scores by it, divides others.
    inverse = (1.0 / per_row(penalty)).astype(scores.dtype)
    rewarded = jnp.where(scores < 0, scores * inverse, scores / inverse)
    return jnp.where(seen, rewarded, scores)


def min_length(length: int | Array, eos_token_ids: int | Array) -> Transform:
    """Forbids EOS while transformers' ``input_ids`` (prompt plus new tokens) is shorter than
    ``length``. Cost: O(V * E) compares.

    Example:
        >>> process = min_length(20, eos_token_ids=2)
    """
    return Transform(_min_length, {"length": as_count(length), "eos": as_int(eos_token_ids)})


def _min_length(scores: Array, context: LogitsContext, length: Array, eos: Array) -> Array:
    blocked = token_mask(eos, scores.shape[-1]) & (context.input_length < length)
    return jnp.where(blocked, NEG_INF, scores)


def min_new_tokens(count: int | Array, eos_token_ids: int | Array) -> Transform:
    """Forbids EOS until ``count`` new tokens have been generated. Cost: O(V * E) compares.

    Example:
        >>> process = min_new_tokens(5, eos_token_ids=2)
    """
    return Transform(_min_new_tokens, {"count": as_count(count), "eos": as_int(eos_token_ids)})


def _min_new_tokens(scores: Array, context: LogitsContext, count: Array, eos: Array) -> Array:
    blocked = token_mask(eos, scores.shape[-1]) & (context.num_new_tokens < count)
    return jnp.where(blocked, NEG_INF, scores)


def allowed_tokens(fn: Callable[[Array, Array], Array], group_size: int = 1) -> Transform:
    """Restricts each row to the tokens ``fn`` allows: a jittable ``prefix_allowed_tokens_fn``.

    Disallowed tokens get -inf; allowed ones keep their score. When every allowed token of every
    row of a group (``group_size`` consecutive rows: transformers' beams or return sequences of
    one prompt) already scores -inf, those rows get 0 on their allowed tokens instead, so the
    constraint still holds.

    Args:
        fn: ``fn(tokens int32[B, S], length int32[]) -> bool[B, V]``, True where a token is
            allowed next. ``tokens`` is the whole buffer: slots ``[0, length)`` are filled, the
            newest token is ``tokens[:, length - 1]``, and genjax's bucket padding (pad ids) may
            precede the prompt. It must be jittable; it is static (pass the same function to reuse a
            compiled program: it is part of the processor's tree structure). Unlike transformers,
            which raises, a row with no allowed token ends up all -inf.
        group_size: rows per prompt (static), ``max(num_beams, num_return_sequences)``.

    Cost: whatever ``fn`` costs, plus O(B * V).

    Example:
        >>> process = allowed_tokens(lambda tokens, length: jnp.ones((tokens.shape[0], 128), bool))
    """
    return Transform(_allowed_tokens, settings={"fn": fn, "group_size": int(group_size)})


def _allowed_tokens(scores: Array, context: LogitsContext, fn: Callable, group_size: int) -> Array:
    allowed = jnp.asarray(fn(context.tokens, context.length))
    if allowed.shape != scores.shape:
        raise ValueError(
            f"allowed_tokens: fn(tokens, length) must return a bool mask of shape "
            f"[batch, vocab] = {tuple(scores.shape)}; got shape {tuple(allowed.shape)}."
        )
    mask = jnp.where(allowed.astype(bool), 0.0, NEG_INF).astype(scores.dtype)
    masked = scores + mask
    if scores.shape[0] % group_size:
        raise ValueError(
            f"allowed_tokens: group_size={group_size} does not divide the batch of "
            f"{scores.shape[0]} rows; pass the number of rows per prompt."
        )
    dead = jnp.all(jnp.isneginf(jnp.max(masked, -1)).reshape(-1, group_size), axis=-1)
    return jnp.where(jnp.repeat(dead, group_size)[:, None], mask, masked)


def forced_bos_token_id(token_id: int | Array) -> Transform:
    """Forces ``token_id`` when ``input_ids`` holds exactly one token (the first new token after
    a one-token prompt): every other score becomes -inf and the forced one 0.

    ``token_id`` traced, scalar or int[B]. Cost: O(B * V).

    Example:
        >>> process = forced_bos_token_id(0)
    """
    return Transform(_forced_bos_token_id, {"token_id": as_int(token_id)})


def _forced_bos_token_id(scores: Array, context: LogitsContext, token_id: Array) -> Array:
    forced = jnp.where(row_token_mask(token_id, scores.shape[-1]), 0.0, NEG_INF)
    return jnp.where(context.input_length == 1, forced.astype(scores.dtype), scores)


def forced_eos_token_id(token_ids: int | Array, max_length: int | Array | None = None) -> Transform:
    """Forces EOS as the last token: when ``input_ids`` is one short of ``max_length``, every
    score but the ``token_ids``' becomes -inf and theirs 0.

    Args:
        token_ids: an id or a list of ids int[E] (traced).
        max_length: transformers' ``max_length`` (prompt plus new tokens; traced); None reads it
            from the context (:attr:`LogitsContext.max_input_length`, the buffer's end).

    Cost: O(B * V).

    Example:
        >>> process = forced_eos_token_id(2)
    """
    values = {"token_ids": as_int(token_ids), "max_length": as_int(max_length)}
    return Transform(_forced_eos_token_id, values)


def _forced_eos_token_id(
    scores: Array, context: LogitsContext, token_ids: Array, max_length: Array | None
) -> Array:
    limit = context.max_input_length if max_length is None else max_length
    forced = jnp.where(token_mask(token_ids, scores.shape[-1]), 0.0, NEG_INF)
    return jnp.where(context.input_length == limit - 1, forced.astype(scores.dtype), scores)


def remove_invalid_values() -> Transform:
    """Replaces NaN by 0, +inf by the largest float and -inf by the smallest. Cost: O(B * V).

    Example:
        >>> process = remove_invalid_values()
    """
    return Transform(_remove_invalid_values)


def _remove_invalid_values(scores: Array, context: LogitsContext) -> Array:
    info = jnp.finfo(scores.dtype)
    return jnp.nan_to_num(scores, nan=0.0, posinf=info.max, neginf=info.min)


def exponential_decay_length_penalty(
    start: int | Array, factor: float | Array, eos_token_ids: int | Array
) -> Transform:
    """Raises the EOS scores exponentially once ``start`` new tokens have been generated.

    After ``input_ids`` grows beyond ``prompt length + start`` by ``i`` tokens, each finite EOS
    score ``s`` becomes ``s + |s| * (factor**i - 1)``.

    Args:
        start: new tokens before the penalty starts (traced).
        factor: the decay factor, > 1 to favour EOS (traced, scalar or float[B]).
        eos_token_ids: an id or int[E] (traced).

    Cost: O(B * V).

    Example:
        >>> process = exponential_decay_length_penalty(10, 1.05, eos_token_ids=2)
    """
    values = {"start": as_count(start), "factor": as_float(factor), "eos": as_int(eos_token_ids)}
    return Transform(_exponential_decay_length_penalty, values)


def _exponential_decay_length_penalty(
    scores: Array, context: LogitsContext, start: Array, factor: Array, eos: Array
) -> Array:
    steps = context.input_length - (start + context.prompt_length)
    growth = jnp.power(per_row(factor).astype(jnp.float32), steps.astype(jnp.float32)) - 1.0
    boosted = scores + (jnp.abs(scores) * growth).astype(scores.dtype)
    is_eos = token_mask(eos, scores.shape[-1])
    return jnp.where(is_eos & jnp.isfinite(scores) & (steps > 0), boosted, scores)


def _checked_ids(name: str, token_ids) -> Array:
    """An int32[K] array of ``token_ids``; a concrete list is checked first."""
    if is_concrete(token_ids) and not hasattr(token_ids, "shape"):
        token_ids = check_id_list(name, token_ids)
    return jnp.asarray(token_ids, jnp.int32).reshape(-1)


def suppress_tokens(token_ids: Sequence[int] | Array) -> Transform:
    """Sets the scores of ``token_ids`` (a list, or int[K] traced) to -inf. Cost: O(V * K).

    Example:
        >>> process = suppress_tokens([7, 9])
    """
    return Transform(_suppress_tokens, {"ids": _checked_ids("suppress_tokens", token_ids)})


def _suppress_tokens(scores: Array, context: LogitsContext, ids: Array) -> Array:
    return jnp.where(token_mask(ids, scores.shape[-1]), NEG_INF, scores)


def begin_suppress_tokens(
    token_ids: Sequence[int] | Array,
    begin_index: int | Array | None = None,
    *,
    forced_bos: bool = False,
) -> Transform:
    """Sets the scores of ``token_ids`` to -inf at one step: when ``input_ids`` holds
    ``begin_index`` tokens.

    Args:
        token_ids: a list of ids, or int[K] (traced).
        begin_index: the ``input_ids`` length at which to suppress (traced). None is
            transformers' rule: the prompt length (the first new token), or one more when the
            prompt is a single token and a forced BOS token comes first (``forced_bos``).
        forced_bos: whether :func:`forced_bos_token_id` runs too (static; see ``begin_index``).

    Cost: O(V * K).

    Example:
        >>> process = begin_suppress_tokens([220, 50256])
    """
    values = {
        "ids": _checked_ids("begin_suppress_tokens", token_ids),
        "begin_index": as_int(begin_index),
    }
    return Transform(_begin_suppress_tokens, values, {"forced_bos": bool(forced_bos)})


def _begin_suppress_tokens(
    scores: Array, context: LogitsContext, ids: Array, begin_index: Array | None, forced_bos: bool
) -> Array:
    begin = begin_index
    if begin is None:
        begin = context.prompt_length
        if forced_bos:
            begin = begin + (context.prompt_length == 1).astype(jnp.int32)
    suppressed = token_mask(ids, scores.shape[-1]) & (context.input_length == begin)
    return jnp.where(suppressed, NEG_INF, scores)


def renormalize_logits() -> Transform:
    """Turns the scores into log-probabilities (``log_softmax``); transformers runs it last.
    Cost: O(B * V).

    Example:
        >>> process = renormalize_logits()
    """
    return Transform(_renormalize_logits)


def _renormalize_logits(scores: Array, context: LogitsContext) -> Array:
    return jax.nn.log_softmax(scores, axis=-1)
