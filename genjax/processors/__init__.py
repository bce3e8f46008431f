"""Logits processors: small factories that return pure, jittable transforms of next-token scores.

A processor is a function ``(scores, context) -> scores`` on float32[B, V] scores, where ``context``
is a :class:`LogitsContext` describing the token buffer. Each factory returns a :class:`Transform`:
a pure rule with its settings (optax-style), and a pytree whose leaves are the values (strengths,
cut-offs, token ids) and whose structure is the kind of processor and its static settings;
:func:`chain` composes processors left to right into a pytree too; :func:`from_config` builds the
chain transformers' ``generate`` would build from a :class:`~genjax.GenerationConfig`, in the same
order, using only the factories in this package. Each factory is named after the config field it
implements:

=============================== ===========================================================
token rules                     ``sequence_bias``, ``encoder_repetition_penalty``,
                                ``repetition_penalty``, ``no_repeat_ngram_size``,
                                ``encoder_no_repeat_ngram_size``, ``bad_words_ids``, ``min_length``,
                                ``min_new_tokens``, ``allowed_tokens`` (transformers'
                                ``prefix_allowed_tokens_fn``), ``forced_bos_token_id``,
                                ``forced_eos_token_id``, ``remove_invalid_values``,
                                ``exponential_decay_length_penalty``, ``suppress_tokens``,
                                ``begin_suppress_tokens``
OpenAI's options                ``presence_penalty``, ``frequency_penalty``, ``count_penalties``
                                (both at once), ``logit_bias`` (per-row token ids, traced); no
                                config field: pass them in ``generate(logits_processor=[...])``
sampling warpers                ``temperature``, ``top_h``, ``top_k``, ``top_p``, ``min_p``,
                                ``typical_p``, ``epsilon_cutoff``, ``eta_cutoff``
after the others                ``watermark`` (``watermarking_config``: green-list watermarking,
                                bit for bit as transformers; see :mod:`.greenlist`)
last                            ``renormalize_logits``
=============================== ===========================================================

Every docstring states the processor's cost per call. ``top_k``, ``top_p`` and ``top_h`` never
sort the whole vocabulary on ordinary steps and share one partial sort when adjacent in a chain
(see :class:`SortedFilter`).

Static or traced:
    Strengths, cut-offs and token ids that are single values (``temperature``, ``top_k``,
    ``top_p``, ``min_p``, ``top_h``, ``typical_p``, ``epsilon_cutoff``, ``eta_cutoff``,
    ``repetition_penalty``, ``encoder_repetition_penalty``, ``presence_penalty``,
    ``frequency_penalty``, ``logit_bias`` (its ids too), the forced token ids, the EOS ids,
    the decay start and factor, the sequence biases) may be Python numbers or traced arrays, most
    of them one value per row (``[B]``); changing them never recompiles. They are the leaves of
    the processor's pytree, so a processor passed to a jitted function (as
    ``genjax.generate(logits_processor=[...])`` does) is traced: ``temperature(0.5)`` and a fresh
    ``temperature(0.7)`` share one compiled program. Static (they shape the program, in the
    pytree's structure): which processors are in a chain, ``min_tokens_to_keep``,
    ``no_repeat_ngram_size``, ``encoder_no_repeat_ngram_size``, the token sequences of
    ``bad_words_ids`` and ``sequence_bias``, the user's ``allowed_tokens`` function, the
    watermark's ratio, key, scheme and width (its ``bias`` is traced when built with
    :func:`watermark`; ``watermarking_config`` is a static config field), and plain functions
    used as processors (compared by identity; see :func:`as_processors`).

Example:
    >>> import jax.numpy as jnp
    >>> from genjax import processors
    >>> warp = processors.chain(processors.temperature(0.7), processors.top_k(2))
    >>> ctx = processors.LogitsContext.for_prompt(jnp.zeros((1, 3), jnp.int32))
    >>> warp(jnp.array([[1.0, 3.0, 2.0, 0.0]]), ctx).tolist()
    [[-inf, 4.285714149475098, 2.857142925262451, -inf]]

References:
    Keskar et al. 2019, "CTRL: A Conditional Transformer Language Model" (repetition penalty).
    Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration" (top-p).
    Meister et al. 2022, "Locally Typical Sampling" (typical decoding), arXiv:2202.00666.
    Hewitt et al. 2022, "Truncation Sampling as Language Model Desmoothing" (epsilon, eta),
    arXiv:2210.15191.
    "Top-H Decoding: Adapting the Creativity and Coherence with Bounded Entropy in Text
    Generation", arXiv:2509.02510.
    Paulus et al. 2017, "A Deep Reinforced Model for Abstractive Summarization" (no-repeat
    n-grams), arXiv:1705.04304.
    Hugging Face transformers' ``generation/logits_process.py`` and ``_get_logits_processor``
    define the semantics and the order matched here.

Layer:
    Floor 2. Imports only :mod:`genjax.errors` and :mod:`genjax.typing`; ``base`` holds the context
    and helpers, ``warpers`` / ``token_rules`` / ``ngram`` / ``greenlist`` the factories,
    ``pipeline`` the preset.
"""

from genjax.processors.base import LogitsContext, Processor, Transform
from genjax.processors.greenlist import watermark
from genjax.processors.ngram import (
    bad_words_ids,
    encoder_no_repeat_ngram_size,
    logit_bias,
    no_repeat_ngram_size,
    sequence_bias,
)
from genjax.processors.pipeline import (
    Chain,
    as_processors,
    chain,
    check_supported,
    from_config,
    identity,
    validate_config,
)
from genjax.processors.token_rules import (
    allowed_tokens,
    begin_suppress_tokens,
    count_penalties,
    encoder_repetition_penalty,
    exponential_decay_length_penalty,
    forced_bos_token_id,
    forced_eos_token_id,
    frequency_penalty,
    min_length,
    min_new_tokens,
    presence_penalty,
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

__all__ = [
    "Chain",
    "LogitsContext",
    "Processor",
    "SortedFilter",
    "Transform",
    "allowed_tokens",
    "as_processors",
    "bad_words_ids",
    "begin_suppress_tokens",
    "chain",
    "check_supported",
    "count_penalties",
    "encoder_no_repeat_ngram_size",
    "encoder_repetition_penalty",
    "epsilon_cutoff",
    "eta_cutoff",
    "exponential_decay_length_penalty",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "frequency_penalty",
    "from_config",
    "identity",
    "logit_bias",
    "min_length",
    "min_new_tokens",
    "min_p",
    "no_repeat_ngram_size",
    "presence_penalty",
    "remove_invalid_values",
    "renormalize_logits",
    "repetition_penalty",
    "sequence_bias",
    "suppress_tokens",
    "temperature",
    "top_h",
    "top_k",
    "top_p",
    "typical_p",
    "validate_config",
    "watermark",
]
