"""The entry point: validate inputs, prefill, run the decoding loop, assemble the output.

Static or traced:
    Static (a change compiles a new program): the model, the prompt bucket length, the number of
    new tokens ``N``, ``num_return_sequences``, ``num_beams``, ``early_stopping``, which
    processors are enabled, the output flags, the user's extra processors and stopping criteria,
    whether ``max_time`` is set, and the number of stop strings and the shapes of their tables.
    Traced (a change reuses the compiled program): the parameters, the token ids and mask, the
    PRNG key, every sampling value (``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``), ``length_penalty``, the pad and EOS ids, the ``max_time`` value,
    the stop-string tables' contents, and the prompt length within its bucket.

Prompt buckets: called with concrete arrays, ``generate`` left-pads the prompt to the next bucket
length (a power of two, at least 16) with masked slots, so nearby prompt lengths share one
program; the padding is removed from ``sequences`` before it is returned, and transformers'
length rules (``min_length``, repetition penalty) ignore it. Inside a user's ``jax.jit`` the
prompt shape is already fixed and no padding is added.

Differences from transformers forced by static shapes: outputs always hold ``N`` steps
(see :mod:`genjax.outputs`); ``use_cache=False`` gives the same tokens through the cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from genjax.config import GenerationConfig
from genjax.decoding import beam
from genjax.decoding.sampling import (
    DecodeRules,
    DecodeState,
    decode,
    greedy_chooser,
    sampling_chooser,
)
from genjax.errors import InputError, UnsupportedError
from genjax.outputs import GenerateOutput
from genjax.processors import LogitsContext, Processor, from_config, validate_config
from genjax.stopping import (
    StopCriterion,
    as_criteria,
    start_timer,
    stop_string_table,
    stopping_rules,
)
from genjax.typing import Array, PyTree

MIN_BUCKET = 16
_SUPPORTED_MODES = ("greedy_search", "sample", "beam_search", "beam_sample")


def bucket_length(prompt_length: int) -> int:
    """The padded prompt length: the next power of two, at least ``MIN_BUCKET``.

    Example:
        >>> bucket_length(20)
        32
    """
    return max(MIN_BUCKET, 1 << (max(prompt_length, 1) - 1).bit_length())


def generate(
    model,
    params: PyTree,
    input_ids: Array,
    config: GenerationConfig | None = None,
    *,
    attention_mask: Array | None = None,
    key: Array | None = None,
    logits_processor: Sequence[Processor] = (),
    allowed_tokens_fn: Callable[[Array, Array], Array] | None = None,
    stopping_criteria: Sequence[StopCriterion] = (),
    tokenizer=None,
    **config_overrides,
) -> GenerateOutput:
    """Generates tokens after ``input_ids``: greedy, sampling, beam search or beam sampling.

    The strategy follows ``config.generation_mode``. Beam search (``num_beams > 1``; see
    :mod:`genjax.decoding.beam`) also returns ``sequences_scores`` float32[B*R] and
    ``beam_indices`` int32[B*R, N], and its ``scores``/``logits`` have ``B*M`` rows.

    Args:
        model: a model following the protocol of :mod:`genjax.models` (hashable; static).
        params: the model parameters (traced).
        input_ids: int[B, P] prompts, left-padded when their lengths differ.
        config: a :class:`GenerationConfig`; None means ``GenerationConfig()``. Its traced values
            may be per row (shape ``[B]``).
        attention_mask: int or bool[B, P], 1 on real tokens. When None it is inferred as
            transformers does: ``input_ids != pad_token_id`` if the pad id occurs in the input
            and is not an EOS id, else all ones.
        key: a PRNG key (``jax.random.key(seed)``); required when sampling.
        logits_processor: extra processors (``(scores[B, V], context) -> scores``) applied after
            the configured ones and before the sampling warpers, as in transformers. Static:
            pass the same objects to reuse a compiled program.
        allowed_tokens_fn: a jittable ``fn(tokens int32[B, S], length int32[]) -> bool[B, V]``
            mask of the tokens allowed next, transformers' ``prefix_allowed_tokens_fn`` (see
            :func:`genjax.processors.allowed_tokens`). Static: pass the same function to reuse a
            compiled program.
        stopping_criteria: extra stopping rules ``fn(tokens int32[B, S], length int32[]) ->
            bool[B]``, True where a row is done, checked after each new token (the newest at
            slot ``length - 1``) like transformers' ``StoppingCriteriaList``; see
            :data:`genjax.stopping.StopCriterion`. Static: hashable callables.
        tokenizer: the model's tokenizer (a transformers tokenizer, a ``tokenizers.Tokenizer``,
            or an object with ``get_vocab()``), required by ``config.stop_strings``. Its tables
            are built once per vocabulary and stop strings, then traced.
        **config_overrides: generation config fields overriding ``config`` for this call.

    Returns:
        A :class:`GenerateOutput`; ``sequences`` is int32[B*R, P+N].

    Raises:
        InputError: malformed ``input_ids``, ``attention_mask`` or ``key``; ``stop_strings``
            without a ``tokenizer``.
        TypeError: a stopping criterion that is not a hashable callable.
        GenerationConfigError: an invalid config.
        UnsupportedError: a generation mode or option genjax does not support yet.

    Example:
        >>> cfg = GenerationConfig(max_new_tokens=8, do_sample=True, temperature=0.7)
        >>> out = genjax.generate(model, params, ids, cfg, key=jax.random.key(0))
        >>> out.sequences.shape
        (1, 13)
    """
    config = _effective_config(config, config_overrides)
    resolved = config.with_defaults()
    _check_mode(resolved)
    validate_config(resolved, model.vocab_size)
    input_ids, attention_mask, key = _check_inputs(model, input_ids, attention_mask, key, resolved)
    prompt_length = input_ids.shape[1]
    max_new_tokens = _num_new_tokens(config, resolved, prompt_length, model)
    if resolved.min_new_tokens is not None:  # transformers: min_new_tokens overrides min_length
        resolved = resolved.replace(min_length=0)
    stopping_criteria = as_criteria(stopping_criteria)
    if stopping_criteria and resolved.num_beams > 1:
        raise UnsupportedError(
            "stopping_criteria are not supported with beam search yet: beams stop on EOS and "
            "length only. Remove stopping_criteria, or set num_beams=1."
        )
    stop_strings = _stop_string_table(resolved, tokenizer)

    pad_token_id, eos_token_ids = _special_ids(resolved)
    if attention_mask is None:
        attention_mask = _infer_attention_mask(input_ids, pad_token_id, eos_token_ids)
    input_ids = jnp.asarray(input_ids, jnp.int32)
    attention_mask = jnp.asarray(attention_mask, jnp.int32)
    offset = 0
    if not isinstance(input_ids, jax.core.Tracer):
        offset = bucket_length(prompt_length) - prompt_length
        input_ids, attention_mask = _pad_left(input_ids, attention_mask, pad_token_id, offset)
    out = _generate_jit(
        model,
        params,
        input_ids,
        attention_mask,
        resolved,
        key if key is not None else jax.random.key(0),
        jnp.asarray(offset, jnp.int32),
        stop_strings,
        max_new_tokens=max_new_tokens,
        logits_processor=tuple(logits_processor),
        allowed_tokens_fn=allowed_tokens_fn,
        stopping_criteria=stopping_criteria,
    )
    if offset:
        out = out.replace(sequences=out.sequences[:, offset:])
    return out


@functools.partial(
    jax.jit,
    static_argnames=(
        "model",
        "max_new_tokens",
        "logits_processor",
        "allowed_tokens_fn",
        "stopping_criteria",
    ),
)
def _generate_jit(
    model,
    params,
    input_ids,
    attention_mask,
    config,
    key,
    offset,
    stop_strings=None,
    *,
    max_new_tokens,
    logits_processor,
    allowed_tokens_fn=None,
    stopping_criteria=(),
) -> GenerateOutput:
    """The compiled body of ``generate``: prefill, repeat rows for ``num_return_sequences``,
    decode. ``offset`` (traced) counts the bucket padding slots at the start of each row;
    ``stop_strings`` is a :class:`~genjax.stopping.StopStringTable` or None."""
    if config.num_beams > 1:
        return _generate_beams(
            model,
            params,
            input_ids,
            attention_mask,
            config,
            key,
            offset,
            max_new_tokens=max_new_tokens,
            logits_processor=logits_processor,
            allowed_tokens_fn=allowed_tokens_fn,
        )
    pad_token_id, eos_token_ids = _special_ids(config)
    stopping = stopping_rules(
        eos_token_ids,
        criteria=stopping_criteria,
        stop_strings=stop_strings,
        max_time=config.max_time,
        first_slot=offset,
    )
    # max_time counts from here, before the prefill, as transformers' MaxTimeCriteria does.
    stopping, (input_ids,) = start_timer(stopping, input_ids)
    batch, prompt_length = input_ids.shape
    rows = jnp.repeat(jnp.arange(batch), config.num_return_sequences)  # int32[B*R]
    logits, cache, cache_mask, tokens = _prefill(
        model, params, input_ids, attention_mask, max_new_tokens, pad_token_id
    )
    recorded = (batch * config.num_return_sequences, max_new_tokens, logits.shape[-1])
    state = DecodeState(
        tokens=tokens[rows],
        length=jnp.asarray(prompt_length, jnp.int32),
        positions=jnp.sum(attention_mask, axis=-1)[rows].astype(jnp.int32),
        cache=cache.gather_rows(rows),
        attention_mask=cache_mask[rows],
        finished=jnp.zeros(rows.shape, bool),
        key=key,
        scores=jnp.zeros(recorded) if config.output_scores else None,
        raw_logits=jnp.zeros(recorded) if config.output_logits else None,
    )
    context = _prompt_context(state.tokens, state.length, state.attention_mask, offset)
    rules = DecodeRules(
        process=from_config(
            config, eos_token_ids, extra=logits_processor, allowed_tokens_fn=allowed_tokens_fn
        ),
        choose=sampling_chooser() if config.do_sample else greedy_chooser(),
        context=context,
        pad_token_id=pad_token_id,
        stopping=stopping,
    )
    state = decode(model.apply, params, state, logits[rows, -1], rules)
    return GenerateOutput(sequences=state.tokens, scores=state.scores, logits=state.raw_logits)


def _generate_beams(
    model,
    params,
    input_ids,
    attention_mask,
    config,
    key,
    offset,
    *,
    max_new_tokens,
    logits_processor,
    allowed_tokens_fn=None,
) -> GenerateOutput:
    """Beam search / beam sampling: prefill each prompt once, repeat its cache rows for the M
    beams, run :func:`genjax.decoding.beam.beam_search`, return the R best hypotheses."""
    pad_token_id, eos_token_ids = _special_ids(config)
    batch = input_ids.shape[0]
    num_beams = config.num_beams
    logits, cache, cache_mask, tokens = _prefill(
        model, params, input_ids, attention_mask, max_new_tokens, pad_token_id
    )
    recorded = (batch * num_beams, max_new_tokens, logits.shape[-1])
    state = beam.init_state(
        tokens,
        cache,
        cache_mask,
        key,
        num_beams=num_beams,
        num_new_tokens=max_new_tokens,
        scores_shape=recorded if config.output_scores else None,
        logits_shape=recorded if config.output_logits else None,
    )
    context = _prompt_context(state.tokens, state.length, state.attention_mask, offset)
    rules = beam.BeamRules(
        process=from_config(
            config, eos_token_ids, extra=logits_processor, allowed_tokens_fn=allowed_tokens_fn
        ),
        do_sample=bool(config.do_sample),
        early_stopping=config.early_stopping,
        context=context,
        length_penalty=config.length_penalty,
        eos_token_ids=eos_token_ids,
    )
    first_logits = jnp.repeat(logits[:, -1], num_beams, axis=0)
    state = beam.beam_search(model.apply, params, state, first_logits, rules)
    sequences, sequences_scores, beam_indices = beam.best_hypotheses(
        state, config.num_return_sequences
    )
    return GenerateOutput(
        sequences=sequences,
        scores=state.scores,
        logits=state.raw_logits,
        sequences_scores=sequences_scores,
        beam_indices=beam_indices,
    )


def _stop_string_table(config: GenerationConfig, tokenizer):
    """The stop-string tables (built on the host, cached), or None without stop strings."""
    if config.stop_strings is None:
        return None
    if tokenizer is None:
        raise InputError(
            f"stop_strings={config.stop_strings!r} need the model's tokenizer to find the tokens "
            f"that spell them, but no tokenizer was given. Pass tokenizer= to generate (a "
            f"transformers tokenizer or a tokenizers.Tokenizer), or unset stop_strings."
        )
    return stop_string_table(tokenizer, config.stop_strings)


def _prefill(model, params, input_ids, attention_mask, max_new_tokens: int, pad_token_id):
    """Runs the prompt through the model into a cache sized for all ``S = P + N`` slots.

    Returns:
        ``(logits float32[B, P, V], cache, cache_mask int32[B, S], tokens int32[B, S])``:
        ``cache_mask`` marks real prompt tokens and every new slot; ``tokens`` is the prompt
        followed by ``pad_token_id`` in the new slots.
    """
    batch, prompt_length = input_ids.shape
    # Position ids as transformers v5 computes them: count real tokens; padding gets 0.
    positions = jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0)
    new_slots = jnp.ones((batch, max_new_tokens), jnp.int32)
    cache_mask = jnp.concatenate([attention_mask, new_slots], axis=1)
    cache = model.init_cache(batch, prompt_length + max_new_tokens)
    logits, cache = model.apply(params, input_ids, positions, cache, cache_mask)
    tokens = jnp.concatenate([input_ids, new_slots * pad_token_id], axis=1)
    return logits, cache, cache_mask, tokens


def _prompt_context(tokens, length, attention_mask, offset) -> LogitsContext:
    """The processors' view of the prompt, before the first new token."""
    return LogitsContext(
        tokens=tokens,
        length=length,
        offset=offset,
        prompt_end=length,
        first_valid=jnp.argmax(attention_mask != 0, axis=-1).astype(jnp.int32),
    )


def _special_ids(config: GenerationConfig) -> tuple[Array, Array | None]:
    """Returns (pad id int32[], EOS ids int32[E] or None); the pad id defaults to the first EOS
    id, as in transformers, or 0 when there is no EOS (then no row is ever padded)."""
    eos = config.eos_token_id
    eos_token_ids = None if eos is None else jnp.atleast_1d(jnp.asarray(eos, jnp.int32))
    if config.pad_token_id is not None:
        pad = jnp.asarray(config.pad_token_id, jnp.int32)
    elif eos_token_ids is not None:
        pad = eos_token_ids[0]
    else:
        pad = jnp.zeros((), jnp.int32)
    return pad, eos_token_ids


def _infer_attention_mask(input_ids: Array, pad_token_id: Array, eos_token_ids: Array | None):
    """transformers' default mask: ``ids != pad`` if pad occurs in the input and is not EOS."""
    has_pad = jnp.any(input_ids == pad_token_id)
    if eos_token_ids is not None:
        has_pad = has_pad & ~jnp.any(eos_token_ids == pad_token_id)
    return jnp.where(has_pad, input_ids != pad_token_id, True).astype(jnp.int32)


def _pad_left(input_ids: Array, attention_mask: Array, pad_token_id: Array, extra: int):
    """Left-pads int32[B, P] ids and mask with ``extra`` masked slots."""
    if not extra:
        return input_ids, attention_mask
    batch = input_ids.shape[0]
    ids = jnp.concatenate([jnp.full((batch, extra), pad_token_id, jnp.int32), input_ids], 1)
    mask = jnp.concatenate([jnp.zeros((batch, extra), jnp.int32), attention_mask], 1)
    return ids, mask


def _effective_config(config: GenerationConfig | None, overrides: dict) -> GenerationConfig:
    if config is None:
        config = GenerationConfig()
    elif not isinstance(config, GenerationConfig):
        raise TypeError(
            f"generate() expects `config` to be a genjax.GenerationConfig or None, got "
            f"{type(config).__name__}. Build one with GenerationConfig(...) or "
            f"GenerationConfig.from_pretrained(path)."
        )
    if overrides:
        config, unused = config.update(**overrides)
        if unused:
            raise TypeError(
                f"generate() got unexpected keyword arguments {sorted(unused)}: they are not "
                f"GenerationConfig fields. Check their spelling against GenerationConfig."
            )
    return config


def _check_mode(config: GenerationConfig) -> None:
    if config.num_beams > 1:
        beam.check_supported(config)
    mode = str(config.generation_mode.value)
    if mode not in _SUPPORTED_MODES:
        raise UnsupportedError(
            f"generation mode {mode!r} is not supported by genjax yet; supported: "
            f"{', '.join(_SUPPORTED_MODES)}. Set num_beams=1 and leave assistant / contrastive "
            f"/ DoLa options unset."
        )


def _check_inputs(model, input_ids, attention_mask, key, config):
    """Validates the arrays at the Python boundary (values only when they are concrete)."""
    if not hasattr(input_ids, "shape"):
        input_ids = np.asarray(input_ids)
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise InputError(
            f"`input_ids` must be an integer array of shape [batch, prompt_length]; got dtype "
            f"{input_ids.dtype} and shape {tuple(input_ids.shape)}. For one prompt use "
            f"ids[None, :]."
        )
    if input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise InputError(
            f"`input_ids` must hold at least one prompt of at least one token; got shape "
            f"{tuple(input_ids.shape)}."
        )
    if not isinstance(input_ids, jax.core.Tracer):
        values = np.asarray(input_ids)
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= model.vocab_size:
            raise InputError(
                f"`input_ids` holds ids in [{low}, {high}], outside the model's vocabulary "
                f"[0, {model.vocab_size - 1}]. Tokenize with the model's own tokenizer."
            )
    if attention_mask is not None:
        if not hasattr(attention_mask, "shape"):
            attention_mask = np.asarray(attention_mask)
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise InputError(
                f"`attention_mask` must have the shape of `input_ids` {tuple(input_ids.shape)}; "
                f"got {tuple(attention_mask.shape)}."
            )
    if config.do_sample and key is None:
        raise InputError(
            "sampling (do_sample=True) needs an explicit PRNG key: pass key=jax.random.key(seed)."
        )
    if key is not None and not (
        isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    ):
        if isinstance(key, jax.Array) and key.shape == (2,) and key.dtype == jnp.uint32:
            key = jax.random.wrap_key_data(key)
        else:
            raise InputError(
                f"`key` must be a single PRNG key from jax.random.key(seed); got "
                f"{type(key).__name__} {getattr(key, 'shape', '')}."
            )
    if key is not None and key.shape != ():
        raise InputError(f"`key` must be a single key of shape (); got shape {key.shape}.")
    return input_ids, attention_mask, key


def _num_new_tokens(config, resolved, prompt_length: int, model) -> int:
    """N, by transformers' rules: ``max_new_tokens`` wins; else ``max_length - P`` when
    ``max_length`` was set; else 20 new tokens, capped by ``max_position_embeddings``."""
    limit = getattr(model, "max_position_embeddings", None)
    if config.max_new_tokens is not None:
        new = config.max_new_tokens
    elif config.max_length is not None:
        new = config.max_length - prompt_length
    else:
        new = resolved.max_length
        if limit is not None:
            new = min(new, limit - prompt_length)
    if new < 1:
        raise InputError(
            f"nothing to generate: the prompt has {prompt_length} tokens and the config allows "
            f"max_length={config.max_length}, max_new_tokens={config.max_new_tokens}. Set "
            f"max_new_tokens to the number of tokens to generate."
        )
    if limit is not None and prompt_length + new > limit:
        raise InputError(
            f"prompt length {prompt_length} + {new} new tokens = {prompt_length + new} exceeds "
            f"the model's max_position_embeddings={limit}. Shorten the prompt or lower "
            f"max_new_tokens to at most {limit - prompt_length}."
        )
    return int(new)
