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
every call (greedy, sampling, beams, assisted) with ``P + N <= max_cache_len`` and the same
batch size runs one program, and outputs have ``max_cache_len`` columns (see
:mod:`genjax.cache.slots`). An encoder-decoder model's decoder gets ``max_cache_len`` slots the
same way, beams included (:mod:`genjax.generation.encoder_decoder`). :func:`genjax.warmup`
compiles programs ahead of time.

Structure: ``generate`` checks and plans the call once on the host
(:func:`genjax.generation.plan.prepare`: a hashable :class:`~genjax.generation.plan.CallPlan`
and the arrays to trace), then runs ``_generate_jit(plan, params, input_ids, attention_mask,
traced)``, whose one static argument is the plan. Inside it, the plan's mode picks one of three
loops (sampling, beams, assisted), which read their static options from the plan and share what
:mod:`genjax.generation.prefill` does first (special ids, stopping rules, prefill).
:func:`lower_program` lowers the same program for :func:`genjax.warmup`.

Differences from transformers forced by static shapes: outputs always hold ``N`` steps
(see :mod:`genjax.outputs`); ``use_cache=False`` gives the same tokens through the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from genjax.config import GenerationConfig
from genjax.decoding import assisted, beam, guidance
from genjax.decoding.sampling import (
    DecodeRules,
    DecodeState,
    decode,
    greedy_chooser,
    sampling_chooser,
)
from genjax.generation import buckets, recording
from genjax.generation.healing import heal, heal_call, healing_step
from genjax.generation.outputs import GenerateOutput, check_finite
from genjax.generation.plan import CallPlan, CallRequest, Mode, PreparedCall, TracedInputs, prepare
from genjax.generation.prefill import (
    special_ids,
    start_stopping,
)
from genjax.generation.traced_call import TracedCall
from genjax.kernels import rows as rows_kernel
from genjax.models.quantize import LIBRARY_DOT_OPTIONS
from genjax.processors import Processor
from genjax.stopping import StopCriterion
from genjax.streaming import stream_to, token_hook
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
    input_ids: Array | None,
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
    constraint=None,
    decoder_input_ids: Array | None = None,
    encoder_outputs=None,
    negative_prompt_ids: Array | None = None,
    negative_prompt_attention_mask: Array | None = None,
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

    Encoder-decoder models (T5, BART, Marian): ``input_ids`` is the source, read once by the
    encoder; ``sequences`` are the decoder's tokens from ``decoder_start_token_id``, and a
    streamer gets them (the decoder's prefix first, not the source), a constraint the new ones,
    a mesh shards them as a decoder-only model; no assisted generation (see
    :mod:`genjax.generation.encoder_decoder`).

    Args:
        model: a model following the protocol of :mod:`genjax.models` (hashable; static).
        params: the model parameters (traced).
        input_ids: int[B, P] prompts, left-padded when their lengths differ (an
            encoder-decoder model's source; None with its ``encoder_outputs``).
        config: a :class:`GenerationConfig`, merged with the model's ``generation_config``
            (the checkpoint's ``generation_config.json``, see ``from_pretrained``) as in
            transformers v5: None means the model's config; a given config's unset (None)
            fields are filled from the model's; then the library defaults; then
            ``**config_overrides``. A model without one (``from_config``, a custom model) uses
            ``GenerationConfig()``. Its traced values may be per row (shape ``[B]``).
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
            are built once per vocabulary and stop strings, then traced. ``token_healing``
            needs it too (a transformers tokenizer or a :class:`genjax.tokenizer.Tokenizer`):
            the prompts' last tokens are healed on the host first (:func:`heal_tokens`).
        streamer: a :mod:`genjax.streaming` streamer (``TextStreamer``,
            ``TextIteratorStreamer``, or any object with ``put(ids)`` and ``end()``), as in
            transformers: ``put`` gets the prompt int32[1, P] first (an encoder-decoder
            model's decoder prefix int32[1, Pd], not its source), then each new token
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
            granularity counts (the prefill chunk, unless ``prefill_chunk_size`` is set).
        constraint: structured output (:mod:`genjax.constraints`): a ``Constraint`` from
            ``regex``, ``json_schema``, ``json_object`` or ``choice`` for every row, or a list
            of one per input row. The automaton's tables are traced (patterns whose tables pad
            to the same size share one program; its format and sizes are static). Greedy,
            sampling and beams; not assisted generation.
        decoder_input_ids: encoder-decoder models only: int[B, T] forced first decoder tokens
            (concrete), after ``decoder_start_token_id``, which is put in front unless a row
            already starts with it (transformers' rule).
        encoder_outputs: encoder-decoder models only: the encoder's states float[B, Ps, D]
            (``model.encode(params, ids, mask)``, or transformers' ``BaseModelOutput``, a dict
            or tuple holding ``last_hidden_state``), used instead of running the encoder, so
            one source's states serve several calls. ``attention_mask`` int[B, Ps] is their
            source mask (default all ones); ``input_ids`` may be None, or the source ids
            int[B, Ps], which then only the ``encoder_*`` processors read.
        negative_prompt_ids: int[B, Pn], classifier-free guidance's unconditional context, one
            per prompt (left-padded; each length compiles its own program), used when
            ``guidance_scale`` is set and not 1; default: each row's last prompt token. Greedy
            and sampling only; the guided branch costs a second model pass per token and a
            second KV cache of ``Pn + N`` slots (see :mod:`genjax.decoding.guidance`).
        negative_prompt_attention_mask: int[B, Pn], 1 on the negative prompt's tokens.
        **config_overrides: generation config fields overriding ``config`` for this call
            (applied last, after the model's config and the defaults: ``do_sample=False``
            makes a checkpoint that samples by default decode greedily, and a sampling value
            set to None, e.g. ``top_k=None``, turns that processor off).

    Returns:
        A :class:`GenerateOutput`; ``sequences`` is int32[B*R, P+N]. With ``max_cache_len = M``
        (static): ``sequences`` is int32[B*R, M], the prompt, its ``N`` new tokens, then
        ``pad_token_id``; ``scores``/``logits`` (and ``beam_indices``) hold ``M - 1`` steps, 0
        (-1) from step ``N`` on. An encoder-decoder model's ``sequences`` are its decoder's
        tokens: int32[B*R, Pd+N], the prefix ``Pd`` (the start token, any
        ``decoder_input_ids``) first; with ``max_cache_len`` int32[B*R, M], its steps ``M - Pd``
        (see :mod:`genjax.generation.encoder_decoder`). Hidden states and attentions when asked
        for (an encoder-decoder model's ``encoder_*``, ``decoder_*`` and
        ``cross_attentions``): :mod:`genjax.generation.outputs`.

    Raises:
        InputError: malformed ``input_ids``, ``attention_mask`` or ``key``; ``stop_strings``
            without a ``tokenizer``; ``token_healing`` without a ``tokenizer`` or inside a
            user's ``jax.jit``; ``P + N > max_cache_len`` (encoder-decoder: ``Pd + N``); a
            bad ``prompt_buckets``;
            after the run, first-step logits holding NaN or Inf (broken weights: checked when
            the arrays are concrete, see :func:`check_finite` for the cost).
        CacheMemoryError: an InputError: the KV caches would not fit in the devices' free
            memory (the message gives both figures; see :mod:`genjax.cache.memory`).
        TypeError: a stopping criterion that is not a hashable callable; a logits processor
            that is a transformers ``LogitsProcessor``, not callable, or a plain unhashable one.
        GenerationConfigError: an invalid config.
        UnsupportedError: a generation mode or option genjax does not support yet (see
            ``check_forward_outputs``).
        ShardingError: with a mesh, a batch or head count that does not divide over its axis;
            ``mesh=`` inside ``shard_map``.

    Example:
        >>> sampling = config.replace(do_sample=True, temperature=0.7)
        >>> out = genjax.generate(model, params, ids, sampling, attention_mask=mask,
        ...                       key=jax.random.key(0))
        >>> out.sequences.shape  # [B, P + max_new_tokens]
        (2, 7)
    """
    request = CallRequest(
        attention_mask=attention_mask,
        key=key,
        logits_processor=logits_processor,
        allowed_tokens_fn=allowed_tokens_fn,
        stopping_criteria=stopping_criteria,
        tokenizer=tokenizer,
        streamer=streamer,
        mesh=mesh,
        rules=rules,
        assistant_model=assistant_model,
        assistant_params=assistant_params,
        prompt_buckets=prompt_buckets,
        constraint=constraint,
        decoder_input_ids=decoder_input_ids,
        encoder_outputs=encoder_outputs,
        negative_prompt_ids=negative_prompt_ids,
        negative_prompt_attention_mask=negative_prompt_attention_mask,
        overrides=config_overrides,
    )
    healing = healing_step(generate, model, params, tokenizer, key)
    input_ids, request = heal_call(model, input_ids, config, request, healing)
    call = prepare(model, params, input_ids, config, request)
    with stream_to(streamer, call.prompt_ids) as stream_id:  # puts the prompt; None: no streamer
        out = program(call.plan)(call.plan, *call.arguments(stream_id))  # see lower_program
        if stream_id is not None:
            out = jax.block_until_ready(out)  # every token has reached the streamer
    out = call.finish(out)
    if streamer is not None:
        streamer.end()
    return check_finite(out)


def heal_tokens(model, params: PyTree, input_ids, tokenizer, *, key: Array | None = None):
    """The prompts with their last token healed (transformers' ``model.heal_tokens``), as
    ``generate(..., token_healing=True, tokenizer=tokenizer)`` heals them first.

    Host code (:mod:`genjax.generation.healing`): call it outside ``jax.jit``, then a jitted
    ``generate`` with ``token_healing`` unset. Each healed row runs a one-token ``generate``
    (its ``sequence_bias`` is static: a new set of candidates compiles a new program).

    Args:
        model: the model (static); its ``generation_config`` is merged into the healing step.
        params: its parameters.
        input_ids: int[B, P] concrete prompts.
        tokenizer: a transformers tokenizer or a :class:`genjax.tokenizer.Tokenizer`.
        key: a PRNG key, needed if the model's ``generation_config`` samples (row b: fold_in).

    Returns:
        int32[B, P'] the healed prompts (``P'`` may differ from ``P``: the texts are stripped).

    Example:
        >>> healed = genjax.heal_tokens(model, params, tok(["import os.pa"])["input_ids"], tok)
        >>> tok.batch_decode(healed)
        ['import os.path']
    """
    healed = heal(input_ids, tokenizer, healing_step(generate, model, params, tokenizer, key))
    return healed.astype(np.int32)


def lower_program(call: PreparedCall) -> jax.stages.Lowered:
    """The program ``generate`` runs for ``call``, lowered: ``.compile()`` fills the same cache
    ``generate`` looks in (used by :func:`genjax.warmup`). Without a streamer: a streamed call
    compiles its program the first time."""
    return program(call.plan).lower(call.plan, *call.arguments())


def program(plan: CallPlan):
    """The jitted function that runs ``plan``: compiled with the library-dot options when the
    plan asks for them (int8 params at several rows, :data:`~genjax.models.quantize.
    LIBRARY_DOT_OPTIONS`). Inside a user's ``jax.jit`` the user's compile decides: pass those
    options as its ``compiler_options`` to get the same kernels."""
    return _generate_library_dots if plan.library_dots else _generate_jit


def _generate(
    plan: CallPlan, params: PyTree, input_ids: Array, attention_mask: Array, traced: TracedInputs
) -> GenerateOutput:
    """The compiled body of ``generate``: start the stopping rules, then run the plan's loop.

    Args:
        plan: the call's :class:`~genjax.generation.plan.CallPlan` (static).
        params: the model parameters (traced).
        input_ids: int32[B, W] prompts laid out in the program's slots (``W = plan.width``).
        attention_mask: int32[B, W], 1 on real prompt tokens.
        traced: the config, key, padding ``o``, slot bounds, stop-string tables, draft params
            and stream id (all traced).
    """
    # On a mesh, XLA's partitioned products rather than the CPU kernel (see genjax.kernels.rows).
    with rows_kernel.disabled(plan.layout is not None):
        return _generate_traced(plan, params, input_ids, attention_mask, traced)


def _generate_traced(plan, params, input_ids, attention_mask, traced) -> GenerateOutput:
    if plan.layout is not None:
        input_ids, attention_mask = plan.layout.constrain((input_ids, attention_mask))
    config = traced.config
    pad_token_id, eos_token_ids = special_ids(config)
    stopping, input_ids = start_stopping(
        config, eos_token_ids, plan.stopping_criteria, traced.stop_strings, traced.offset, input_ids
    )
    call = TracedCall(
        plan=plan,
        params=params,
        input_ids=input_ids,
        attention_mask=attention_mask,
        traced=traced,
        pad_token_id=pad_token_id,
        eos_token_ids=eos_token_ids,
        stopping=stopping,
    )
    return _LOOPS[plan.mode](call)


_generate_jit = jax.jit(_generate, static_argnums=0)
_generate_library_dots = jax.jit(_generate, static_argnums=0, compiler_options=LIBRARY_DOT_OPTIONS)


def _generate_sampling(call: TracedCall) -> GenerateOutput:
    """Greedy decoding and sampling: prefill once (into the slot buffer with
    ``max_cache_len``), repeat rows for ``num_return_sequences``, run
    :func:`genjax.decoding.sampling.decode`."""
    plan, traced, attention_mask = call.plan, call.traced, call.attention_mask
    batch = call.input_ids.shape[0]
    copies = plan.num_return_sequences

    def rows(x):  # row b -> rows b*R .. b*R+R-1, by a reshape: sharded rows stay in place
        return jnp.repeat(x, copies, axis=0)

    logits, cache, cache_mask, tokens, *prefill_outputs = call.prefill()
    length = jnp.asarray(tokens.shape[1] - plan.steps, jnp.int32)  # W, or the decoder's Pd
    if plan.slots is not None:
        length = traced.bounds[0]  # the prompt's end e in the slot buffer
    recorded = (batch * copies, plan.steps, logits.shape[-1])
    state = DecodeState(
        tokens=rows(tokens),
        length=length,
        positions=rows(jnp.sum(attention_mask, axis=-1)).astype(jnp.int32),
        cache=cache.repeat_rows(copies),
        attention_mask=rows(cache_mask),
        finished=jnp.zeros((batch * copies,), bool),
        key=traced.key,
        scores=jnp.zeros(recorded) if plan.output_scores else None,
        raw_logits=jnp.zeros(recorded) if plan.output_logits else None,
        automaton_state=None if traced.automaton is None else rows(traced.automaton.initial),
    )
    state = recording.with_buffers(plan, call.params, state, prefill_outputs)
    context = call.context(state.tokens, state.length, state.attention_mask, copies)
    rules = DecodeRules(
        process=call.processors(),
        choose=sampling_chooser() if plan.do_sample else greedy_chooser(),
        context=context,
        pad_token_id=call.pad_token_id,
        stopping=call.stopping,
        on_token=token_hook(traced.stream_id) if plan.streaming else None,
        constrain=call.constrain(),
        end=None if traced.bounds is None else traced.bounds[1],
        automaton=traced.automaton,
    )
    if plan.guidance:
        state = state.replace(guidance=guidance.repeat_rows(call.guidance_branch(length), copies))
    state = decode(recording.step_fn(plan), call.params, state, rows(logits[:, -1]), rules)
    sequences = state.tokens
    if plan.slots is not None:
        sequences = plan.slots.sequences(state.tokens, traced.offset)
    return call.finish(
        GenerateOutput(
            sequences=sequences,
            scores=state.scores,
            logits=state.raw_logits,
            first_logits_finite=_all_finite(logits),
            **recording.records(prefill_outputs, state.step_outputs, copies),
        )
    )


def _generate_beams(call: TracedCall) -> GenerateOutput:
    """Beam search / beam sampling: prefill each prompt once, repeat its cache rows for the M
    beams, run :func:`genjax.decoding.beam.beam_search`, return the R best hypotheses."""
    plan, config = call.plan, call.config
    batch = call.input_ids.shape[0]
    num_beams = plan.num_beams
    logits, cache, cache_mask, tokens, *prefill_outputs = call.prefill()
    recorded = (batch * num_beams, plan.steps, logits.shape[-1])
    state = beam.init_state(
        tokens,
        cache,
        cache_mask,
        call.traced.key,
        num_beams=num_beams,
        num_new_tokens=plan.steps,
        scores_shape=recorded if plan.output_scores else None,
        logits_shape=recorded if plan.output_logits else None,
        fill_token_id=beam.fill_token_id(call.pad_token_id, call.eos_token_ids),
        prompt_end=None if plan.slots is None else call.traced.bounds[0],
    )
    automaton = call.traced.automaton
    if automaton is not None:
        state = state.replace(automaton_state=jnp.repeat(automaton.initial, num_beams, axis=0))
    state = recording.with_buffers(plan, call.params, state, prefill_outputs)
    context = call.context(state.tokens, state.length, state.attention_mask, num_beams)
    bounds = call.traced.bounds  # max_cache_len: [e, e + N] (encoder-decoder: [Pd, Pd + N])
    rules = beam.BeamRules(
        process=call.processors(),
        do_sample=plan.do_sample,
        early_stopping=config.early_stopping,
        context=context,
        length_penalty=config.length_penalty,
        eos_token_ids=call.eos_token_ids,
        stopping=call.stopping,
        constrain=call.constrain(),
        automaton=automaton,
        num_new_tokens=None if bounds is None else bounds[1] - bounds[0],
    )
    first_logits = jnp.repeat(logits[:, -1], num_beams, axis=0)
    state = beam.beam_search(recording.step_fn(plan), call.params, state, first_logits, rules)
    sequences, sequences_scores, beam_indices = beam.best_hypotheses(
        state, plan.num_return_sequences
    )
    if bounds is not None:  # the slots after the call's end hold pad_token_id, as sampling's
        slots = jnp.arange(sequences.shape[1])[None, :]
        sequences = jnp.where(slots < bounds[1], sequences, call.pad_token_id)
    if plan.slots is not None:  # the M slots from the prompt's first
        sequences = plan.slots.sequences(sequences, call.traced.offset)
    return call.finish(
        GenerateOutput(
            sequences=sequences,
            scores=state.scores,
            logits=state.raw_logits,
            sequences_scores=sequences_scores,
            beam_indices=beam_indices,
            first_logits_finite=_all_finite(logits),
            **recording.records(prefill_outputs, state.step_outputs, num_beams),
        )
    )


def _generate_assisted(call: TracedCall) -> GenerateOutput:
    """Assisted generation (:mod:`genjax.decoding.assisted`): prefill the target and the draft
    (none for prompt lookup) into caches sized for the rolled-back slots, then draft, verify
    and commit in one loop. With ``max_cache_len`` the prompt ends at the traced ``bounds[0]``
    of the slot buffer and the rows stop at ``bounds[1]``."""
    plan, config, traced = call.plan, call.config, call.traced
    model, assistant = plan.model, plan.assistant
    batch, prompt_length = call.input_ids.shape  # P, or the slot buffer's S
    prompt_end = None if plan.slots is None else traced.bounds[0]
    start = prompt_length if prompt_end is None else prompt_end
    limits = [getattr(m, "max_position_embeddings", None) for m in (model, assistant)]
    limits = [limit for limit in limits if limit is not None]
    rules = assisted.make_rules(
        config,
        eos_token_ids=call.eos_token_ids,
        pad_token_id=call.pad_token_id,
        context=call.context(call.input_ids, start, call.attention_mask, 1),
        stopping=call.stopping,
        num_new_tokens=plan.steps,
        with_draft=assistant is not None,
        extra=traced.logits_processor,
        allowed_tokens_fn=plan.allowed_tokens_fn,
        max_position=min(limits) if limits else None,
    )
    if prompt_end is not None:
        rules = rules.replace(end=traced.bounds[1])
    sizes = assisted.cache_lengths(prompt_length, plan.steps, batch, rules.num_candidates)
    margin = assisted.ring_margin(rules.num_candidates)
    logits, cache, cache_mask, _ = call.prefill(sizes[0] - prompt_length, ring_margin=margin)
    draft_cache = draft_mask = None
    if assistant is not None:
        new_slots = sizes[1] - prompt_length
        _, draft_cache, draft_mask, _ = call.prefill(new_slots, draft=True, ring_margin=margin)
    state = assisted.init_state(
        call.input_ids,
        cache,
        cache_mask,
        draft_cache,
        draft_mask,
        traced.key,
        rules,
        vocab_size=logits.shape[-1],
        record_scores=plan.output_scores,
        record_logits=plan.output_logits,
        prompt_end=prompt_end,
    )
    draft_step = None if assistant is None else assistant.apply
    state = assisted.decode(
        model.apply, call.params, draft_step, traced.assistant_params, state, logits[:, -1], rules
    )
    sequences, scores, raw_logits = assisted.finish(state, rules)
    if plan.slots is not None:
        sequences = plan.slots.sequences(sequences, traced.offset)
    return GenerateOutput(
        sequences=sequences,
        scores=scores,
        logits=raw_logits,
        num_accepted_tokens=state.num_accepted,
        first_logits_finite=_all_finite(logits),
    )


def _all_finite(logits: Array) -> Array:
    """bool[]: whether the first step's logits float32[B, T, V] (the last of T) are finite."""
    return jnp.all(jnp.isfinite(logits[:, -1]))


_LOOPS = {
    Mode.SAMPLING: _generate_sampling,
    Mode.BEAMS: _generate_beams,
    Mode.ASSISTED: _generate_assisted,
}
"""The body of each :class:`~genjax.generation.plan.Mode`."""
