"""The entry point: validate inputs, prefill, run the decoding loop, assemble the output.

Static or traced:
    Static (a change compiles a new program): the model, the batch size, the prompt bucket
    length and the number of new tokens ``N`` (without ``max_cache_len``), ``max_cache_len``
    and the bucket policy, ``num_return_sequences``, ``num_beams``, ``early_stopping``, which
    processors are enabled, the output flags, the kinds and static settings of the user's extra
    processors (their values are traced), plain-function processors and stopping criteria,
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
program, and outputs have ``max_cache_len`` columns (see :mod:`genjax.cache.slots`).
:func:`genjax.warmup` compiles programs ahead of time.

Modules: this one holds the entry point and the compiled program's three decoding paths;
:mod:`genjax.generation.inputs` checks and prepares the arguments on the host,
:mod:`genjax.generation.prefill` holds
what every path does first inside the program (special ids, stopping rules, prefill).

Differences from transformers forced by static shapes: outputs always hold ``N`` steps
(see :mod:`genjax.outputs`); ``use_cache=False`` gives the same tokens through the cache.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from genjax.cache import slots as cache_slots
from genjax.cache.memory import check_fits
from genjax.cache.quantized import check_cache_options, init_cache
from genjax.cache.slots import pad_prompt
from genjax.config import GenerationConfig
from genjax.decoding import assisted, beam
from genjax.decoding.sampling import (
    DecodeRules,
    DecodeState,
    decode,
    greedy_chooser,
    sampling_chooser,
)
from genjax.generation import buckets
from genjax.generation.inputs import (
    as_int32,
    cache_requests,
    call_layout,
    check_assisted_extras,
    check_inputs,
    check_mode,
    effective_config,
    infer_attention_mask,
    num_new_tokens,
    stop_string_table_for,
)
from genjax.generation.outputs import GenerateOutput
from genjax.generation.prefill import (
    accepts_logits_to_keep,
    is_quantized,
    prefill,
    prompt_context,
    special_ids,
    start_stopping,
)
from genjax.processors import Processor, as_processors, from_config, validate_config
from genjax.sharding import Layout
from genjax.stopping import StopCriterion, StoppingRules, as_criteria
from genjax.streaming import check_streamer, stream_to, token_hook
from genjax.typing import Array, PyTree

MIN_BUCKET = buckets.DEFAULT.size


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
            the configured ones and before the sampling warpers, as in transformers (see
            :func:`genjax.processors.as_processors`). genjax's processors are pytrees: their
            values are traced (a fresh ``temperature(0.7)`` reuses the program compiled for
            ``temperature(0.5)``), their kinds and static settings are static. A plain function
            is static: pass the same one to reuse a compiled program. A transformers
            ``LogitsProcessor`` raises TypeError.
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
            memory (the message gives both figures; see :mod:`genjax.cache.memory`).
        TypeError: a stopping criterion that is not a hashable callable; a logits processor
            that is a transformers ``LogitsProcessor``, not callable, or a plain unhashable one.
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
    config = effective_config(config, config_overrides)
    resolved = config.with_defaults()
    check_mode(resolved, assistant_model)
    validate_config(resolved, model.vocab_size)
    check_cache_options(resolved.cache_implementation, resolved.cache_config)
    input_ids, attention_mask, key = check_inputs(model, input_ids, attention_mask, key, resolved)
    layout = call_layout(model, mesh, rules, input_ids.shape[0])
    if assisted.is_assisted(resolved, assistant_model):
        assisted.check_call(resolved, model, assistant_model, assistant_params, len(input_ids))
        check_assisted_extras(streamer, layout)
    prompt_length = input_ids.shape[1]
    max_new_tokens = num_new_tokens(config, resolved, prompt_length, model)
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
    logits_processor = as_processors(logits_processor)
    stop_strings = stop_string_table_for(resolved, tokenizer)
    if streamer is not None:
        traced = (params, input_ids, attention_mask, key)
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(traced))
        check_streamer(streamer, input_ids, resolved, traced)
    prompt_ids = input_ids  # as given, for the streamer

    pad_token_id, eos_token_ids = special_ids(resolved)
    if attention_mask is None:
        attention_mask = infer_attention_mask(input_ids, pad_token_id, eos_token_ids)
    input_ids, attention_mask = as_int32(input_ids), as_int32(attention_mask)
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
        input_ids, attention_mask = pad_prompt(input_ids, attention_mask, pad_token_id, offset)
    check_fits(cache_requests(model, resolved, input_ids.shape, cache_new, assistant_model), layout)
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
            logits_processor=logits_processor,
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
    ``slots`` (static) is the buffer layout of :mod:`genjax.cache.slots`, ``bounds`` int32[2]
    (traced) the prompt's end and the loop's end in it, and ``max_new_tokens`` the steps
    recorded in ``scores``/``logits``."""
    if layout is not None:
        input_ids, attention_mask = layout.constrain((input_ids, attention_mask))
    pad_token_id, eos_token_ids = special_ids(config)
    stopping, input_ids = start_stopping(
        config, eos_token_ids, stopping_criteria, stop_strings, offset, input_ids
    )
    call = _Call(
        model=model,
        params=params,
        input_ids=input_ids,
        attention_mask=attention_mask,
        config=config,
        key=key,
        offset=offset,
        pad_token_id=pad_token_id,
        eos_token_ids=eos_token_ids,
        stopping=stopping,
        max_new_tokens=max_new_tokens,
        logits_processor=logits_processor,
        allowed_tokens_fn=allowed_tokens_fn,
        layout=layout,
    )
    if assisted.is_assisted(config, assistant):
        return _generate_assisted(call, assistant, assistant_params)
    if config.num_beams > 1:
        return _generate_beams(call)
    return _generate_sampling(call, stream_id, slots, bounds)


@dataclasses.dataclass(frozen=True)
class _Call:
    """What the three decoding paths share, inside the trace: the (traced) inputs, the special
    ids, the started stopping rules, and the static options."""

    model: object
    params: PyTree
    input_ids: Array  # int32[B, P], bucket-padded
    attention_mask: Array  # int32[B, P]
    config: GenerationConfig  # resolved; its traced fields are tracers here
    key: Array
    offset: Array  # int32[]: bucket padding slots at the start of each row
    pad_token_id: Array  # int32[]
    eos_token_ids: Array | None  # int32[E]
    stopping: StoppingRules  # clock started before the prefill
    max_new_tokens: int  # N (static)
    logits_processor: tuple  # the user's processors (pytrees: values traced, kinds static)
    allowed_tokens_fn: Callable | None  # static
    layout: Layout | None  # static

    def processors(self) -> Processor:
        """The processor chain of the config, in transformers' order."""
        return from_config(
            self.config,
            self.eos_token_ids,
            extra=self.logits_processor,
            allowed_tokens_fn=self.allowed_tokens_fn,
        )

    def prefill(self, max_new_tokens: int | None = None):
        """:func:`genjax.generation.prefill.prefill` of the model into ``P + max_new_tokens``
        slots (default ``N``)."""
        new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        return prefill(
            self.model,
            self.params,
            self.input_ids,
            self.attention_mask,
            new,
            self.pad_token_id,
            is_quantized(self.config),
        )

    def finish(self, out: GenerateOutput) -> GenerateOutput:
        """The output, sharded as the layout says."""
        return out if self.layout is None else self.layout.constrain(out)


def _generate_sampling(call: _Call, stream_id, slots, bounds) -> GenerateOutput:
    """Greedy decoding and sampling: prefill once, repeat rows for ``num_return_sequences``,
    run :func:`genjax.decoding.sampling.decode`."""
    config, input_ids, attention_mask = call.config, call.input_ids, call.attention_mask
    batch, prompt_length = input_ids.shape
    copies = config.num_return_sequences

    def rows(x):  # row b -> rows b*R .. b*R+R-1, by a reshape: sharded rows stay in place
        return jnp.repeat(x, copies, axis=0)

    length = jnp.asarray(prompt_length, jnp.int32)
    if slots is None:
        logits, cache, cache_mask, tokens = call.prefill()
    else:
        cache = init_cache(call.model, batch, slots.buffer_length, is_quantized(config))
        keep_one = accepts_logits_to_keep(call.model)
        logits, cache, cache_mask = slots.prefill(
            call.model, call.params, input_ids, attention_mask, bounds[0], cache, keep_one=keep_one
        )
        logits, tokens, length = logits[:, None], input_ids, bounds[0]
    recorded = (batch * copies, call.max_new_tokens, logits.shape[-1])
    state = DecodeState(
        tokens=rows(tokens),
        length=length,
        positions=rows(jnp.sum(attention_mask, axis=-1)).astype(jnp.int32),
        cache=cache.repeat_rows(copies),
        attention_mask=rows(cache_mask),
        finished=jnp.zeros((batch * copies,), bool),
        key=call.key,
        scores=jnp.zeros(recorded) if config.output_scores else None,
        raw_logits=jnp.zeros(recorded) if config.output_logits else None,
    )
    context = prompt_context(state.tokens, state.length, state.attention_mask, call.offset)
    if slots is not None:  # transformers' max_length = P + N, traced
        context = context.replace(max_length=bounds[1] - call.offset)
    rules = DecodeRules(
        process=call.processors(),
        choose=sampling_chooser() if config.do_sample else greedy_chooser(),
        context=context,
        pad_token_id=call.pad_token_id,
        stopping=call.stopping,
        on_token=None if stream_id is None else token_hook(stream_id),
        constrain=None if call.layout is None else call.layout.constrain,
        end=None if slots is None else bounds[1],
    )
    state = decode(call.model.apply, call.params, state, rows(logits[:, -1]), rules)
    sequences = state.tokens if slots is None else slots.sequences(state.tokens, call.offset)
    return call.finish(
        GenerateOutput(sequences=sequences, scores=state.scores, logits=state.raw_logits)
    )


def _generate_beams(call: _Call) -> GenerateOutput:
    """Beam search / beam sampling: prefill each prompt once, repeat its cache rows for the M
    beams, run :func:`genjax.decoding.beam.beam_search`, return the R best hypotheses."""
    config = call.config
    batch = call.input_ids.shape[0]
    num_beams = config.num_beams
    logits, cache, cache_mask, tokens = call.prefill()
    recorded = (batch * num_beams, call.max_new_tokens, logits.shape[-1])
    state = beam.init_state(
        tokens,
        cache,
        cache_mask,
        call.key,
        num_beams=num_beams,
        num_new_tokens=call.max_new_tokens,
        scores_shape=recorded if config.output_scores else None,
        logits_shape=recorded if config.output_logits else None,
        fill_token_id=beam.fill_token_id(call.pad_token_id, call.eos_token_ids),
    )
    rules = beam.BeamRules(
        process=call.processors(),
        do_sample=bool(config.do_sample),
        early_stopping=config.early_stopping,
        context=prompt_context(state.tokens, state.length, state.attention_mask, call.offset),
        length_penalty=config.length_penalty,
        eos_token_ids=call.eos_token_ids,
        stopping=call.stopping,
        constrain=None if call.layout is None else call.layout.constrain,
    )
    first_logits = jnp.repeat(logits[:, -1], num_beams, axis=0)
    state = beam.beam_search(call.model.apply, call.params, state, first_logits, rules)
    sequences, sequences_scores, beam_indices = beam.best_hypotheses(
        state, config.num_return_sequences
    )
    return call.finish(
        GenerateOutput(
            sequences=sequences,
            scores=state.scores,
            logits=state.raw_logits,
            sequences_scores=sequences_scores,
            beam_indices=beam_indices,
        )
    )


def _generate_assisted(call: _Call, assistant, assistant_params) -> GenerateOutput:
    """Assisted generation (:mod:`genjax.decoding.assisted`): prefill the target and the draft
    (None for prompt lookup) into caches sized for the rolled-back slots, then draft, verify
    and commit in one loop."""
    config, model = call.config, call.model
    batch, prompt_length = call.input_ids.shape
    limits = [getattr(m, "max_position_embeddings", None) for m in (model, assistant)]
    limits = [limit for limit in limits if limit is not None]
    rules = assisted.make_rules(
        config,
        eos_token_ids=call.eos_token_ids,
        pad_token_id=call.pad_token_id,
        context=prompt_context(call.input_ids, prompt_length, call.attention_mask, call.offset),
        stopping=call.stopping,
        num_new_tokens=call.max_new_tokens,
        with_draft=assistant is not None,
        extra=call.logits_processor,
        allowed_tokens_fn=call.allowed_tokens_fn,
        max_position=min(limits) if limits else None,
    )
    sizes = assisted.cache_lengths(prompt_length, call.max_new_tokens, batch, rules.num_candidates)
    logits, cache, cache_mask, _ = call.prefill(sizes[0] - prompt_length)
    draft_cache = draft_mask = None
    if assistant is not None:
        draft = dataclasses.replace(call, model=assistant, params=assistant_params)
        _, draft_cache, draft_mask, _ = draft.prefill(sizes[1] - prompt_length)
    state = assisted.init_state(
        call.input_ids,
        cache,
        cache_mask,
        draft_cache,
        draft_mask,
        call.key,
        rules,
        vocab_size=logits.shape[-1],
        record_scores=bool(config.output_scores),
        record_logits=bool(config.output_logits),
    )
    draft_step = None if assistant is None else assistant.apply
    state = assisted.decode(
        model.apply, call.params, draft_step, assistant_params, state, logits[:, -1], rules
    )
    sequences, scores, raw_logits = assisted.finish(state, rules)
    return GenerateOutput(
        sequences=sequences,
        scores=scores,
        logits=raw_logits,
        num_accepted_tokens=state.num_accepted,
    )
