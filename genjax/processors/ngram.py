"""Processors that match token sequences in the buffer; re-exported by :mod:`genjax.processors`.

They read transformers' ``input_ids``, which is ``context.tokens[:, offset:length]``: the user's
prompt (with any left padding the user gave, pad tokens included, exactly as transformers scans
it), then the new tokens. genjax's own bucket padding before ``offset`` is never looked at. All
work is on the fixed buffer int32[B, S], with masks instead of data-dependent shapes.

References:
    Paulus et al. 2017, "A Deep Reinforced Model for Abstractive Summarization" (no-repeat
    n-grams), arXiv:1705.04304.
    Hugging Face transformers' ``NoRepeatNGramLogitsProcessor``, ``NoBadWordsLogitsProcessor`` and
    ``SequenceBiasLogitsProcessor`` define the semantics matched here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from genjax.processors.base import (
    NEG_INF,
    LogitsContext,
    Transform,
    as_int,
    check_id_list,
    check_id_lists,
    check_vocab,
)
from genjax.typing import Array


def _check_size(name: str, size: Any) -> int:
    if not isinstance(size, int | np.integer) or isinstance(size, bool) or size < 1:
        raise ValueError(
            f"{name}={size!r} is invalid: expected an int >= 1 (the n-gram length). "
            f"Use 0 in the generation config to disable it."
        )
    return int(size)


def no_repeat_ngram_size(size: int) -> Transform:
    """Bans every token that would complete an n-gram already present in ``input_ids``.

    For each row, the last ``size - 1`` tokens are compared with every earlier window of that
    length; the token that followed a matching window is set to -inf. ``size`` (static, >= 1)
    of 1 bans every token already present. Nothing is banned before ``input_ids`` holds ``size``
    tokens. Cost: O(B * S * size) compares and one scatter of B * S ids per call.

    Example:
        >>> process = no_repeat_ngram_size(3)

    References:
        Paulus et al. 2017, "A Deep Reinforced Model for Abstractive Summarization",
        arXiv:1705.04304.
    """
    size = _check_size("no_repeat_ngram_size", size)
    return Transform(_no_repeat_ngram, settings={"size": size, "prompt_only": False})


def encoder_no_repeat_ngram_size(size: int) -> Transform:
    """Bans every token that would complete an n-gram of the prompt (the "encoder input").

    For an encoder-decoder model the encoder input is the source (``context.encoder_tokens``:
    its n-grams, the source's own padding included, against the newest ``size - 1`` decoder
    tokens, once there are that many). For a decoder-only model transformers applies it with the
    prompt as the encoder input:
    the last ``size - 1`` tokens of ``input_ids`` (prompt and new tokens) are compared with every
    window of that length inside the user's prompt (slots ``offset`` to ``prompt_end``, the
    user's own left padding included; genjax's bucket padding excluded), and the prompt token
    that followed a matching window is set to -inf. n-grams of the new tokens alone do not count
    (that is :func:`no_repeat_ngram_size`). ``size`` (static, >= 1) of 1 bans every prompt token.
    Cost: O(B * S * size) compares and one scatter of B * S ids per call.

    Example:
        >>> process = encoder_no_repeat_ngram_size(3)

    References:
        Paulus et al. 2017, "A Deep Reinforced Model for Abstractive Summarization",
        arXiv:1705.04304; transformers' ``EncoderNoRepeatNGramLogitsProcessor``.
    """
    size = _check_size("encoder_no_repeat_ngram_size", size)
    return Transform(_no_repeat_ngram, settings={"size": size, "prompt_only": True})


def _no_repeat_ngram(scores: Array, context: LogitsContext, size: int, prompt_only: bool) -> Array:
    """Bans what followed earlier windows matching the newest ``size - 1`` tokens; the windows
    lie in ``input_ids`` (``tokens[offset:length]``), or in the prompt when ``prompt_only``."""
    if prompt_only and context.encoder_tokens is not None:
        return _source_ngram(scores, context, size)
    batch, vocab = scores.shape
    tokens = context.tokens
    windows = tokens.shape[1] - size + 1  # window starts 0 .. S - size
    if windows < 1:
        return scores
    starts = jnp.arange(windows)
    end = context.prompt_end if prompt_only else context.length
    match = jnp.broadcast_to((starts >= context.offset) & (starts + size <= end), (batch, windows))
    for k in range(size - 1):
        newest = jax.lax.dynamic_index_in_dim(
            tokens, context.length - size + 1 + k, axis=1, keepdims=True
        )
        match &= tokens[:, k : k + windows] == newest
    following = tokens[:, size - 1 : size - 1 + windows]
    ids = jnp.where(match, jnp.clip(following, 0, vocab), vocab)  # vocab: a spare column
    rows = jnp.arange(batch)[:, None]
    banned = jnp.zeros((batch, vocab + 1), bool).at[rows, ids].set(True)
    return jnp.where(banned[:, :vocab], NEG_INF, scores)


def _source_ngram(scores: Array, context: LogitsContext, size: int) -> Array:
    """:func:`encoder_no_repeat_ngram_size` over an encoder-decoder model's source ids
    ``context.encoder_tokens`` int32[B, Se] (-1: a slot genjax padded, never matched)."""
    batch, vocab = scores.shape
    source, tokens = context.encoder_tokens, context.tokens
    windows = source.shape[1] - size + 1
    if windows < 1:
        return scores
    # transformers finds no (size - 1)-gram to match before input_ids holds that many tokens.
    ready = context.length - context.offset >= size - 1
    match = jnp.broadcast_to(ready, (batch, windows))
    for k in range(size - 1):
        newest = jax.lax.dynamic_index_in_dim(
            tokens, context.length - size + 1 + k, axis=1, keepdims=True
        )
        match &= source[:, k : k + windows] == newest
    following = source[:, size - 1 : size - 1 + windows]
    ids = jnp.where(match & (following >= 0), jnp.clip(following, 0, vocab), vocab)
    rows = jnp.arange(batch)[:, None]
    banned = jnp.zeros((batch, vocab + 1), bool).at[rows, ids].set(True)
    return jnp.where(banned[:, :vocab], NEG_INF, scores)


def bias_pairs(sequence_bias: Any) -> list[tuple[tuple[int, ...], Any]]:
    """Validates transformers' two forms of ``sequence_bias``; returns (ids, bias) pairs.

    Accepted: a list of ``[token_ids, bias]`` pairs, or a dict ``{tuple(token_ids): bias}``. A
    later duplicate of a sequence replaces an earlier one, as in transformers.
    """
    example = "[[[5], -2.0], [[6, 7], 1.5]] or {(5,): -2.0, (6, 7): 1.5}"
    pairs = list(sequence_bias.items()) if isinstance(sequence_bias, Mapping) else sequence_bias
    if isinstance(pairs, str) or not isinstance(pairs, Sequence) or not pairs:
        raise ValueError(
            f"sequence_bias={sequence_bias!r} is invalid: expected a non-empty list of "
            f"[token_ids, bias] pairs or a dict of token-id tuples to biases, e.g. {example}."
        )
    out: dict[tuple[int, ...], Any] = {}
    for i, pair in enumerate(pairs):
        if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(
                f"sequence_bias entry {i} ({pair!r}) is invalid: each entry must be a pair "
                f"[token_ids, bias], e.g. {example}."
            )
        ids, bias = pair
        if isinstance(ids, int | np.integer):
            raise ValueError(
                f"sequence_bias entry {i} ({pair!r}) is invalid: token_ids must be a list of ids; "
                f"wrap the single id as [{ids}]."
            )
        ids = check_id_list(f"sequence_bias entry {i} token_ids", ids, allow_empty=False)
        if isinstance(bias, bool) or not (
            isinstance(bias, int | float | np.number) or isinstance(bias, jax.Array)
        ):
            raise ValueError(
                f"sequence_bias entry {i} ({pair!r}) is invalid: the bias must be a number, "
                f"e.g. -2.0."
            )
        out[ids] = bias
    return list(out.items())


class _SequenceTable:
    """Sequences to bias, split as transformers does: single tokens, and longer sequences whose
    last token is biased when the rest (the prefix) ends ``input_ids``.

    Built from the static token sequences only (cached per tuple of sequences); the biases, one
    per sequence in the given order, are passed to :meth:`bias`. Multi-token prefixes are stored
    right-aligned in one table int32[Q, L] (``L`` the longest prefix), with -1 in the unused slots
    on the left.
    """

    def __init__(self, sequences: tuple[tuple[int, ...], ...]):
        self.singles = [q for q, ids in enumerate(sequences) if len(ids) == 1]
        self.multi = [q for q, ids in enumerate(sequences) if len(ids) > 1]
        self.single_ids = np.asarray([sequences[q][0] for q in self.singles], np.int32)
        width = max((len(sequences[q]) - 1 for q in self.multi), default=0)
        self.prefixes = np.full((len(self.multi), width), -1, np.int32)
        for row, q in enumerate(self.multi):
            ids = sequences[q]
            self.prefixes[row, width - len(ids) + 1 :] = ids[:-1]
        self.prefix_lengths = np.asarray([len(sequences[q]) - 1 for q in self.multi], np.int32)
        self.last_ids = np.asarray([sequences[q][-1] for q in self.multi], np.int32)
        self.all_ids = sorted({i for ids in sequences for i in ids})

    def bias(self, batch: int, vocab: int, context: Any, values: Array) -> Array:
        """float32[B, V]: the bias to add, given one bias per sequence float32[Q]."""
        check_vocab("the biased token sequences", self.all_ids, vocab)
        single_values = values[np.asarray(self.singles, np.int32)]
        bias = jnp.zeros((vocab,), jnp.float32).at[self.single_ids].set(single_values)
        bias = jnp.broadcast_to(bias, (batch, vocab))
        if not len(self.last_ids):
            return bias
        width = self.prefixes.shape[1]
        slots = jnp.clip(context.length - width + jnp.arange(width), 0, context.tokens.shape[1] - 1)
        recent = jnp.take(context.tokens, slots, axis=1)  # int32[B, L]: the newest L tokens
        unused = self.prefixes < 0
        same = (recent[:, None, :] == self.prefixes[None]) | unused[None]
        fits = self.prefix_lengths <= context.length - context.offset  # prefix fits in input_ids
        matched = jnp.all(same, axis=-1) & fits[None]  # bool[B, Q]
        multi_values = values[np.asarray(self.multi, np.int32)]
        return bias.at[:, self.last_ids].add(jnp.where(matched, multi_values[None], 0.0))


_sequence_table = functools.lru_cache(maxsize=256)(_SequenceTable)


def sequence_bias(bias: Any) -> Transform:
    """Adds a bias to a token when it would complete one of the given token sequences.

    A one-token sequence's bias always applies; a longer sequence's bias applies to its last
    token when ``input_ids`` ends with the rest of it. Biases of several matching sequences with
    the same last token add up.

    Args:
        bias: transformers' form: a list of ``[token_ids, bias]`` pairs, or a dict
            ``{tuple(token_ids): bias}``. The token ids are static; a bias may be a Python number
            or a traced scalar.

    Cost: O(B * Q * L) compares (Q multi-token sequences, L the longest prefix) and a scatter-add
    of B * Q values per call.

    Example:
        >>> process = sequence_bias([[[5], -2.0], [[6, 7], 1.5]])
    """
    pairs = bias_pairs(bias)
    values = jnp.stack([jnp.asarray(b, jnp.float32).reshape(()) for _, b in pairs])
    sequences = tuple(ids for ids, _ in pairs)
    return Transform(_sequence_bias, {"biases": values}, {"sequences": sequences})


def _sequence_bias(
    scores: Array, context: LogitsContext, biases: Array, sequences: tuple[tuple[int, ...], ...]
) -> Array:
    batch, vocab = scores.shape
    table = _sequence_table(sequences)
    return scores + table.bias(batch, vocab, context, biases).astype(scores.dtype)


def logit_bias(token_ids: Any, biases: Any) -> Transform:
    """Adds ``biases[k]`` to the score of ``token_ids[k]``: OpenAI's ``logit_bias``.

    The traced counterpart of :func:`sequence_bias` with one-token sequences (the same sum, so
    the same scores): the ids are values, not structure, so each row (each request of the
    serving engine) may bias its own tokens without recompiling.

    Args:
        token_ids: int32[L] or int32[B, L] (traced); entries < 0 are unused. Ids within one row
            must be distinct.
        biases: float32[L] or float32[B, L] (traced), the same shape; OpenAI's range is
            ``[-100, 100]`` (-100 bans a token in practice, 100 forces it).

    Cost: one scatter-add of ``B * L`` values into ``[B, V]``.

    Example:
        >>> import jax.numpy as jnp
        >>> logit_bias([2, -1], [1.5, 0.0])(jnp.zeros((1, 3))).tolist()
        [[0.0, 0.0, 1.5]]
    """
    return Transform(
        _logit_bias, {"ids": as_int(token_ids), "biases": jnp.asarray(biases, jnp.float32)}
    )


def _logit_bias(scores: Array, context: Any, ids: Array, biases: Array) -> Array:
    batch, vocab = scores.shape
    ids = jnp.broadcast_to(ids, (batch, ids.shape[-1]))
    biases = jnp.broadcast_to(biases, ids.shape)
    columns = jnp.where(ids >= 0, ids, vocab)  # unused entries fall out of range: dropped
    rows = jnp.arange(batch)[:, None]
    bias = jnp.zeros((batch, vocab), jnp.float32).at[rows, columns].add(biases, mode="drop")
    return scores + bias.astype(scores.dtype)


def bad_words_ids(bad_words: Sequence[Sequence[int]], eos_token_ids: Any = None) -> Transform:
    """Forbids the given token sequences: their last token gets -inf when the rest ends the input.

    A one-token sequence is always forbidden, except one equal to an EOS id (as transformers
    drops ``[eos]`` from the list). Matching as in :func:`sequence_bias`.

    Args:
        bad_words: a non-empty list of non-empty token-id lists (static), e.g. ``[[5], [6, 7]]``.
        eos_token_ids: int[E] EOS ids (traced), or None.

    Cost: O(B * Q * L) compares (Q multi-token sequences, L the longest prefix) and a scatter-add
    of B * Q values per call.

    Example:
        >>> process = bad_words_ids([[5], [6, 7]], eos_token_ids=2)
    """
    sequences = tuple(dict.fromkeys(check_id_lists("bad_words_ids", bad_words)))
    return Transform(_bad_words, {"eos": as_int(eos_token_ids)}, {"sequences": sequences})


def _bad_words(
    scores: Array, context: LogitsContext, eos: Array | None, sequences: tuple[tuple[int, ...], ...]
) -> Array:
    batch, vocab = scores.shape
    values = jnp.full((len(sequences),), NEG_INF, jnp.float32)
    if eos is not None:
        # A one-token bad word equal to an EOS id is dropped (bias 0), as transformers does.
        single = np.asarray([len(ids) == 1 for ids in sequences])
        first = jnp.asarray([ids[0] for ids in sequences], jnp.int32)
        is_eos = jnp.any(first[:, None] == jnp.atleast_1d(eos)[None, :], axis=-1)
        values = jnp.where(single & is_eos, 0.0, values)
    table = _sequence_table(sequences)
    return scores + table.bias(batch, vocab, context, values).astype(scores.dtype)
