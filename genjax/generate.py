"""The entry point: validate inputs, prefill, run the decoding loop, assemble the output.

Static or traced:
    Static (a change compiles a new program): the model, the batch size, the prompt bucket
    length and the number of new tokens ``N`` (without ``max_cache_len``), ``max_cache_len``
    and the bucket policy, ``num_return_sequences``, ``num_beams``, ``early_stopping``, which
    processors are enabled, the output flags, the user's extra processors and stopping criteria,
    whether ``max_time`` is set, the number of stop strings and the shapes of their tables,
    whether a ``streamer`` is given, and the ``mesh`` and sharding ``rules`` (or the mesh set by
    ``jax.set_mesh``; see :mod:`genjax.sharding`).
    Traced (a change reuses the compiled program): the parameters, the token ids and mask, the
    PRNG key, every sampling value (``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``), ``length_penalty``, the pad and EOS ids, the ``max_time`` value,
    the stop-string tables' contents, the prompt length within its bucket (with
    ``max_cache_len``: any prompt length and ``N``), and which streamer receives the tokens (a
    new streamer object reuses the program).

Prompt buckets: called with concrete arrays, ``generate`` left-pads the prompt to the next bucket
length (by default a power of two, at least 16; ``prompt_buckets=`` picks another policy, see
:mod:`genjax.buckets`) with masked slots, so nearby prompt lengths share one program; the padding
is removed from ``sequences`` before it is returned, and transformers' length rules
(``min_length``, repetition penalty) ignore it. Inside a user's ``jax.jit`` the prompt shape is
already fixed and no padding is added.

One program for many calls: with ``max_cache_len`` (a config field) the cache and token buffer
are preallocated once, and the prompt length, its bucket and ``max_new_tokens`` become traced:
every greedy or sampling call with ``P + N <= max_cache_len`` and the same batch size runs one
program, and outputs have ``max_cache_len`` columns (see :mod:`genjax.cache_slots`).
:func:`genjax.warmup` compiles programs ahead of time.

Differences from transformers forced by static shapes: outputs always hold ``N`` steps
(see :mod:`genjax.outputs`); ``use_cache=False`` gives the same tokens through the cache.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from genjax import buckets, cache_slots
from genjax.config import GenerationConfig
from genjax.decoding import assisted, beam
from genjax.decoding.sampling import (
    DecodeRules,
    DecodeState,
    decode,
    greedy_chooser,
    sampling_chooser,
)
from genjax.errors import InputError, ShardingError, UnsupportedError
from genjax.memory import CacheRequest, check_fits
from genjax.outputs import GenerateOutput
from genjax.processors import LogitsContext, Processor, from_config, validate_config
from genjax.quantized_cache import check_cache_options, init_cache
from genjax.sharding import Layout, context_layout, layout_for
from genjax.stopping import (
    StopCriterion,
    as_criteria,
    start_timer,
    stop_string_table,
    stopping_rules,
)
from genjax.streaming import check_streamer, stream_to, token_hook
from genjax.typing import Array, PyTree

MIN_BUCKET = buckets.DEFAULT.size
_SUPPORTED_MODES = ("greedy_search", "sample", "beam_search", "beam_sample", "assisted_generation")


def bucket_length(prompt_length: int) -> int:
    """The padded prompt length under the default policy (``prompt_buckets=None``): the next
    power of two, at least ``MIN_BUCKET``; see :mod:`genjax.buckets` for the others.

    Example:
        >>> bucket_length(20)
        32
    """
    return buckets.DEFAULT.length(prompt_length)


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
    streamer=None,
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
    assistant_model=None,
    assistant_params: PyTree = None,
    prompt_buckets=None,
    **config_overrides,
) -> GenerateOutput:
    """Generates tokens after ``input_ids``: greedy, sampling, beam search or beam sampling,
    optionally assisted by a draft model or by prompt lookup.

    The strategy follows ``config.get_generation_mode(assistant_model)``. Beam search
    (``num_beams > 1``; see :mod:`genjax.decoding.beam`) also returns ``sequences_scores``
    float32[B*R] and ``beam_indices`` int32[B*R, N], and its ``scores``/``logits`` have ``B*M``
    rows. Assisted generation (an ``assistant_model``, or ``prompt_lookup_num_tokens`` set; see
    :mod:`genjax.decoding.assisted`) runs speculative decoding for the whole batch in one loop:
    greedy output equals plain greedy decoding, sampled output follows the same distribution,
    and ``num_accepted_tokens`` int32[B] counts the accepted candidates per row. Its KV caches
    hold up to ``min(B, G + 1)`` times more slots than plain decoding's (``G`` =
    ``num_assistant_tokens``); no beams, streamer or mesh.

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
        streamer: a :mod:`genjax.streaming` streamer (``TextStreamer``,
            ``TextIteratorStreamer``, or any object with ``put(ids)`` and ``end()``), as in
            transformers: ``put`` gets the prompt int32[1, P] first, then each new token
            int32[1] as the compiled loop produces it (an ordered host callback, so in order),
            and ``end()`` is called once the result is ready. Batch size 1 with
            ``num_return_sequences=1``, no beam search, and a call with concrete arrays (not
            inside your own ``jax.jit``). Which streamer is traced: a new one reuses the
            compiled program; None compiles no callback.
        mesh: a ``jax.sharding.Mesh`` to run the whole call on (static; see
            :mod:`genjax.sharding`): params not already on it are placed with
            ``shard_params``, ``input_ids``/``attention_mask`` get their rows on ``data``, the
            loop carry (token buffer, per-row state, KV cache with ``K`` on ``model``) keeps its
            shardings step to step, and the outputs come back with their rows on ``data``. None
            uses the mesh set by ``jax.set_mesh`` if any (constraints only), else one device.
            A multi-host mesh works the same way on every process. Leave it None inside
            ``jax.shard_map`` (each block runs ``generate``; a mesh there raises).
        rules: logical-axis rules for ``mesh`` (static); None means
            ``genjax.sharding.DEFAULT_RULES``.
        assistant_model: a draft model with the target's vocabulary (static), for speculative
            decoding: it proposes up to ``config.num_assistant_tokens`` tokens per round
            (schedule ``num_assistant_tokens_schedule``, stopping early below
            ``assistant_confidence_threshold``), the target checks them in one pass.
        assistant_params: the draft's parameters (traced); required with ``assistant_model``.
        prompt_buckets: the prompt-length bucket policy (static; :mod:`genjax.buckets`): None
            for powers of two from 16, an int ``n`` for multiples of ``n``, a sequence of bucket
            lengths, or a ``genjax.buckets`` policy. With ``max_cache_len`` only its
            granularity counts (the prefill chunk).
        **config_overrides: generation config fields overriding ``config`` for this call.

    Returns:
        A :class:`GenerateOutput`; ``sequences`` is int32[B*R, P+N]. With ``max_cache_len = M``
        (static): ``sequences`` is int32[B*R, M], the prompt, its ``N`` new tokens, then
        ``pad_token_id``; ``scores``/``logits`` hold ``M - 1`` steps, 0 from step ``N`` on.

    Raises:
        InputError: malformed ``input_ids``, ``attention_mask`` or ``key``; ``stop_strings``
            without a ``tokenizer``; ``P + N > max_cache_len``; a bad ``prompt_buckets``.
        CacheMemoryError: an InputError: the KV caches would not fit in the devices' free
            memory (the message gives both figures; see :mod:`genjax.memory`).
        TypeError: a stopping criterion that is not a hashable callable.
        GenerationConfigError: an invalid config.
        UnsupportedError: a generation mode or option genjax does not support yet (also beam
            search or assisted generation with ``max_cache_len``).
        ShardingError: with a mesh, a batch or head count that does not divide over its axis;
            ``mesh=`` inside ``shard_map``.

    Example:
        >>> cfg = GenerationConfig(max_new_tokens=8, do_sample=True, temperature=0.7)
        >>> out = genjax.generate(model, params, ids, cfg, key=jax.random.key(0))
        >>> out.sequences.shape
        (1, 13)
    """
    config = _effective_config(config, config_overrides)
    resolved = config.with_defaults()
    _check_mode(resolved, assistant_model)
    validate_config(resolved, model.vocab_size)
    check_cache_options(resolved.cache_implementation, resolved.cache_config)
    input_ids, attention_mask, key = _check_inputs(model, input_ids, attention_mask, key, resolved)
    layout = _layout(model, mesh, rules, input_ids.shape[0])
    if assisted.is_assisted(resolved, assistant_model):
        assisted.check_call(resolved, model, assistant_model, assistant_params, len(input_ids))
        _check_assisted_extras(streamer, layout)
    prompt_length = input_ids.shape[1]
    max_new_tokens = _num_new_tokens(config, resolved, prompt_length, model)
    policy = buckets.resolve(prompt_buckets)
    slots = cache_slots.plan(
        resolved,
        policy,
        prompt_length,
        max_new_tokens,
        assisted.is_assisted(resolved, assistant_model),
    )
    if resolved.min_new_tokens is not None:  # transformers: min_new_tokens overrides min_length
        resolved = resolved.replace(min_length=0)
    stopping_criteria = as_criteria(stopping_criteria)
    stop_strings = _stop_string_table(resolved, tokenizer)
    if streamer is not None:
        traced = (params, input_ids, attention_mask, key)
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(traced))
        check_streamer(streamer, input_ids, resolved, traced)
    prompt_ids = input_ids  # as given, for the streamer

    pad_token_id, eos_token_ids = _special_ids(resolved)
    if attention_mask is None:
        attention_mask = _infer_attention_mask(input_ids, pad_token_id, eos_token_ids)
    input_ids, attention_mask = _as_int32(input_ids), _as_int32(attention_mask)
    offset, bounds, cache_new = 0, None, max_new_tokens
    if slots is not None:  # one program for every P + N <= max_cache_len: see cache_slots
        input_ids, attention_mask, offset, prompt_end = slots.place(
            input_ids, attention_mask, pad_token_id
        )
        bounds = jax.device_put(np.array([prompt_end, prompt_end + max_new_tokens], np.int32))
        resolved = resolved.replace(max_new_tokens=None, max_length=None)  # traced in bounds
        max_new_tokens, cache_new = slots.max_steps, 0
    elif not isinstance(input_ids, jax.core.Tracer):
        offset = policy.length(prompt_length) - prompt_length
        input_ids, attention_mask = _pad_left(input_ids, attention_mask, pad_token_id, offset)
    check_fits(
        _cache_requests(model, resolved, input_ids.shape, cache_new, assistant_model), layout
    )
    if mesh is not None:  # concrete arrays only; inside a user's jit the constraints place them
        params = layout.place_params(params)
        input_ids, attention_mask = layout.place_rows(input_ids, attention_mask)
    with stream_to(streamer, prompt_ids) as stream_id:  # puts the prompt; None: no streamer
        out = _run_program(
            model,
            params,
            input_ids,
            attention_mask,
            resolved,
            key if key is not None else jax.random.key(0),
            jnp.asarray(offset, jnp.int32),
            stop_strings,
            stream_id=stream_id,
            layout=layout,
            max_new_tokens=max_new_tokens,
            logits_processor=tuple(logits_processor),
            allowed_tokens_fn=allowed_tokens_fn,
            stopping_criteria=stopping_criteria,
            assistant=assistant_model,
            assistant_params=assistant_params,
            slots=slots,
            bounds=bounds,
        )
        if stream_id is not None:
            out = jax.block_until_ready(out)  # every token has reached the streamer
    if offset and slots is None:
        out = out.replace(sequences=out.sequences[:, offset:])
    if streamer is not None:
        streamer.end()
    return out


_AHEAD_OF_TIME: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "genjax_ahead_of_time", default=None
)
"""Set by :func:`genjax.warmup` to a list: ``generate`` then compiles instead of running."""


def _run_program(*args, **kwargs) -> GenerateOutput:
    """Runs :func:`_generate_jit`. Under :func:`genjax.warmup` it compiles the program ahead of
    time instead (``lower(...).compile()``, which fills the jit's cache), appends ``(seconds,
    compiled)`` to the warm-up's list and returns zeros shaped like the output."""
    record = _AHEAD_OF_TIME.get()
    if record is None:
        return _generate_jit(*args, **kwargs)
    start = time.perf_counter()
    compiled = _generate_jit.lower(*args, **kwargs).compile()
    record.append((time.perf_counter() - start, compiled))
    # Device arrays, so that generate's own steps on the output (the bucket trim) run too.
    return jax.tree.map(
        lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), compiled.out_info
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "model",
        "max_new_tokens",
        "logits_processor",
        "allowed_tokens_fn",
        "stopping_criteria",
        "layout",
        "assistant",
        "slots",
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
    stream_id=None,
    layout: Layout | None = None,
    max_new_tokens,
    logits_processor,
    allowed_tokens_fn=None,
    stopping_criteria=(),
    assistant=None,
    assistant_params=None,
    slots: cache_slots.FixedSlots | None = None,
    bounds=None,
) -> GenerateOutput:
    """The compiled body of ``generate``: prefill, repeat rows for ``num_return_sequences``,
    decode. ``offset`` (traced) counts the bucket padding slots at the start of each row;
    ``stop_strings`` is a :class:`~genjax.stopping.StopStringTable` or None; ``stream_id``
    (int32[], traced) names the registered streamer, or is None for no streaming; ``layout``
    (static) shards inputs, loop carry and outputs, or is None. With ``max_cache_len``,
    ``slots`` (static) is the buffer layout of :mod:`genjax.cache_slots`, ``bounds`` int32[2]
    (traced) the prompt's end and the loop's end in it, and ``max_new_tokens`` the steps
    recorded in ``scores``/``logits``."""
    if layout is not None:
        input_ids, attention_mask = layout.constrain((input_ids, attention_mask))
    if assisted.is_assisted(config, assistant):
        return _generate_assisted(
            model,
            params,
            input_ids,
            attention_mask,
            config,
            key,
            offset,
            stop_strings,
            assistant=assistant,
            assistant_params=assistant_params,
            max_new_tokens=max_new_tokens,
            logits_processor=logits_processor,
            allowed_tokens_fn=allowed_tokens_fn,
            stopping_criteria=stopping_criteria,
        )
    if config.num_beams > 1:
        return _generate_beams(
            model,
            params,
            input_ids,
            attention_mask,
            config,
            key,
            offset,
            stop_strings,
            max_new_tokens=max_new_tokens,
            logits_processor=logits_processor,
            allowed_tokens_fn=allowed_tokens_fn,
            stopping_criteria=stopping_criteria,
            layout=layout,
        )
    pad_token_id, eos_token_ids = _special_ids(config)
    stopping, input_ids = _start_stopping(
        config, eos_token_ids, stopping_criteria, stop_strings, offset, input_ids
    )
    batch, prompt_length = input_ids.shape
    copies = config.num_return_sequences

    def rows(x):  # row b -> rows b*R .. b*R+R-1, by a reshape: sharded rows stay in place
        return jnp.repeat(x, copies, axis=0)

    length = jnp.asarray(prompt_length, jnp.int32)
    if slots is None:
        logits, cache, cache_mask, tokens = _prefill(
            model,
            params,
            input_ids,
            attention_mask,
            max_new_tokens,
            pad_token_id,
            _quantized(config),
        )
    else:
        cache = init_cache(model, batch, slots.buffer_length, _quantized(config))
        keep_one = _accepts_logits_to_keep(model)
        logits, cache, cache_mask = slots.prefill(
            model, params, input_ids, attention_mask, bounds[0], cache, keep_one=keep_one
        )
        logits, tokens, length = logits[:, None], input_ids, bounds[0]
    recorded = (batch * copies, max_new_tokens, logits.shape[-1])
    state = DecodeState(
        tokens=rows(tokens),
        length=length,
        positions=rows(jnp.sum(attention_mask, axis=-1)).astype(jnp.int32),
        cache=cache.repeat_rows(copies),
        attention_mask=rows(cache_mask),
        finished=jnp.zeros((batch * copies,), bool),
        key=key,
        scores=jnp.zeros(recorded) if config.output_scores else None,
        raw_logits=jnp.zeros(recorded) if config.output_logits else None,
    )
    context = _prompt_context(state.tokens, state.length, state.attention_mask, offset)
    if slots is not None:  # transformers' max_length = P + N, traced
        context = context.replace(max_length=bounds[1] - offset)
    rules = DecodeRules(
        process=from_config(
            config, eos_token_ids, extra=logits_processor, allowed_tokens_fn=allowed_tokens_fn
        ),
        choose=sampling_chooser() if config.do_sample else greedy_chooser(),
        context=context,
        pad_token_id=pad_token_id,
        stopping=stopping,
        on_token=None if stream_id is None else token_hook(stream_id),
        constrain=None if layout is None else layout.constrain,
        end=None if slots is None else bounds[1],
    )
    state = decode(model.apply, params, state, rows(logits[:, -1]), rules)
    sequences = state.tokens if slots is None else slots.sequences(state.tokens, offset)
    out = GenerateOutput(sequences=sequences, scores=state.scores, logits=state.raw_logits)
    return out if layout is None else layout.constrain(out)


def _generate_beams(
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
    layout: Layout | None = None,
) -> GenerateOutput:
    """Beam search / beam sampling: prefill each prompt once, repeat its cache rows for the M
    beams, run :func:`genjax.decoding.beam.beam_search`, return the R best hypotheses."""
    pad_token_id, eos_token_ids = _special_ids(config)
    stopping, input_ids = _start_stopping(
        config, eos_token_ids, stopping_criteria, stop_strings, offset, input_ids
    )
    batch = input_ids.shape[0]
    num_beams = config.num_beams
    logits, cache, cache_mask, tokens = _prefill(
        model, params, input_ids, attention_mask, max_new_tokens, pad_token_id, _quantized(config)
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
        stopping=stopping,
        constrain=None if layout is None else layout.constrain,
    )
    first_logits = jnp.repeat(logits[:, -1], num_beams, axis=0)
    state = beam.beam_search(model.apply, params, state, first_logits, rules)
    sequences, sequences_scores, beam_indices = beam.best_hypotheses(
        state, config.num_return_sequences
    )
    out = GenerateOutput(
        sequences=sequences,
        scores=state.scores,
        logits=state.raw_logits,
        sequences_scores=sequences_scores,
        beam_indices=beam_indices,
    )
    return out if layout is None else layout.constrain(out)


def _generate_assisted(
    model,
    params,
    input_ids,
    attention_mask,
    config,
    key,
    offset,
    stop_strings,
    *,
    assistant,
    assistant_params,
    max_new_tokens,
    logits_processor,
    allowed_tokens_fn=None,
    stopping_criteria=(),
) -> GenerateOutput:
    """Assisted generation (:mod:`genjax.decoding.assisted`): prefill the target and the draft
    (None for prompt lookup) into caches sized for the rolled-back slots, then draft, verify
    and commit in one loop."""
    pad_token_id, eos_token_ids = _special_ids(config)
    stopping, input_ids = _start_stopping(
        config, eos_token_ids, stopping_criteria, stop_strings, offset, input_ids
    )
    batch, prompt_length = input_ids.shape
    limits = [getattr(m, "max_position_embeddings", None) for m in (model, assistant)]
    limits = [limit for limit in limits if limit is not None]
    rules = assisted.make_rules(
        config,
        eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id,
        context=_prompt_context(input_ids, prompt_length, attention_mask, offset),
        stopping=stopping,
        num_new_tokens=max_new_tokens,
        with_draft=assistant is not None,
        extra=logits_processor,
        allowed_tokens_fn=allowed_tokens_fn,
        max_position=min(limits) if limits else None,
    )
    sizes = assisted.cache_lengths(prompt_length, max_new_tokens, batch, rules.num_candidates)
    quantized = _quantized(config)
    logits, cache, cache_mask, _ = _prefill(
        model, params, input_ids, attention_mask, sizes[0] - prompt_length, pad_token_id, quantized
    )
    draft_cache = draft_mask = None
    if assistant is not None:
        _, draft_cache, draft_mask, _ = _prefill(
            assistant,
            assistant_params,
            input_ids,
            attention_mask,
            sizes[1] - prompt_length,
            0,
            quantized,
        )
    state = assisted.init_state(
        input_ids,
        cache,
        cache_mask,
        draft_cache,
        draft_mask,
        key,
        rules,
        vocab_size=logits.shape[-1],
        record_scores=bool(config.output_scores),
        record_logits=bool(config.output_logits),
    )
    draft_step = None if assistant is None else assistant.apply
    state = assisted.decode(
        model.apply, params, draft_step, assistant_params, state, logits[:, -1], rules
    )
    sequences, scores, raw_logits = assisted.finish(state, rules)
    return GenerateOutput(
        sequences=sequences,
        scores=scores,
        logits=raw_logits,
        num_accepted_tokens=state.num_accepted,
    )


def _check_assisted_extras(streamer, layout) -> None:
    """Assisted generation does not stream or shard yet: say so before anything is traced."""
    if streamer is not None:
        raise UnsupportedError(
            "streamer= is not supported with assisted generation (assistant_model= or "
            "prompt_lookup_num_tokens) yet. Drop the streamer, or the assistant."
        )
    if layout is not None:
        raise UnsupportedError(
            "assisted generation (assistant_model= or prompt_lookup_num_tokens) does not run on "
            "a mesh yet. Call generate without mesh= and outside `jax.set_mesh`."
        )


def _layout(model, mesh, rules, batch: int) -> Layout | None:
    """The sharding layout of a call: from ``mesh``, else from the mesh set by
    ``jax.set_mesh``, else None (one device); checked against the model and batch."""
    if mesh is not None:
        manual = tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
        if manual:
            raise ShardingError(
                f"generate() got mesh= inside shard_map (or pmap), whose mesh axes {manual} are "
                f"manual: there every array is already one device's block. Drop mesh= inside "
                f"shard_map: generate then runs on each block, and constrains any axes left "
                f"automatic (not in shard_map's axis_names=) by the mesh in effect."
            )
        return layout_for(model, mesh, rules, batch)
    layout = context_layout(model, rules, batch)
    if layout is None and rules is not None:
        raise InputError(
            "generate() got sharding rules= but no mesh: pass mesh=genjax.sharding.make_mesh("
            "...) too, or call it under `with jax.set_mesh(mesh):`."
        )
    return layout


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


def _start_stopping(config, eos_token_ids, criteria, stop_strings, offset, input_ids):
    """The call's :class:`~genjax.stopping.StoppingRules`, with the ``max_time`` clock started.

    Call it first in the compiled program and use the returned ``input_ids``: ``max_time``
    counts from here, before the prefill, as transformers' ``MaxTimeCriteria`` does.
    """
    stopping = stopping_rules(
        eos_token_ids,
        criteria=criteria,
        stop_strings=stop_strings,
        max_time=config.max_time,
        first_slot=offset,
    )
    stopping, (input_ids,) = start_timer(stopping, input_ids)
    return stopping, input_ids


def _prefill(
    model, params, input_ids, attention_mask, max_new_tokens: int, pad_token_id, quantized=False
):
    """Runs the prompt through the model into a cache sized for all ``S = P + N`` slots
    (int8 codes when ``quantized``, static: see :mod:`genjax.quantized_cache`).

    Returns:
        ``(logits float32[B, 1 or P, V], cache, cache_mask int32[B, S], tokens int32[B, S])``
        (one row of logits when the model takes ``logits_to_keep``; callers use the last):
        ``cache_mask`` marks real prompt tokens and every new slot; ``tokens`` is the prompt
        followed by ``pad_token_id`` in the new slots.
    """
    batch, prompt_length = input_ids.shape
    # Position ids as transformers v5 computes them: count real tokens; padding gets 0.
    positions = jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0)
    new_slots = jnp.ones((batch, max_new_tokens), jnp.int32)
    cache_mask = jnp.concatenate([attention_mask, new_slots], axis=1)
    cache = init_cache(model, batch, prompt_length + max_new_tokens, quantized)
    if _accepts_logits_to_keep(model):  # the last position's logits only: [B, 1, V]
        logits, cache = model.apply(
            params, input_ids, positions, cache, cache_mask, logits_to_keep=1
        )
    else:
        logits, cache = model.apply(params, input_ids, positions, cache, cache_mask)
    tokens = jnp.concatenate([input_ids, new_slots * pad_token_id], axis=1)
    return logits, cache, cache_mask, tokens


def _cache_requests(model, config, shape, max_new_tokens: int, assistant) -> list[CacheRequest]:
    """The KV caches a call allocates, as :func:`_prefill` sizes them (``shape`` is the padded
    ``[B, P]`` of the prompt), for the memory check before anything is allocated."""
    batch, prompt_length = shape
    quantized = _quantized(config)
    if assisted.is_assisted(config, assistant):
        width = (
            config.num_assistant_tokens
            if assistant is not None
            else config.prompt_lookup_num_tokens
        )
        sizes = assisted.cache_lengths(prompt_length, max_new_tokens, batch, int(width))
        requests = [CacheRequest(model, batch, sizes[0], quantized)]
        if assistant is not None:
            requests.append(CacheRequest(assistant, batch, sizes[1], quantized))
        return requests
    copies = config.num_beams if config.num_beams > 1 else config.num_return_sequences
    return [CacheRequest(model, batch * copies, prompt_length + max_new_tokens, quantized)]


def _quantized(config: GenerationConfig) -> bool:
    """Whether the call's KV caches hold int8 codes (``cache_implementation="quantized"``)."""
    return config.cache_implementation == "quantized"


def _accepts_logits_to_keep(model) -> bool:
    """Whether ``model.apply`` takes the protocol's optional ``logits_to_keep`` keyword."""
    try:
        return "logits_to_keep" in inspect.signature(model.apply).parameters
    except (TypeError, ValueError):  # no introspectable signature
        return False


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
    """transformers' default mask: ``ids != pad`` if pad occurs in the input and is not EOS.
    Computed with numpy when everything is concrete (a new shape compiles nothing)."""
    if not any(isinstance(x, jax.core.Tracer) for x in (input_ids, pad_token_id, eos_token_ids)):
        ids, pad = np.asarray(input_ids), np.asarray(pad_token_id)
        has_pad = (ids == pad).any()
        if eos_token_ids is not None:
            has_pad &= not (np.asarray(eos_token_ids) == pad).any()
        return np.where(has_pad, ids != pad, True).astype(np.int32)
    has_pad = jnp.any(input_ids == pad_token_id)
    if eos_token_ids is not None:
        has_pad = has_pad & ~jnp.any(eos_token_ids == pad_token_id)
    return jnp.where(has_pad, input_ids != pad_token_id, True).astype(jnp.int32)


def _as_int32(x) -> Array:
    """``x`` as an int32 jax array. Host arrays are converted by numpy and transferred with
    ``device_put``, which compiles nothing (``jnp.asarray`` compiles a program per new shape)."""
    if isinstance(x, (jax.Array, jax.core.Tracer)):
        return jnp.asarray(x, jnp.int32)
    return jax.device_put(np.asarray(x, np.int32))


def _pad_left(input_ids: Array, attention_mask: Array, pad_token_id: Array, extra: int):
    """Left-pads int32[B, P] ids and mask with ``extra`` masked slots (with numpy when all are
    concrete, so a new prompt shape compiles nothing)."""
    if not extra:
        return input_ids, attention_mask
    if not any(isinstance(x, jax.core.Tracer) for x in (input_ids, attention_mask, pad_token_id)):
        widths = ((0, 0), (extra, 0))
        pad = int(np.asarray(pad_token_id))
        ids = np.pad(np.asarray(input_ids, np.int32), widths, constant_values=pad)
        mask = np.pad(np.asarray(attention_mask, np.int32), widths)
        return jax.device_put(ids), jax.device_put(mask)
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


def _check_mode(config: GenerationConfig, assistant_model=None) -> None:
    if assisted.is_assisted(config, assistant_model):
        assisted.check_config(config, assistant_model)
    if config.num_beams > 1:
        beam.check_supported(config)
    mode = str(config.get_generation_mode(assistant_model).value)
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
        values = _local_values(input_ids)
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


def _local_values(x) -> np.ndarray:
    """The values of ``x`` this process holds, flattened: all of them, except for a global
    array of a multi-host mesh, where only the process' own shards can be read."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.concatenate([np.ravel(s.data) for s in x.addressable_shards])
    return np.asarray(x)


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
