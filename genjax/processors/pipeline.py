"""The config preset: :func:`from_config` builds the chain transformers' ``generate`` would build
from a :class:`~genjax.GenerationConfig`, in the same order, from the factories of this package;
:func:`chain` composes processors; :func:`validate_config` checks a config's token settings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from genjax.errors import GenerationConfigError
from genjax.processors.base import (
    LogitsContext,
    Processor,
    Transform,
    check_id_list,
    check_id_lists,
    check_vocab,
    is_concrete,
)
from genjax.processors.greenlist import check_watermarking, watermark
from genjax.processors.ngram import (
    bad_words_ids,
    bias_pairs,
    encoder_no_repeat_ngram_size,
    no_repeat_ngram_size,
    sequence_bias,
)
from genjax.processors.token_rules import (
    allowed_tokens,
    begin_suppress_tokens,
    encoder_repetition_penalty,
    exponential_decay_length_penalty,
    forced_bos_token_id,
    forced_eos_token_id,
    min_length,
    min_new_tokens,
    remove_invalid_values,
    renormalize_logits,
    repetition_penalty,
    suppress_tokens,
)
from genjax.processors.warpers import (
    SortedFilter,
    epsilon_cutoff,
    eta_cutoff,
    min_p,
    temperature,
    top_h,
    top_k,
    top_p,
    typical_p,
)
from genjax.typing import Array


@jax.tree_util.register_pytree_node_class
class Chain:
    """Processors applied left to right; a pytree whose children are the processors."""

    def __init__(self, processors: Sequence[Processor]):
        self.processors = tuple(processors)

    def __call__(self, scores: Array, context: LogitsContext | None = None) -> Array:
        for processor in self.processors:
            scores = processor(scores, context)
        return scores

    def tree_flatten(self):
        return self.processors, None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children)

    def __repr__(self) -> str:
        return f"chain({', '.join(repr(p) for p in self.processors)})"


def chain(*processors: Processor) -> Chain:
    """Composes processors, applying them left to right.

    Adjacent :class:`SortedFilter` s (``top_h``, ``top_k``, ``top_p``) are merged into one
    that shares a single partial sort; the result is the same as applying them one by one. The
    chain is a pytree (see :func:`as_processors`): the processors' values are its leaves, so a
    chain with new values reuses a compiled program. A plain function in it is kept as part of
    the structure (static, compared by identity).

    Example:
        >>> process = chain(temperature(0.5), top_k(50), top_p(0.9))
    """
    merged: list[Processor] = []
    for processor in as_processors(processors):
        if isinstance(processor, SortedFilter) and merged and isinstance(merged[-1], SortedFilter):
            merged[-1] = merged[-1].then(processor)
        else:
            merged.append(processor)
    return Chain(merged)


def identity() -> Transform:
    """The processor that changes nothing.

    Example:
        >>> process = identity()
    """
    return Transform(_identity)


def _identity(scores: Array, context: Any) -> Array:
    return scores


def _call_function(scores: Array, context: Any, fn: Processor) -> Array:
    return fn(scores, context)


_TRANSFORMERS_NAMES = ("LogitsProcessor", "LogitsWarper", "LogitsProcessorList")


def _is_transformers_processor(obj: Any) -> bool:
    """True for transformers' processors (checked by class names; transformers is not imported)."""
    return any(
        cls.__name__ in _TRANSFORMERS_NAMES or cls.__module__.split(".")[0] == "transformers"
        for cls in type(obj).__mro__
    )


def _is_pytree_node(obj: Any) -> bool:
    return not jax.tree_util.all_leaves([obj])


def as_processors(processors: Sequence[Processor] | Processor) -> tuple[Processor, ...]:
    """Checks user processors before tracing and returns them as a tuple pytree.

    genjax's processors (factories of this package, :func:`chain`) and any other registered
    pytree pass through: their array values are leaves, traced by ``genjax.generate``, so new
    values reuse the compiled program. A plain function ``fn(scores, context) -> scores`` is
    wrapped so that it is part of the tree structure: static, compared by identity (pass the same
    function to reuse a compiled program).

    Raises:
        TypeError: a transformers ``LogitsProcessor`` (it runs torch code), a non-callable entry,
            or a plain function that is not hashable.

    Example:
        >>> len(as_processors([temperature(0.5), lambda scores, context: scores]))
        2
    """
    if isinstance(processors, str) or not isinstance(processors, Sequence):
        if not (callable(processors) or _is_transformers_processor(processors)):
            raise TypeError(
                f"logits_processor must be a list of processors fn(scores float32[B, V], "
                f"context) -> scores; got {type(processors).__name__}."
            )
        processors = (processors,)
    return tuple(_as_processor(p) for p in processors)


def _as_processor(processor: Any) -> Processor:
    if _is_transformers_processor(processor):
        raise TypeError(
            f"{type(processor).__name__} is a transformers LogitsProcessor, which runs torch code "
            f"on (input_ids, scores). genjax needs a jittable JAX processor fn(scores float32[B, "
            f"V], context: genjax.processors.LogitsContext) -> scores, e.g. one of the factories "
            f"of genjax.processors; transformers' input_ids are context.tokens[:, "
            f"context.offset:context.length]."
        )
    if not callable(processor):
        raise TypeError(
            f"logits_processor must hold processors fn(scores float32[B, V], context) -> scores; "
            f"got {type(processor).__name__} {processor!r}."
        )
    if _is_pytree_node(processor):
        return processor
    try:
        hash(processor)
    except TypeError:
        raise TypeError(
            f"logits processor {processor!r} is neither a pytree nor hashable, but a plain "
            f"processor is static (part of the compiled program). Use a genjax.processors "
            f"factory, a registered pytree with __call__, or a function."
        ) from None
    return Transform(_call_function, settings={"fn": processor})


def check_supported(config) -> None:
    """Raises UnsupportedError naming the first set option genjax does not implement.

    Rejected: a SynthID ``watermarking_config`` (the green-list one is supported; see
    :func:`watermark`). ``token_healing`` and ``guidance_scale`` are not processors and pass:
    :func:`genjax.generate` heals the prompts on the host before its program
    (:mod:`genjax.generation.healing`) and runs guidance in its loop
    (:mod:`genjax.decoding.guidance`); the serving engine refuses both.

    Args:
        config: a :class:`~genjax.GenerationConfig` with defaults applied.

    Example:
        >>> from genjax import GenerationConfig
        >>> check_supported(GenerationConfig().with_defaults())
    """
    if config.watermarking_config is not None:
        check_watermarking(config.watermarking_config)


def validate_config(config, vocab_size: int | None = None) -> None:
    """Checks the processor settings of ``config`` in Python, before anything is traced.

    Raises UnsupportedError for options genjax rejects (:func:`check_supported`), and
    GenerationConfigError naming the field, the value and the fix for malformed token lists
    (``bad_words_ids``, ``sequence_bias``, ``suppress_tokens``, ``begin_suppress_tokens``), ids
    outside ``[0, vocab_size)`` (those lists, concrete forced ids and the decoder start id,
    which the model always reads; checked when
    ``vocab_size`` is given), and ``exponential_decay_length_penalty`` without an EOS id.

    Example:
        >>> from genjax import GenerationConfig
        >>> validate_config(GenerationConfig(bad_words_ids=[[5]]).with_defaults(), vocab_size=128)
    """
    check_supported(config)
    if config.watermarking_config is not None:
        check_watermarking(config.watermarking_config, vocab_size)
    try:
        _check_token_settings(config, vocab_size)
    except ValueError as err:
        if isinstance(err, GenerationConfigError):
            raise
        raise GenerationConfigError(f"GenerationConfig.{err}") from None


def _check_token_settings(config, vocab_size: int | None) -> None:
    """Raises ValueError (message starting with the field name) for a bad token setting."""
    lists = {}
    if config.bad_words_ids is not None:
        lists["bad_words_ids"] = check_id_lists("bad_words_ids", config.bad_words_ids)
    if config.sequence_bias is not None:
        lists["sequence_bias"] = [ids for ids, _ in bias_pairs(config.sequence_bias)]
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        if getattr(config, name) is not None:
            lists[name] = [check_id_list(name, getattr(config, name))]
    for name in ("forced_bos_token_id", "forced_eos_token_id", "decoder_start_token_id"):
        value = getattr(config, name)
        if value is not None and is_concrete(value):
            lists[name] = [[int(i) for i in np.atleast_1d(np.asarray(value)).tolist()]]
    for name, sequences in lists.items():
        check_vocab(name, [i for ids in sequences for i in ids], vocab_size)
    if config.exponential_decay_length_penalty is not None and config.eos_token_id is None:
        raise GenerationConfigError(
            f"GenerationConfig.exponential_decay_length_penalty="
            f"{config.exponential_decay_length_penalty!r} needs an EOS token to boost, but "
            f"eos_token_id is None. Set eos_token_id, or remove the penalty."
        )


def from_config(
    config,
    eos_token_ids: Array | None,
    extra: Sequence[Processor] = (),
    *,
    allowed_tokens_fn: Callable[[Array, Array], Array] | None = None,
    vocab_size: int | None = None,
) -> Processor:
    """Builds the processor chain transformers' ``generate`` builds, in the same order.

    Order (each only when its setting is active): sequence bias, encoder repetition penalty,
    repetition penalty, no-repeat n-grams, encoder no-repeat n-grams, bad words, min length, min new
    tokens, ``allowed_tokens_fn``, forced BOS, forced EOS, remove invalid values, exponential decay
    length penalty, suppress tokens, begin-suppress tokens, the user's ``extra`` processors; then,
    only when sampling: temperature, top-h, top-k, top-p, min-p, typical-p, epsilon, eta; then
    the watermark (``watermarking_config``, after all other processing); then renormalization.
    With beam sampling the warpers keep at least ``len(eos) + 1`` tokens, as transformers does.
    The two encoder options read the source of an encoder-decoder model
    (``LogitsContext.encoder_tokens``), else the prompt as transformers' "encoder input", which it
    is for decoder-only models (transformers builds them whenever ``input_ids`` are given, as they
    always are here). Classifier-free guidance (``guidance_scale``), first in transformers'
    chain, needs the model and a second cache, so ``generate``'s loop applies it before this
    chain (:mod:`genjax.decoding.guidance`); this chain alone does not.

    Args:
        config: a :class:`~genjax.GenerationConfig` with defaults applied (``with_defaults``).
            Inactive settings (None or neutral, e.g. ``temperature=1.0``) add no processor.
        eos_token_ids: int32[E] (or None when the config has no EOS), for the length rules, bad
            words and the decay penalty.
        extra: processors run after the configured ones and before the sampling warpers, as
            transformers runs a user's ``logits_processor`` list.
        allowed_tokens_fn: a jittable ``fn(tokens, length) -> bool[B, V]`` (see
            :func:`allowed_tokens`), placed where transformers places
            ``prefix_allowed_tokens_fn``.
        vocab_size: when given, token ids in the config are checked against it.

    Returns:
        One processor applying the whole chain.

    Raises:
        UnsupportedError, GenerationConfigError: see :func:`validate_config`.

    Example:
        >>> from genjax import GenerationConfig
        >>> cfg = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9).with_defaults()
        >>> process = from_config(cfg, eos_token_ids=None)
    """
    validate_config(config, vocab_size)
    steps: list[Processor] = []
    if config.sequence_bias is not None:
        steps.append(sequence_bias(config.sequence_bias))
    if config.is_active("encoder_repetition_penalty"):
        steps.append(encoder_repetition_penalty(config.encoder_repetition_penalty))
    if config.is_active("repetition_penalty"):
        steps.append(repetition_penalty(config.repetition_penalty))
    if config.no_repeat_ngram_size is not None and config.no_repeat_ngram_size > 0:
        steps.append(no_repeat_ngram_size(config.no_repeat_ngram_size))
    if config.encoder_no_repeat_ngram_size is not None and config.encoder_no_repeat_ngram_size > 0:
        steps.append(encoder_no_repeat_ngram_size(config.encoder_no_repeat_ngram_size))
    if config.bad_words_ids is not None:
        steps.append(bad_words_ids(config.bad_words_ids, eos_token_ids))
    if eos_token_ids is not None:
        if config.min_length is not None and config.min_length > 0:
            steps.append(min_length(config.min_length, eos_token_ids))
        if config.min_new_tokens is not None and config.min_new_tokens > 0:
            steps.append(min_new_tokens(config.min_new_tokens, eos_token_ids))
    if allowed_tokens_fn is not None:
        group = max(config.num_beams or 1, config.num_return_sequences or 1)
        steps.append(allowed_tokens(allowed_tokens_fn, group))
    steps.extend(_forcing_steps(config, eos_token_ids))
    steps.extend(as_processors(extra))
    if config.do_sample:
        steps.extend(_warper_steps(config, eos_token_ids))
    if config.watermarking_config is not None:
        steps.append(watermark(**check_watermarking(config.watermarking_config)))
    if config.renormalize_logits is True:
        steps.append(renormalize_logits())
    return chain(*steps)


def _forcing_steps(config, eos_token_ids: Array | None) -> list[Processor]:
    """Forced BOS/EOS, invalid values, decay penalty, suppression; in transformers' order."""
    steps: list[Processor] = []
    if config.forced_bos_token_id is not None:
        steps.append(forced_bos_token_id(config.forced_bos_token_id))
    if config.forced_eos_token_id is not None:
        steps.append(forced_eos_token_id(config.forced_eos_token_id))
    if config.remove_invalid_values is True:
        steps.append(remove_invalid_values())
    if config.exponential_decay_length_penalty is not None:
        start, factor = config.exponential_decay_length_penalty
        steps.append(exponential_decay_length_penalty(start, factor, eos_token_ids))
    if config.suppress_tokens is not None:
        steps.append(suppress_tokens(config.suppress_tokens))
    if config.begin_suppress_tokens is not None:
        forced_bos = config.forced_bos_token_id is not None
        steps.append(begin_suppress_tokens(config.begin_suppress_tokens, forced_bos=forced_bos))
    return steps


def _warper_steps(config, eos_token_ids: Array | None) -> list[Processor]:
    """The sampling warpers, in transformers' order."""
    keep = 1 if config.num_beams in (None, 1) else _beam_min_keep(eos_token_ids)
    steps: list[Processor] = []
    if config.is_active("temperature"):
        steps.append(temperature(config.temperature))
    if config.is_active("top_h"):
        steps.append(top_h(config.top_h))
    if config.is_active("top_k"):
        steps.append(top_k(config.top_k, keep))
    if config.is_active("top_p"):
        steps.append(top_p(config.top_p, keep))
    if config.is_active("min_p"):
        steps.append(min_p(config.min_p, keep))
    if config.is_active("typical_p"):
        steps.append(typical_p(config.typical_p, keep))
    if config.is_active("epsilon_cutoff"):
        steps.append(epsilon_cutoff(config.epsilon_cutoff, keep))
    if config.is_active("eta_cutoff"):
        steps.append(eta_cutoff(config.eta_cutoff, keep))
    return steps


def _beam_min_keep(eos_token_ids: Array | None) -> int:
    """Beam sampling keeps one more token than there are EOS ids, as transformers does."""
    return 2 if eos_token_ids is None else int(jnp.atleast_1d(eos_token_ids).shape[0]) + 1
