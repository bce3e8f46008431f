"""Per-request generation options: what the engine supports, checked in the caller's thread.

A request's config is its ``generation_config`` with unset fields from the manager's (itself
filled from the model's ``generation_config``), then updated by its keyword overrides. The
engine runs, per row: greedy or sampling with ``temperature``, ``top_h``, ``top_k``, ``top_p``,
``min_p``, ``typical_p``, ``epsilon_cutoff``, ``eta_cutoff``, ``repetition_penalty``,
``encoder_repetition_penalty``, ``no_repeat_ngram_size`` and ``encoder_no_repeat_ngram_size``
(the prompt as the encoder input, as transformers reads it for decoder-only models; both up to
``ContinuousBatchingConfig.max_no_repeat_ngram_size``),
``sequence_bias`` (OpenAI's ``logit_bias`` among them), ``suppress_tokens``, ``bad_words_ids``
and ``begin_suppress_tokens`` (one bias table per request, the bans as -inf biases; sequences
up to ``ContinuousBatchingConfig.max_bias_sequence_length`` tokens);
``forced_bos_token_id`` and ``forced_eos_token_id`` (a forced id may not also be suppressed),
``remove_invalid_values`` (not beside a suppression), ``exponential_decay_length_penalty``,
``renormalize_logits``;
``max_new_tokens`` (or ``max_length``), ``min_new_tokens``, ``min_length`` (held as the new
tokens it asks for after the request's prompt), ``max_time`` (seconds from the request's first
admission, checked on the host after each round trip, whose tokens it keeps: finish reason
"length"), EOS ids (a list), ``stop_strings``
(matched on the host with the tokenizer), a ``seed`` and ``num_return_sequences`` (sampled
sequences of one prompt, at most ``max_batch_size``; sequence ``j`` draws as row ``j`` of
``genjax.generate``'s batch). Any other field set to a non-default
value raises :class:`~genjax.errors.UnsupportedError` naming it.

The KV cache is the engine's, not the request's (vLLM's ``kv_cache_dtype``):
``ContinuousBatchingConfig.kv_cache_dtype`` decides for every request whether the paged pool
holds the model's dtype or int8 codes. A request's ``cache_implementation`` is checked against
it (:func:`check_cache_choice`): ``"quantized"`` (with ``cache_config={"nbits": 8}``, checked as
``genjax.generate`` checks it) runs only on an int8 pool, and raises UnsupportedError naming
``kv_cache_dtype`` on the others; the float layouts (None, ``"static"``, ``"dynamic"``,
``"sliding_window"``, ``"hybrid"``, ``"hybrid_chunked"``, ``"paged"``; a checkpoint's
``generation_config.json`` may name one) are accepted by either pool, which replaces them with
its paged blocks; an offloaded cache raises.

Beyond the config, :class:`EngineOptions` holds what ``GenerationConfig`` has no field for:
OpenAI's ``presence_penalty`` and ``frequency_penalty``, ``logprobs``, and a structured-output
``constraint`` (:mod:`genjax.serving.constraint_pool`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from genjax.cache.quantized import FLOAT_IMPLEMENTATIONS, check_cache_options
from genjax.config import GenerationConfig
from genjax.config.fields import DEFAULT_GENERATION_PARAMS, FIELD_NAMES, METADATA_FIELDS
from genjax.decoding.sampling import rows_drawn_alone
from genjax.errors import InputError, UnsupportedError
from genjax.generation.inputs import effective_config
from genjax.processors import validate_config
from genjax.processors.base import NEG_INF
from genjax.processors.ngram import bias_pairs
from genjax.serving.constraint_pool import check_constraint, constraint_key
from genjax.serving.engine import EngineShape, RowSettings
from genjax.serving.scheduler import RequestState
from genjax.typing import INT32_MAX, INT32_MIN

SUPPORTED = frozenset(
    {
        "max_length",
        "max_new_tokens",
        "min_new_tokens",
        "min_length",
        "max_time",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "renormalize_logits",
        "do_sample",
        "temperature",
        "top_h",
        "top_k",
        "top_p",
        "min_p",
        "typical_p",
        "epsilon_cutoff",
        "eta_cutoff",
        "repetition_penalty",
        "encoder_repetition_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "sequence_bias",
        "suppress_tokens",
        "begin_suppress_tokens",
        "bad_words_ids",
        "eos_token_id",
        "pad_token_id",
        "bos_token_id",
        "stop_strings",
        "num_beams",
        "num_return_sequences",
        "use_cache",
        "return_dict_in_generate",
        "continuous_batching_config",
        "prefill_chunk_size",
        "cache_implementation",
        "cache_config",
        "disable_compile",
        "compile_config",
    }
)
"""Fields a request may set; the others must keep their default."""

# Values equal to transformers' defaults, which a checkpoint's generation_config.json may spell
# out (transformers v5 writes output_attentions/output_hidden_states false from config.json).
_HARMLESS_VALUES = {
    "output_scores": (False,),
    "output_logits": (False,),
    "output_attentions": (False,),
    "output_hidden_states": (False,),
    "token_healing": (False,),
    "low_memory": (False,),
    "is_assistant": (False,),
    "use_mtp": (False,),
    "guidance_scale": (1.0,),  # transformers adds classifier-free guidance only when != 1
}
"""Values of unsupported fields that change nothing (besides None and the library default),
so a checkpoint or client that spells out the neutral value is not refused."""


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """A request's options that ``GenerationConfig`` has no field for (vLLM's names).

    Attributes:
        presence_penalty: OpenAI's, subtracted once from every token generated so far (the
            prompt does not count); 0: off. See :func:`genjax.processors.count_penalties`.
        frequency_penalty: OpenAI's, subtracted per occurrence in the generated tokens; 0: off.
        logprobs: None: none; ``k >= 0``: each new token's raw log-probability and the ``k``
            most likely tokens with theirs (``k <= ContinuousBatchingConfig.max_top_logprobs``).
        constraint: a :class:`genjax.constraints.Constraint` the new tokens follow (regex,
            JSON schema, choice), or None.
    """

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    constraint: Any = None

    @classmethod
    def split(cls, overrides: dict) -> tuple[EngineOptions, dict]:
        """Takes this class's fields out of ``add_request``'s keyword ``overrides``; returns
        them and the config overrides left."""
        names = {f.name for f in dataclasses.fields(cls)}
        mine = {k: v for k, v in overrides.items() if k in names}
        rest = {k: v for k, v in overrides.items() if k not in names}
        return cls(**mine), rest

    def check(self, shape: EngineShape) -> None:
        """Raises InputError naming a bad value."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float | np.number):
                raise InputError(f"{name} must be a number, got {value!r}.")
            if not math.isfinite(value):
                raise InputError(f"{name} must be finite, got {value!r}; 0 turns it off.")
        k = self.logprobs
        if k is None:
            return
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0:
            raise InputError(f"logprobs must be None or an int >= 0, got {k!r}.")
        if k > shape.max_top_logprobs:
            raise InputError(
                f"logprobs={k} asks for more top log-probabilities than the engine returns "
                f"({shape.max_top_logprobs}). Raise ContinuousBatchingConfig.max_top_logprobs."
            )


def bias_entries(config: GenerationConfig) -> list[tuple[tuple[int, ...], float, bool]]:
    """``(sequence, bias, first token only)`` per biased or banned token of ``config``:
    ``sequence_bias``, then -inf for ``suppress_tokens``, ``bad_words_ids`` (an EOS id alone
    among the bad words is dropped, as transformers drops ``[eos]``) and, at the first new
    token only, ``begin_suppress_tokens``: the entries the engine holds per request."""
    eos = config.eos_token_id
    eos = () if eos is None else {int(i) for i in np.atleast_1d(np.asarray(eos)).tolist()}
    pairs = [] if config.sequence_bias is None else bias_pairs(config.sequence_bias)
    entries = [(tuple(seq), float(bias), False) for seq, bias in pairs]
    entries += [((int(t),), NEG_INF, False) for t in np.atleast_1d(config.suppress_tokens or ())]
    bad = [tuple(int(t) for t in seq) for seq in config.bad_words_ids or ()]
    entries += [(seq, NEG_INF, False) for seq in bad if not (len(seq) == 1 and seq[0] in eos)]
    begin = np.atleast_1d(config.begin_suppress_tokens or ())
    entries += [((int(t),), NEG_INF, True) for t in begin]
    return entries


def _bias_table(
    config: GenerationConfig, shape: EngineShape
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The request's bias table (:func:`genjax.serving.choosing.sequence_biases`): ids
    int32[1, L_b], biases float32[1, L_b], prefixes int32[1, L_b, W] and first-only flags
    bool[1, L_b], from :func:`bias_entries`. -inf stays -inf through every later processor
    and warper, so banning at the bias's place in the chain gives transformers' scores; a token
    both biased and banned sums to -inf."""
    entries = bias_entries(config)
    longest = max((len(seq) for seq, _, _ in entries), default=0)
    width = shape.max_bias_prefix
    if longest > width + 1:
        raise InputError(
            f"sequence_bias or bad_words_ids holds a sequence of {longest} tokens, but the "
            f"engine matches sequences of at most {width + 1}. Raise "
            f"ContinuousBatchingConfig.max_bias_sequence_length to {longest}."
        )
    if len(entries) > shape.max_bias:
        raise InputError(
            f"sequence_bias, suppress_tokens, bad_words_ids and begin_suppress_tokens give "
            f"{len(entries)} biased tokens, but the engine holds at most {shape.max_bias} per "
            "request. Raise ContinuousBatchingConfig.max_logit_bias."
        )
    row = RowSettings.empty(1, shape)
    ids, values, prefixes, first = (
        row.bias_ids,
        row.bias_values,
        row.bias_prefixes,
        row.bias_first_only,
    )
    for k, (seq, bias, first_only) in enumerate(entries):
        ids[0, k], values[0, k], first[0, k] = seq[-1], bias, first_only
        if len(seq) > 1:
            prefixes[0, k, width - len(seq) + 1 :] = seq[:-1]
    return ids, values, prefixes, first


def _ngram_size(
    config: GenerationConfig, shape: EngineShape, name: str = "no_repeat_ngram_size"
) -> int:
    size = int(getattr(config, name) or 0)
    if size > shape.max_ngram:
        raise InputError(
            f"{name}={size}, but the engine compares n-grams of at most "
            f"{shape.max_ngram} tokens. Raise ContinuousBatchingConfig.max_no_repeat_ngram_size "
            f"to {size}."
        )
    return size


def check_supported(config: GenerationConfig) -> None:
    """Raises UnsupportedError for beam search and for any unsupported non-default field."""
    if (config.num_beams or 1) > 1:
        raise UnsupportedError(
            f"num_beams={config.num_beams}: beam search is not supported in continuous batching. "
            "Use genjax.generate for beam search, or set num_beams=1."
        )
    for name in FIELD_NAMES:
        if name in SUPPORTED or name in METADATA_FIELDS:
            continue
        value = getattr(config, name)
        default = DEFAULT_GENERATION_PARAMS.get(name)
        if value is not None and value != default and value not in _HARMLESS_VALUES.get(name, ()):
            raise UnsupportedError(
                f"{name}={value!r} is not supported by the continuous-batching engine yet. "
                f"Leave it unset (default {default!r}), or use genjax.generate for this request."
            )


def check_cache_choice(config: GenerationConfig, shape: EngineShape) -> None:
    """Checks the request's ``cache_implementation`` and ``cache_config`` against the engine's
    pool (see the module docstring).

    Raises:
        UnsupportedError: ``"quantized"`` on a pool in the model's dtype (set
            ``ContinuousBatchingConfig.kv_cache_dtype="int8"``), a quantized ``cache_config``
            other than ``{"nbits": 8}``, or an offloaded cache.
        GenerationConfigError: ``cache_config`` without ``cache_implementation="quantized"``.
    """
    name, options = config.cache_implementation, config.cache_config
    if name == "quantized":
        check_cache_options(name, options)
        if not shape.quantized:
            raise UnsupportedError(
                f"cache_implementation='quantized' asks for an int8 KV cache, but this engine's "
                f"pool holds the model's dtype (ContinuousBatchingConfig.kv_cache_dtype="
                f"{shape.kv_cache_dtype!r}): the continuous-batching engine chooses its KV cache "
                f"for all requests, not per request. Build it with ContinuousBatchingConfig("
                f"kv_cache_dtype='int8') (genjax serve --kv-cache-dtype int8), or leave "
                f"cache_implementation unset."
            )
        return
    if name not in (*FLOAT_IMPLEMENTATIONS, "paged"):
        raise UnsupportedError(
            f"cache_implementation={name!r} is not supported by the continuous-batching engine: "
            f"its KV cache is a paged pool in device memory, in the model's dtype or int8 "
            f"(ContinuousBatchingConfig.kv_cache_dtype). Leave cache_implementation unset."
        )
    check_cache_options(None if name == "paged" else name, options)  # a stray cache_config


def _return_sequences(config: GenerationConfig, shape: EngineShape) -> int:
    """The request's ``num_return_sequences``, checked against the engine (see
    :meth:`~genjax.serving.scheduler.RequestState.fork`)."""
    n = 1 if config.num_return_sequences is None else config.num_return_sequences
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise InputError(f"num_return_sequences must be an int >= 1, got {n!r}.")
    if n > shape.max_batch_size:
        raise InputError(
            f"num_return_sequences={n} decodes {n} rows together, but the engine has "
            f"max_batch_size={shape.max_batch_size} slots. Ask for at most "
            f"{shape.max_batch_size} sequences, or raise ContinuousBatchingConfig.max_batch_size."
        )
    if n > 1 and not rows_drawn_alone():
        raise UnsupportedError(
            f"num_return_sequences={n} draws sequence j as row j of genjax.generate's batch, "
            "which needs JAX's default threefry keys with jax_threefry_partitionable=True "
            "(its default). Restore both settings, or send n requests with their own seeds."
        )
    return int(n)


def _eos_ids(config: GenerationConfig, max_eos: int) -> tuple[int, ...]:
    eos = config.eos_token_id
    if eos is None:
        return ()
    ids = tuple(int(i) for i in np.atleast_1d(np.asarray(eos)).tolist())
    if len(ids) > max_eos:
        raise InputError(
            f"eos_token_id has {len(ids)} ids, but the engine holds at most {max_eos} per "
            f"request. Raise ContinuousBatchingConfig.max_eos_tokens to {len(ids)}."
        )
    return ids


def _forced_last(config: GenerationConfig, max_eos: int) -> np.ndarray:
    """int32[1, E]: ``forced_eos_token_id`` (-1 fills; all -1 when unset)."""
    row = np.full((1, max_eos), -1, np.int32)
    if config.forced_eos_token_id is None:
        return row
    ids = np.atleast_1d(np.asarray(config.forced_eos_token_id)).tolist()
    if len(ids) > max_eos:
        raise InputError(
            f"forced_eos_token_id has {len(ids)} ids, but the engine holds at most {max_eos} per "
            f"request. Raise ContinuousBatchingConfig.max_eos_tokens to {len(ids)}."
        )
    row[0, : len(ids)] = ids
    return row


def _suppressions(config: GenerationConfig) -> str:
    """The suppression fields ``config`` sets, joined with "and" ("" when none)."""
    names = ("suppress_tokens", "begin_suppress_tokens")
    return " and ".join(name for name in names if getattr(config, name))


def _check_rule_order(config: GenerationConfig, prompt_length: int) -> int:
    """The id forced as the first new token (-1: none): ``forced_bos_token_id``, which
    transformers applies when ``input_ids`` hold one token, so only after a one-token prompt.

    Raises:
        UnsupportedError: a forced id that ``suppress_tokens`` or ``begin_suppress_tokens`` also
            name (transformers suppresses after forcing, the engine before: the two would part),
            or ``begin_suppress_tokens`` with a forced BOS after a one-token prompt
            (transformers then moves the suppression to the second new token), or
            ``remove_invalid_values`` with a suppression (transformers suppresses after it).
    """
    bos = config.forced_bos_token_id
    first = int(bos) if bos is not None and prompt_length == 1 else -1
    forced = set() if first < 0 else {first}
    if config.forced_eos_token_id is not None:
        forced |= {int(i) for i in np.atleast_1d(np.asarray(config.forced_eos_token_id)).tolist()}
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        both = forced & {int(t) for t in np.atleast_1d(getattr(config, name) or ())}
        if both:
            raise UnsupportedError(
                f"{name} names {sorted(both)}, which forced_bos_token_id or forced_eos_token_id "
                "forces: the continuous-batching engine does not run a token both forced and "
                f"suppressed. Remove it from {name}, or use genjax.generate for this request."
            )
    if config.remove_invalid_values is True and (suppressed := _suppressions(config)):
        raise UnsupportedError(
            f"remove_invalid_values=True with {suppressed}: transformers suppresses after "
            "removing invalid values (the suppressed tokens stay -inf), the continuous-batching "
            "engine before (they would become the lowest float). Leave one of them out, or use "
            "genjax.generate for this request."
        )
    if first >= 0 and config.begin_suppress_tokens is not None:
        raise UnsupportedError(
            "begin_suppress_tokens with forced_bos_token_id after a one-token prompt: "
            "transformers then suppresses at the second new token, which the continuous-batching "
            "engine does not do. Use genjax.generate for this request."
        )
    return first


def _row(
    config: GenerationConfig,
    eos: tuple[int, ...],
    seed: int,
    shape: EngineShape,
    extras: EngineOptions,
):
    sampling = bool(config.do_sample)
    ids = np.full((1, shape.max_eos), -1, np.int32)
    ids[0, : len(eos)] = eos

    def value(name, neutral, dtype):
        v = getattr(config, name)
        return np.asarray([neutral if (v is None or not sampling) else v], dtype)

    bias_ids, bias_values, bias_prefixes, bias_first_only = _bias_table(config, shape)
    c = extras.constraint
    start, factor = config.exponential_decay_length_penalty or (0, 1.0)
    with np.errstate(over="ignore"):  # a factor past float32 is inf, as generate holds it
        factor = np.asarray([factor], np.float32)
    return RowSettings(
        do_sample=np.asarray([sampling], bool),
        temperature=value("temperature", 1.0, np.float32),
        top_h=value("top_h", 0.0, np.float32),
        top_k=value("top_k", 0, np.int32),
        top_p=value("top_p", 1.0, np.float32),
        min_p=value("min_p", 0.0, np.float32),
        typical_p=value("typical_p", 1.0, np.float32),
        epsilon_cutoff=value("epsilon_cutoff", 0.0, np.float32),
        eta_cutoff=value("eta_cutoff", 0.0, np.float32),
        repetition_penalty=np.asarray([config.repetition_penalty or 1.0], np.float32),
        encoder_repetition_penalty=np.asarray(
            [config.encoder_repetition_penalty or 1.0], np.float32
        ),
        presence_penalty=np.asarray([extras.presence_penalty], np.float32),
        frequency_penalty=np.asarray([extras.frequency_penalty], np.float32),
        bias_ids=bias_ids,
        bias_values=bias_values,
        bias_prefixes=bias_prefixes,
        bias_first_only=bias_first_only,
        logprobs=np.asarray([-1 if extras.logprobs is None else extras.logprobs], np.int32),
        max_new_tokens=np.zeros((1,), np.int32),
        # past max_new_tokens a larger minimum changes nothing: held as the int32 maximum
        min_new_tokens=np.asarray([min(config.min_new_tokens or 0, INT32_MAX)], np.int32),
        eos_token_ids=ids,
        seed=np.asarray([seed], np.int32),
        sample_row=np.zeros((1,), np.int32),
        constraint_eos=np.asarray([-1 if c is None else c.eos_token_id], np.int32),
        no_repeat_ngram_size=np.asarray([_ngram_size(config, shape)], np.int32),
        encoder_no_repeat_ngram_size=np.asarray(
            [_ngram_size(config, shape, "encoder_no_repeat_ngram_size")], np.int32
        ),
        forced_first=np.full((1,), -1, np.int32),  # build_request sets it: it needs the prompt
        forced_last=_forced_last(config, shape.max_eos),
        remove_invalid=np.asarray([config.remove_invalid_values is True], bool),
        decay_start=np.asarray([min(int(start), INT32_MAX)], np.int32),
        decay_factor=factor,
        renormalize=np.asarray([config.renormalize_logits is True], bool),
        max_ngram=shape.max_ngram,
    )


def request_config(
    default: GenerationConfig, config: GenerationConfig | None, overrides: dict
) -> GenerationConfig:
    """A request's config: ``config``'s unset fields from the manager's ``default`` (as
    ``genjax.generate`` fills them from the model's), then the keyword ``overrides``."""
    if config is not None:
        config = effective_config(config, {}, default)
    config = default if config is None else config
    if "top_k" in overrides and overrides["top_k"] is None:
        # generate's override top_k=None turns top-k off (transformers' order: overrides after
        # the library defaults); here the library default (50) fills None later, so say 0: off
        overrides = {**overrides, "top_k": 0}
    if overrides:
        config, unused = config.updated(**overrides)
        if unused:
            raise TypeError(f"add_request got unknown config fields {sorted(unused)}.")
    return config


def build_request(
    request_id: str,
    input_ids,
    config: GenerationConfig,
    shape: EngineShape,
    vocab_size: int,
    *,
    seed: int | None,
    streaming: bool,
    tokenizer=None,
    extras: EngineOptions | None = None,
) -> RequestState:
    """Checks one request and returns its host record (raises before anything is queued).

    Raises:
        UnsupportedError: beam search or another option the engine does not run; a
            ``cache_implementation`` the engine's pool does not give (:func:`check_cache_choice`).
        InputError: ids outside ``[0, vocab_size)``, an empty prompt, a request longer than the
            engine's ``max_length``, stop strings without a tokenizer, too many EOS ids or biased
            tokens, a biased sequence longer than the engine matches, a bad :class:`EngineOptions`
            value, a constraint the engine cannot run (no constraint pool, larger than the pool,
            another vocabulary, an EOS id that is not one of the request's).
        GenerationConfigError: invalid values (as :func:`genjax.generate` raises them).
    """
    check_supported(config)
    check_cache_choice(config, shape)
    copies = _return_sequences(config, shape)
    extras = extras or EngineOptions()
    extras.check(shape)
    resolved = config.with_defaults()
    validate_config(resolved, vocab_size)
    prompt = np.asarray(input_ids)
    if prompt.ndim == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
        raise InputError(
            f"input_ids must be a non-empty list of token ids (int[P]), got an array of shape "
            f"{prompt.shape} and dtype {prompt.dtype}."
        )
    if prompt.min() < 0 or prompt.max() >= vocab_size:
        bad = int(prompt[(prompt < 0) | (prompt >= vocab_size)][0])
        raise InputError(
            f"input_ids holds id {bad}, outside the vocabulary [0, {vocab_size}). Tokenize with "
            "the model's tokenizer."
        )
    length = prompt.size
    if config.max_new_tokens is not None:
        new = config.max_new_tokens
    else:
        new = resolved.max_length - length
    if new < 1:
        raise InputError(
            f"nothing to generate: the prompt has {length} tokens and max_length is "
            f"{resolved.max_length}. Set max_new_tokens."
        )
    if length + new > shape.max_length:
        raise InputError(
            f"prompt length {length} + max_new_tokens {new} = {length + new} tokens can never "
            f"fit the engine's cache of {shape.max_length} tokens per request. Shorten the "
            "request or raise ContinuousBatchingConfig.max_length."
        )
    stops = resolved.stop_strings
    stops = () if stops is None else ((stops,) if isinstance(stops, str) else tuple(stops))
    if stops and tokenizer is None:
        raise InputError(
            "stop_strings need a tokenizer: pass tokenizer= to init_continuous_batching."
        )
    eos = _eos_ids(resolved, shape.max_eos)
    if seed is None:
        seed = int(np.random.default_rng().integers(0, INT32_MAX))
    elif isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise InputError(f"seed must be an int, got {seed!r}.")
    elif not INT32_MIN <= seed <= INT32_MAX:
        raise InputError(
            f"seed must be in [{INT32_MIN}, {INT32_MAX}] (a 32-bit key, as "
            f"jax.random.key makes without x64), got {seed}."
        )
    constraint, key = extras.constraint, b""
    if constraint is not None:
        states, edges = shape.constraint_states, shape.constraint_edges
        check_constraint(constraint, states, edges, vocab_size, eos)
        key = constraint_key(constraint)
    row = _row(resolved, eos, int(seed), shape, extras)
    # min_length counts the prompt too (transformers' input_ids): as a count of new tokens
    at_least = max(row.min_new_tokens[0], min((resolved.min_length or 0) - length, INT32_MAX))
    row = row.replace(
        max_new_tokens=np.asarray([new], np.int32),
        min_new_tokens=np.asarray([at_least], np.int32),
        forced_first=np.asarray([_check_rule_order(resolved, length)], np.int32),
    )
    return RequestState(
        request_id=request_id,
        prompt=[int(t) for t in prompt],
        row=row,
        max_new_tokens=int(new),
        eos_token_ids=eos,
        stop_strings=stops,
        streaming=streaming,
        num_logprobs=extras.logprobs,
        constraint=constraint,
        constraint_key=key,
        copies=copies,
        max_time=None if resolved.max_time is None else float(resolved.max_time),
    )
