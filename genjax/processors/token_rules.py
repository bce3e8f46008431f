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
    Processor,
    check_id_list,
    is_concrete,
    per_row,
    row_token_mask,
    token_mask,
)
from genjax.typing import Array


def repetition_penalty(penalty: float | Array) -> Processor:
    """Penalizes every token id already in a row's input: divides positive scores by ``penalty``
    and multiplies negative ones, once per distinct token.

    As in transformers v5, left padding (slots before ``first_valid``) is ignored. ``penalty``
    traced, scalar or float[B]. Cost: one scatter of the ``B * S`` buffer into a ``[B, V]`` mask.

    Example:
        >>> process = repetition_penalty(1.2)

    References:
        Keskar et al. 2019, "CTRL: A Conditional Transformer Language Model".
    """

    def apply(scores: Array, context: LogitsContext) -> Array:
        batch, vocab = scores.shape
        slots = jnp.arange(context.tokens.shape[1])[None, :]
        counted = (slots >= context.first_valid[:, None]) & (slots < context.length)
        # Ids that do not count go to an extra column, dropped after the scatter.
        ids = jnp.where(counted, jnp.clip(context.tokens, 0, vocab), vocab)
        seen = jnp.zeros((batch, vocab + 1), bool).at[jnp.arange(batch)[:, None], ids].set(True)
        strength = per_row(penalty).astype(scores.dtype)
        penalized = jnp.where(scores < 0, scores * strength, scores / strength)
        return jnp.where(seen[:, :vocab], penalized, scores)

    return apply


def min_length(length: int | Array, eos_token_ids: int | Array) -> Processor:
    """Forbids EOS while transformers' ``input_ids`` (prompt plus new tokens) is shorter than
    ``length``. Cost: O(V * E) compares.

    Example:
        >>> process = min_length(20, eos_token_ids=2)
    """

    def apply(scores: Array, context: LogitsContext) -> Array:
        blocked = token_mask(eos_token_ids, scores.shape[-1]) & (context.input_length < length)
        return jnp.where(blocked, NEG_INF, scores)

    return apply


def min_new_tokens(count: int | Array, eos_token_ids: int | Array) -> Processor:
    """Forbids EOS until ``count`` new tokens have been generated. Cost: O(V * E) compares.

    Example:
        >>> process = min_new_tokens(5, eos_token_ids=2)
    """

    def apply(scores: Array, context: LogitsContext) -> Array:
        blocked = token_mask(eos_token_ids, scores.shape[-1]) & (context.num_new_tokens < count)
        return jnp.where(blocked, NEG_INF, scores)

    return apply


def allowed_tokens(fn: Callable[[Array, Array], Array], group_size: int = 1) -> Processor:
    """Restricts each row to the tokens ``fn`` allows: a jittable ``prefix_allowed_tokens_fn``.

    Disallowed tokens get -inf; allowed ones keep their score. When every allowed token of every
    row of a group (``group_size`` consecutive rows: transformers' beams or return sequences of
    one prompt) already scores -inf, those rows get 0 on their allowed tokens instead, so the
    constraint still holds.

    Args:
        fn: ``fn(tokens int32[B, S], length int32[]) -> bool[B, V]``, True where a token is
            allowed next. ``tokens`` is the whole buffer: slots ``[0, length)`` are filled, the
            newest token is ``tokens[:, length - 1]``, and genjax's bucket padding (pad ids) may
            precede the prompt. It must be jittable; it is static (pass the same function to
            reuse a compiled program). Unlike transformers, which raises, a row with no allowed
            token ends up all -inf.
        group_size: rows per prompt (static), ``max(num_beams, num_return_sequences)``.

    Cost: whatever ``fn`` costs, plus O(B * V).

    Example:
        >>> process = allowed_tokens(lambda tokens, length: jnp.ones((tokens.shape[0], 128), bool))
    """

    def apply(scores: Array, context: LogitsContext) -> Array:
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

    return apply


def forced_bos_token_id(token_id: int | Array) -> Processor:
    """Forces ``token_id`` when ``input_ids`` holds exactly one token (the first new token after
    a one-token prompt): every other score becomes -inf and the forced one 0.

    ``token_id`` traced, scalar or int[B]. Cost: O(B * V).

    Example:
        >>> process = forced_bos_token_id(0)
    """

    def apply(scores: Array, context: LogitsContext) -> Array:
        forced = jnp.where(row_token_mask(token_id, scores.shape[-1]), 0.0, NEG_INF)
        return jnp.where(context.input_length == 1, forced.astype(scores.dtype), scores)

    return apply


def forced_eos_token_id(token_ids: int | Array, max_length: int | Array | None = None) -> Processor:
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

    def apply(scores: Array, context: LogitsContext) -> Array:
        limit = context.max_input_length if max_length is None else max_length
        forced = jnp.where(token_mask(token_ids, scores.shape[-1]), 0.0, NEG_INF)
        return jnp.where(context.input_length == limit - 1, forced.astype(scores.dtype), scores)

    return apply


def remove_invalid_values() -> Processor:
    """Replaces NaN by 0, +inf by the largest float and -inf by the smallest. Cost: O(B * V).

    Example:
        >>> process = remove_invalid_values()
    """

    def apply(scores: Array, context: LogitsContext) -> Array:
        info = jnp.finfo(scores.dtype)
        return jnp.nan_to_num(scores, nan=0.0, posinf=info.max, neginf=info.min)

    return apply


def exponential_decay_length_penalty(
    start: int | Array, factor: float | Array, eos_token_ids: int | Array
) -> Processor:
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

    def apply(scores: Array, context: LogitsContext) -> Array:
        steps = context.input_length - (start + context.prompt_length)
        growth = jnp.power(per_row(factor).astype(jnp.float32), steps.astype(jnp.float32)) - 1.0
        boosted = scores + (jnp.abs(scores) * growth).astype(scores.dtype)
        eos = token_mask(eos_token_ids, scores.shape[-1])
        return jnp.where(eos & jnp.isfinite(scores) & (steps > 0), boosted, scores)

    return apply


def _checked_ids(name: str, token_ids) -> Array:
    """An int32[K] array of ``token_ids``; a concrete list is checked first."""
    if is_concrete(token_ids) and not hasattr(token_ids, "shape"):
        token_ids = check_id_list(name, token_ids)
    return jnp.asarray(token_ids, jnp.int32).reshape(-1)


def suppress_tokens(token_ids: Sequence[int] | Array) -> Processor:
    """Sets the scores of ``token_ids`` (a list, or int[K] traced) to -inf. Cost: O(V * K).

    Example:
        >>> process = suppress_tokens([7, 9])
    """
    ids = _checked_ids("suppress_tokens", token_ids)

    def apply(scores: Array, context: LogitsContext) -> Array:
        return jnp.where(token_mask(ids, scores.shape[-1]), NEG_INF, scores)

    return apply


def begin_suppress_tokens(
    token_ids: Sequence[int] | Array,
    begin_index: int | Array | None = None,
    *,
    forced_bos: bool = False,
) -> Processor:
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
    ids = _checked_ids("begin_suppress_tokens", token_ids)

    def apply(scores: Array, context: LogitsContext) -> Array:
        begin = begin_index
        if begin is None:
            begin = context.prompt_length
            if forced_bos:
                begin = begin + (context.prompt_length == 1).astype(jnp.int32)
        suppressed = token_mask(ids, scores.shape[-1]) & (context.input_length == begin)
        return jnp.where(suppressed, NEG_INF, scores)

    return apply


def renormalize_logits() -> Processor:
    """Turns the scores into log-probabilities (``log_softmax``); transformers runs it last.
    Cost: O(B * V).

    Example:
        >>> process = renormalize_logits()
    """
    return lambda scores, context: jax.nn.log_softmax(scores, axis=-1)
