"""Logits processors: small factories that return pure, jittable transforms of next-token scores.

A processor is a function ``(scores, context) -> scores`` on float32[B, V] scores, where
``context`` is a :class:`LogitsContext` describing the token buffer. Factories close over their
settings (optax-style); :func:`chain` composes processors left to right; :func:`from_config` builds
the chain transformers' ``generate`` would build from a :class:`~genjax.GenerationConfig`, in the
same order, using only the primitives in this module.

Static or traced:
    Settings such as ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty`` and
    token ids may be Python numbers or traced arrays, scalars or one value per row (``[B]``);
    changing them never recompiles. Which processors are in a chain, and ``min_tokens_to_keep``,
    are static (they shape the program).

Example:
    >>> import jax.numpy as jnp
    >>> from genjax import processors
    >>> warp = processors.chain(processors.temperature(0.7), processors.top_k(2))
    >>> ctx = processors.LogitsContext.for_prompt(jnp.zeros((1, 3), jnp.int32))
    >>> warp(jnp.array([[1.0, 3.0, 2.0, 0.0]]), ctx).tolist()
    [[-inf, 4.285714149475342, 2.857142925262451, -inf]]

References:
    Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration" (top-p).
    Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling for Creative and Coherent LLM Outputs".
    Keskar et al. 2019, "CTRL: A Conditional Transformer Language Model" (repetition penalty).
    Hugging Face transformers' ``generation/logits_process.py`` defines the semantics matched here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from genjax.errors import UnsupportedError
from genjax.typing import Array

NEG_INF = -jnp.inf


@struct.dataclass
class LogitsContext:
    """What a processor may look at besides the scores: the token buffer and its bookkeeping.

    The buffer holds, per row, optional extra left padding added by genjax (``offset`` slots,
    e.g. to reach a prompt-length bucket), then the ``input_ids`` the user gave (themselves
    possibly left-padded), then generated tokens. Transformers' processors see
    ``tokens[:, offset:length]`` as their ``input_ids``::

        slot     0   1   2   3   4   5   6   7   8
        row 0    .   .   p   a   b   c   x   y   _      offset = 2 (genjax padding)
        row 1    .   .   d   e   f   g   z   w   _      prompt_end = 6, length = 8
                         |<- user input_ids ->|  new     first_valid = [3, 2]
    """

    tokens: Array  # int32[B, S]: the token buffer
    length: Array  # int32[]: slots filled so far; the next token goes to slot `length`
    offset: Array  # int32[]: slots of genjax padding before the user's input_ids
    prompt_end: Array  # int32[]: the slot where new tokens start
    first_valid: Array  # int32[B]: each row's first slot holding a real (unpadded) token

    @classmethod
    def for_prompt(cls, input_ids: Array, attention_mask: Array | None = None) -> LogitsContext:
        """Returns the context before the first new token, for ``input_ids`` int32[B, P]."""
        batch, prompt_length = input_ids.shape
        if attention_mask is None:
            first_valid = jnp.zeros((batch,), jnp.int32)
        else:
            first_valid = jnp.argmax(attention_mask != 0, axis=-1).astype(jnp.int32)
        return cls(
            tokens=jnp.asarray(input_ids, jnp.int32),
            length=jnp.asarray(prompt_length, jnp.int32),
            offset=jnp.zeros((), jnp.int32),
            prompt_end=jnp.asarray(prompt_length, jnp.int32),
            first_valid=first_valid,
        )

    @property
    def input_length(self) -> Array:
        """int32[]: the length of transformers' ``input_ids`` (user prompt plus new tokens)."""
        return self.length - self.offset

    @property
    def num_new_tokens(self) -> Array:
        """int32[]: tokens generated so far."""
        return self.length - self.prompt_end


Processor = Callable[[Array, LogitsContext], Array]


def _per_row(value: float | Array) -> Array:
    """A scalar stays a scalar; a per-row value float[B] becomes float[B, 1] to broadcast on V."""
    value = jnp.asarray(value)
    return value[:, None] if value.ndim == 1 else value


def chain(*processors: Processor) -> Processor:
    """Composes processors, applying them left to right.

    Example:
        >>> process = chain(temperature(0.5), top_p(0.9))
    """

    def apply(scores: Array, context: LogitsContext) -> Array:
        for processor in processors:
            scores = processor(scores, context)
        return scores

    return apply


def identity() -> Processor:
    """The processor that changes nothing."""
    return lambda scores, context: scores


def temperature(value: float | Array) -> Processor:
    """Divides the scores by ``value`` (> 0; scalar or float[B]).

    Example:
        >>> warp = temperature(0.7)
    """

    def apply(scores: Array, context: LogitsContext) -> Array:
        return scores / _per_row(value).astype(scores.dtype)

    return apply


def _sorted_descending(scores: Array) -> Array:
    """float[B, V] sorted along V from largest to smallest. Costs one sort of the vocabulary."""
    return -jnp.sort(-scores, axis=-1)


def top_k(k: int | Array, min_tokens_to_keep: int = 1) -> Processor:
    """Keeps the ``k`` highest scores per row (ties with the k-th kept too); sets others to -inf.

    ``k`` may be traced (scalar or int[B]); ``k = 0`` keeps everything, as the disabled
    processor would. Values above the vocabulary size keep everything. Cost: one sort of the
    vocabulary per call.

    Example:
        >>> warp = top_k(50)
    """

    def apply(scores: Array, context: LogitsContext) -> Array:
        vocab = scores.shape[-1]
        kk = jnp.asarray(k, jnp.int32)
        kk = jnp.where(kk <= 0, vocab, jnp.maximum(kk, min_tokens_to_keep))
        kk = jnp.broadcast_to(jnp.minimum(kk, vocab), scores.shape[:-1])
        kth = jnp.take_along_axis(_sorted_descending(scores), (kk - 1)[:, None], axis=-1)
        return jnp.where(scores < kth, NEG_INF, scores)

    return apply


def top_p(p: float | Array, min_tokens_to_keep: int = 1) -> Processor:
    """Nucleus filtering: keeps the smallest set of top tokens whose probability reaches ``p``.

    As in transformers, tokens are sorted from least to most likely, and a token is dropped when
    the cumulative probability up to and including it is ``<= 1 - p``; the ``min_tokens_to_keep``
    most likely always stay. ``p = 1`` keeps everything. Ties with the least likely kept token are
    kept too (transformers breaks such ties by sort order). Cost: one sort of the vocabulary.

    Example:
        >>> warp = top_p(0.9)
    """

    def apply(scores: Array, context: LogitsContext) -> Array:
        ascending = jnp.sort(scores, axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
        removed = cumulative <= 1.0 - _per_row(p)
        removed = removed.at[..., -min_tokens_to_keep:].set(False)
        # The smallest kept score; `removed` is True on a prefix of the ascending order.
        first_kept = jnp.sum(removed, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(ascending, first_kept, axis=-1)
        return jnp.where(scores < threshold, NEG_INF, scores)

    return apply


def min_p(p: float | Array, min_tokens_to_keep: int = 1) -> Processor:
    """Drops tokens whose probability is below ``p`` times the most likely token's probability.

    Example:
        >>> warp = min_p(0.05)
    """

    def apply(scores: Array, context: LogitsContext) -> Array:
        probs = jax.nn.softmax(scores, axis=-1)
        removed = probs < _per_row(p) * jnp.max(probs, axis=-1, keepdims=True)
        if min_tokens_to_keep > 1:
            _, keep = jax.lax.top_k(probs, min(min_tokens_to_keep, scores.shape[-1]))
            rows = jnp.arange(scores.shape[0])[:, None]
            removed = removed.at[rows, keep].set(False)
        return jnp.where(removed, NEG_INF, scores)

    return apply


def repetition_penalty(penalty: float | Array) -> Processor:
    """Penalizes every token id already in a row's input: divides positive scores by ``penalty``
    and multiplies negative ones, once per distinct token.

    As in transformers v5, left padding (slots before ``first_valid``) is ignored. Cost: one
    scatter of the ``B * S`` buffer into a ``[B, V]`` mask per call.

    Example:
        >>> process = repetition_penalty(1.2)
    """

    def apply(scores: Array, context: LogitsContext) -> Array:
        batch, vocab = scores.shape
        slots = jnp.arange(context.tokens.shape[1])[None, :]
        counted = (slots >= context.first_valid[:, None]) & (slots < context.length)
        # Ids that do not count go to an extra column, dropped after the scatter.
        ids = jnp.where(counted, jnp.clip(context.tokens, 0, vocab), vocab)
        seen = jnp.zeros((batch, vocab + 1), bool).at[jnp.arange(batch)[:, None], ids].set(True)
        strength = _per_row(penalty).astype(scores.dtype)
        penalized = jnp.where(scores < 0, scores * strength, scores / strength)
        return jnp.where(seen[:, :vocab], penalized, scores)

    return apply


def _eos_mask(eos_token_ids: Array, vocab: int) -> Array:
    """bool[V]: True at each EOS id."""
    eos = jnp.atleast_1d(jnp.asarray(eos_token_ids, jnp.int32))
    return jnp.any(jnp.arange(vocab)[:, None] == eos[None, :], axis=-1)


def min_length(length: int | Array, eos_token_ids: int | Array) -> Processor:
    """Forbids EOS while transformers' ``input_ids`` (prompt plus new tokens) is shorter than
    ``length``.

    Example:
        >>> process = min_length(20, eos_token_ids=2)
    """

    def apply(scores: Array, context: LogitsContext) -> Array:
        blocked = _eos_mask(eos_token_ids, scores.shape[-1]) & (context.input_length < length)
        return jnp.where(blocked, NEG_INF, scores)

    return apply


def min_new_tokens(count: int | Array, eos_token_ids: int | Array) -> Processor:
    """Forbids EOS until ``count`` new tokens have been generated.

    Example:
        >>> process = min_new_tokens(5, eos_token_ids=2)
    """

    def apply(scores: Array, context: LogitsContext) -> Array:
        blocked = _eos_mask(eos_token_ids, scores.shape[-1]) & (context.num_new_tokens < count)
        return jnp.where(blocked, NEG_INF, scores)

    return apply


# Config fields whose processors come in a later release: a set value raises instead of being
# silently ignored. Each maps to a predicate on the (defaults-filled) value saying it is "set".
_NOT_YET_SUPPORTED = {
    "guidance_scale": lambda v: v is not None and v != 1,
    "sequence_bias": lambda v: v is not None,
    "encoder_repetition_penalty": lambda v: v is not None and v != 1.0,
    "no_repeat_ngram_size": lambda v: v is not None and v > 0,
    "encoder_no_repeat_ngram_size": lambda v: v is not None and v > 0,
    "bad_words_ids": lambda v: v is not None,
    "forced_bos_token_id": lambda v: v is not None,
    "forced_eos_token_id": lambda v: v is not None,
    "remove_invalid_values": lambda v: v is True,
    "exponential_decay_length_penalty": lambda v: v is not None,
    "suppress_tokens": lambda v: v is not None,
    "begin_suppress_tokens": lambda v: v is not None,
    "top_h": lambda v: v is not None,
    "typical_p": lambda v: v is not None and v < 1.0,
    "epsilon_cutoff": lambda v: v is not None and 0.0 < v < 1.0,
    "eta_cutoff": lambda v: v is not None and 0.0 < v < 1.0,
    "watermarking_config": lambda v: v is not None,
    "renormalize_logits": lambda v: v is True,
    "token_healing": lambda v: bool(v),
}


def check_supported(config) -> None:
    """Raises UnsupportedError naming the first set option that has no processor yet.

    Args:
        config: a :class:`~genjax.GenerationConfig` with defaults applied.
    """
    for name, is_set in _NOT_YET_SUPPORTED.items():
        value = getattr(config, name)
        if isinstance(value, jax.core.Tracer) or is_set(value):
            raise UnsupportedError(
                f"generation option `{name}={value!r}` is not supported by genjax yet. Remove it "
                f"from the generation config (or set it to its default) to generate."
            )


def from_config(
    config,
    eos_token_ids: Array | None,
    extra: Sequence[Processor] = (),
) -> Processor:
    """Builds the processor chain transformers' ``generate`` builds, in the same order.

    Order: repetition penalty, min length, min new tokens, the user's ``extra`` processors, then,
    only when sampling: temperature, top-k, top-p, min-p.

    Args:
        config: a :class:`~genjax.GenerationConfig` with defaults applied (``with_defaults``).
            Inactive settings (None or neutral, e.g. ``temperature=1.0``) add no processor.
        eos_token_ids: int32[E] (or None when the config has no EOS), for the length rules.
        extra: processors run after the configured ones and before the sampling warpers, as
            transformers runs a user's ``logits_processor`` list.

    Returns:
        One processor applying the whole chain.

    Example:
        >>> from genjax import GenerationConfig
        >>> cfg = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9).with_defaults()
        >>> process = from_config(cfg, eos_token_ids=None)
    """
    check_supported(config)
    steps: list[Processor] = []
    if config.is_active("repetition_penalty"):
        steps.append(repetition_penalty(config.repetition_penalty))
    if eos_token_ids is not None:
        if config.min_length is not None and config.min_length > 0:
            steps.append(min_length(config.min_length, eos_token_ids))
        if config.min_new_tokens is not None and config.min_new_tokens > 0:
            steps.append(min_new_tokens(config.min_new_tokens, eos_token_ids))
    steps.extend(extra)
    if config.do_sample:
        keep = 1 if config.num_beams in (None, 1) else _beam_min_keep(eos_token_ids)
        if config.is_active("temperature"):
            steps.append(temperature(config.temperature))
        if config.is_active("top_k"):
            steps.append(top_k(config.top_k, keep))
        if config.is_active("top_p"):
            steps.append(top_p(config.top_p, keep))
        if config.is_active("min_p"):
            steps.append(min_p(config.min_p, keep))
    return chain(*steps)


def _beam_min_keep(eos_token_ids: Array | None) -> int:
    """Beam sampling keeps one more token than there are EOS ids, as transformers does."""
    return 2 if eos_token_ids is None else int(jnp.atleast_1d(eos_token_ids).shape[0]) + 1
