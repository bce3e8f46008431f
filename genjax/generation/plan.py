"""The call plan: what ``generate`` decides on the host, decided once, read by every path.

:func:`prepare` validates one call and returns a :class:`PreparedCall`. It holds the
:class:`CallPlan`, the static structure of the compiled program (frozen and hashable: the jitted
body's one static argument), and the arrays that program traces. ``generate`` runs the program;
:func:`genjax.warmup` lowers and compiles the same program from the same plan::

    generate(model, params, ids, config, **options)      warmup(model, params, config, ...)
      └─ prepare(model, params, ids, config, CallRequest) ─┘
           PreparedCall
             .plan        CallPlan (static)  ─┐
             .arguments() params, input_ids,  ├─> program(plan)(plan, params, ids, ...)
                          attention_mask,     │    generate: called; warmup: lower().compile()
                          TracedInputs        ┘
             .finish(out) removes the bucket padding from ``sequences`` (host), and
                          lays hidden states / attentions out as transformers does

The program's token slots, without ``max_cache_len`` (``o`` padding slots put the prompt's end
at its bucket length ``Pb``; inside a user's ``jax.jit`` ``o = 0``)::

    slot   0 .. o-1 | o ......... Pb-1 | Pb ....... Pb+N-1
           padding  | the prompt (P)   | the new tokens (N)

With ``max_cache_len`` the slots follow :mod:`genjax.cache.slots` instead (``S = M + C - 1``
slots, ``N`` traced).

Static or traced:
    Static (fields of :class:`CallPlan`; a change compiles a new program): the mode, the model
    and the assistant, the program's prompt width (bucket or slot buffer), the recorded steps,
    the ``max_cache_len`` slot layout, the sharding layout, the user's stopping criteria,
    whether a streamer is given, the output flags, the KV caches; and the treedef of the user's
    processors (their kinds and static settings). Traced (:class:`TracedInputs`; a change
    reuses the program): the user's processors' values, the config's traced fields, the key,
    the padding ``o``, with ``max_cache_len`` the prompt's end and the loop's end, the
    stop-string tables' contents and the stream id. Host only (:class:`PreparedCall`): the
    prompt length ``P``, the new tokens ``N`` asked for, the bucket policy, ``o`` as an int.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from genjax.cache import slots as cache_slots
from genjax.cache.memory import CacheRequest, check_fits
from genjax.cache.quantized import check_cache_options
from genjax.cache.slots import pad_prompt
from genjax.config import GenerationConfig
from genjax.decoding import assisted, beam
from genjax.errors import InputError, UnsupportedError
from genjax.generation import buckets, encoder_decoder
from genjax.generation.constrained import automaton_for
from genjax.generation.inputs import (
    as_int32,
    call_layout,
    check_assisted_extras,
    check_inputs,
    infer_attention_mask,
    negative_prompt,
    num_new_tokens,
    resolve_config,
    stop_string_table_for,
)
from genjax.generation.options import check_forward_outputs, check_options
from genjax.generation.outputs import GenerateOutput, lay_out
from genjax.generation.prefill import is_quantized, special_ids
from genjax.models.quantize import library_dots
from genjax.processors import Processor, as_processors, validate_config
from genjax.sharding import Layout
from genjax.stopping import StopCriterion, StopStringTable, as_criteria
from genjax.streaming import check_streamer
from genjax.typing import Array, PyTree

__all__ = ["CallPlan", "CallRequest", "Mode", "PreparedCall", "TracedInputs", "prepare"]

SUPPORTED_MODES = ("greedy_search", "sample", "beam_search", "beam_sample", "assisted_generation")


class Mode(str, enum.Enum):
    """The decoding loop a call runs (decided once, by :func:`mode_of`)."""

    SAMPLING = "sampling"  # greedy or sampling: genjax.decoding.sampling
    BEAMS = "beams"  # beam search or beam sampling: genjax.decoding.beam
    ASSISTED = "assisted"  # a draft model or prompt lookup: genjax.decoding.assisted


def mode_of(config: GenerationConfig, assistant_model=None) -> Mode:
    """The loop of a call with the resolved ``config``: assisted when there is a draft model or
    ``prompt_lookup_num_tokens``, else beams when ``num_beams > 1``, else sampling."""
    if assisted.is_assisted(config, assistant_model):
        return Mode.ASSISTED
    return Mode.BEAMS if config.num_beams > 1 else Mode.SAMPLING


@dataclasses.dataclass(frozen=True, eq=False)
class CallRequest:
    """One ``generate`` call's keyword arguments as the user gave them (unchecked).

    The fields are ``generate``'s keyword arguments of the same names; ``overrides`` holds the
    rest, the generation-config fields of ``**config_overrides``.
    """

    attention_mask: Array | None = None
    key: Array | None = None
    logits_processor: Sequence[Processor] = ()
    allowed_tokens_fn: Callable[[Array, Array], Array] | None = None
    stopping_criteria: Sequence[StopCriterion] = ()
    tokenizer: Any = None
    streamer: Any = None
    mesh: jax.sharding.Mesh | None = None
    rules: Any = None
    assistant_model: Any = None
    assistant_params: PyTree = None
    prompt_buckets: Any = None
    constraint: Any = None  # genjax.constraints.Constraint, or a list of one per input row
    decoder_input_ids: Any = None  # int[B, T]: an encoder-decoder model's forced decoder prefix
    encoder_outputs: Any = None  # float[B, Ps, D] (or a BaseModelOutput): its encoder's states
    negative_prompt_ids: Any = None  # int[B, Pn]: classifier-free guidance's unconditional context
    negative_prompt_attention_mask: Any = None  # int[B, Pn]
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, **kwargs) -> CallRequest:
        """The request of ``generate(..., **kwargs)``: names that are not fields of this class
        go to ``overrides``."""
        names = {f.name for f in dataclasses.fields(cls)} - {"overrides"}
        known = {k: v for k, v in kwargs.items() if k in names}
        return cls(**known, overrides={k: v for k, v in kwargs.items() if k not in names})


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """The static structure of one call's compiled program (hashable: a static jit argument).

    Two calls with equal plans (and arrays of equal shapes, dtypes and shardings) run one
    compiled program. Every field is derived from the call's static inputs only, so a value
    that is traced (a prompt length within its bucket, a sampling value) never changes it.
    """

    model: Any  # the model (hashable)
    mode: Mode
    do_sample: bool  # sampling (or beam sampling) rather than greedy (or beam search)
    width: int  # the program's prompt slots: the bucket Pb, the slot buffer S, or P when traced
    steps: int  # N, or with max_cache_len M - 1 (encoder-decoder: M - Pd): the steps recorded
    slots: cache_slots.FixedSlots | None  # the max_cache_len layout, or None
    layout: Layout | None  # the sharding layout, or None for one device
    quantized: bool  # int8 KV caches
    prefill_chunk: int | None  # prefill_chunk_size: prompt slots per prefill step, or None
    num_return_sequences: int  # R
    num_beams: int  # M
    output_scores: bool
    output_logits: bool
    output_hidden_states: bool  # record every model call's hidden states
    output_attentions: bool  # record every model call's attention weights
    allowed_tokens_fn: Callable | None
    stopping_criteria: tuple  # the user's extra stopping criteria
    assistant: Any  # the draft model, or None (also for prompt lookup)
    streaming: bool  # a streamer receives the tokens (a host callback is compiled)
    caches: tuple[CacheRequest, ...]  # the KV caches the program allocates
    # Compile with genjax.models.quantize.LIBRARY_DOT_OPTIONS: int8 params, several decode rows
    library_dots: bool = False
    guidance: bool = False  # a classifier-free guidance branch runs (guidance_scale set, not 1)

    @property
    def forward_flags(self) -> dict[str, bool]:
        """The ``output_*`` keywords the model's ``apply`` gets (those set; empty: none, and
        ``apply`` returns ``(logits, cache)``)."""
        flags = {
            "output_hidden_states": self.output_hidden_states,
            "output_attentions": self.output_attentions,
        }
        return {name: True for name, value in flags.items() if value}

    @property
    def cache_new_slots(self) -> int:
        """The cache slots after the prompt's: ``N``, or 0 with ``max_cache_len`` (the slot
        buffer already holds them)."""
        return 0 if self.slots is not None else self.steps


@struct.dataclass
class TracedInputs:
    """The program's traced inputs besides the params and the prompt (a pytree)."""

    config: GenerationConfig  # resolved; its traced fields are the leaves
    key: Array  # a typed PRNG key
    offset: Array  # int32[]: padding slots before the prompt (o)
    # int32[2] with max_cache_len: the prompt's end e and e + N (encoder-decoder: Pd, Pd + N);
    # else None
    bounds: Array | None
    stop_strings: StopStringTable | None  # the stop-string tables, or None
    assistant_params: PyTree  # the draft's params, or None
    logits_processor: tuple = ()  # the user's processors: pytrees, values traced, kinds static
    stream_id: Array | None = None  # int32[]: the registered streamer (plan.streaming)
    # The structured-output automaton (genjax.constraints.tables; its format and shapes are in
    # the treedef, its tables traced), or None.
    automaton: Any = None
    # Encoder-decoder models (genjax.generation.encoder_decoder), else None: the decoder's
    # prefix int32[B, Pd] (the start token first) and the source's length int32[] within its
    # bucket.
    decoder_input_ids: Array | None = None
    source_length: Array | None = None
    # generate(encoder_outputs=): float[B, Pb, D] encoder states (zeros in the bucket padding),
    # run instead of the encoder; else None.
    encoder_states: Array | None = None
    # Classifier-free guidance (genjax.decoding.guidance): the negative prompt int32[B, Pn] and
    # its mask, or None (then each row's last prompt token is the unconditional context).
    negative_prompt_ids: Array | None = None
    negative_prompt_attention_mask: Array | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedCall:
    """A checked call, ready to run: its plan, its program's arguments, the host leftovers."""

    plan: CallPlan
    params: PyTree  # placed on the mesh when one is given
    input_ids: Array  # int32[B, width]: padded, or laid out in the slot buffer
    attention_mask: Array  # int32[B, width]
    traced: TracedInputs
    prompt_ids: Array  # int[B, P]: what the streamer gets first: the prompt as given (an
    # encoder-decoder model: the decoder's prefix int32[B, Pd], as transformers puts it)
    prompt_length: int  # P (an encoder-decoder model: the source's)
    new_tokens: int  # N asked for (traced in bounds with max_cache_len)
    offset: int  # o, the padding slots before the prompt
    policy: buckets.BucketPolicy
    # Outputs set on the host after the run: with encoder_outputs=, the encoder_hidden_states /
    # encoder_attentions it carries, passed through as transformers does.
    given: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def arguments(self, stream_id: Array | None = None) -> tuple:
        """The program's arguments after ``plan``: ``(params, input_ids, attention_mask,
        traced)``, with ``stream_id`` (int32[] from :func:`genjax.streaming.stream_to`)."""
        traced = self.traced if stream_id is None else self.traced.replace(stream_id=stream_id)
        return self.params, self.input_ids, self.attention_mask, traced

    def finish(self, out: GenerateOutput) -> GenerateOutput:
        """``out`` with the bucket padding removed from ``sequences`` (none with
        ``max_cache_len``, whose program returns the slots from the prompt's start), recorded
        hidden states and attentions laid out as transformers returns them, without genjax's
        padding (:func:`~genjax.generation.outputs.lay_out`), and the ``given`` outputs."""
        if self.offset and self.plan.slots is None:
            out = out.replace(sequences=out.sequences[:, self.offset :])
        windows = getattr(self.plan.model, "attention_windows", ())
        out = lay_out(out, self.offset, windows, self.prompt_length)
        return out.replace(**self.given) if self.given else out


def prepare(model, params: PyTree, input_ids, config, request: CallRequest) -> PreparedCall:
    """Checks a ``generate`` call and builds its plan and arguments, before anything is traced.

    Args:
        model: the model (static).
        params: its parameters.
        input_ids: int[B, P] prompts, left-padded; concrete or traced.
        config: a :class:`GenerationConfig` or None, before ``request.overrides``.
        request: the call's other arguments.

    Returns:
        The :class:`PreparedCall`. Raises what ``generate`` documents, in this order: the
        config and mode, the arrays, the mesh, the assistant, the lengths, the stopping rules
        and streamer, the memory.
    """
    if encoder_decoder.is_encoder_decoder(model):
        return _prepare_encoder_decoder(model, params, input_ids, config, request)
    if request.decoder_input_ids is not None or request.encoder_outputs is not None:
        raise InputError(
            f"decoder_input_ids= and encoder_outputs= are for encoder-decoder models; "
            f"{type(model).__name__} is decoder-only: put the tokens at the end of input_ids "
            f"instead."
        )
    lengths, resolved, mode = _resolve(model, config, request)
    input_ids, attention_mask, key = check_inputs(
        model, input_ids, request.attention_mask, request.key, resolved
    )
    layout = call_layout(model, request.mesh, request.rules, input_ids.shape[0])
    negative_ids, negative_mask = negative_prompt(
        model,
        resolved,
        mode.value,
        input_ids,
        request.negative_prompt_ids,
        request.negative_prompt_attention_mask,
    )
    check_forward_outputs(resolved, model, assisted=mode is Mode.ASSISTED, encoder_decoder=False)
    if mode is Mode.ASSISTED:
        assisted.check_call(
            resolved, model, request.assistant_model, request.assistant_params, len(input_ids)
        )
        check_assisted_extras(request.streamer, layout)
    prompt_length = input_ids.shape[1]
    new_tokens = num_new_tokens(lengths, resolved, prompt_length, model)
    policy = buckets.resolve(request.prompt_buckets)
    slots = cache_slots.plan(resolved, policy, prompt_length, new_tokens)
    if resolved.min_new_tokens is not None:  # transformers: min_new_tokens overrides min_length
        resolved = resolved.replace(min_length=0)
    criteria = as_criteria(request.stopping_criteria)  # raises for one that is not hashable
    request = dataclasses.replace(request, stopping_criteria=criteria)
    stop_strings = stop_string_table_for(resolved, request.tokenizer)
    if request.streamer is not None:
        traced = (params, input_ids, attention_mask, key)
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(traced))
        check_streamer(request.streamer, input_ids, resolved, traced)
    pad_token_id, eos_token_ids = special_ids(resolved)
    if attention_mask is None:
        attention_mask = infer_attention_mask(input_ids, pad_token_id, eos_token_ids)
    if slots is not None:  # N is traced, in bounds
        resolved = resolved.replace(max_new_tokens=None, max_length=None)
    prompt_width = _placed_width(input_ids, slots, policy)
    shape = (input_ids.shape[0], prompt_width)
    plan = _plan(model, resolved, mode, shape, new_tokens, slots, layout, request)
    meshed = layout is not None
    dots = library_dots(params, _decode_rows(plan, shape[0]), meshed)
    plan = dataclasses.replace(plan, library_dots=dots)
    if plan.guidance:
        width = 1 if negative_ids is None else negative_ids.shape[1]
        plan = dataclasses.replace(plan, caches=plan.caches + (_guidance_cache(plan, width),))
    check_fits(list(plan.caches), layout)  # before the prompts are padded to that width
    placed = _place(
        as_int32(input_ids), as_int32(attention_mask), pad_token_id, slots, prompt_width
    )
    ids, mask, offset, prompt_end = placed
    bounds = None
    if slots is not None:
        bounds = jax.device_put(np.array([prompt_end, prompt_end + new_tokens], np.int32))
    if request.mesh is not None:  # concrete arrays only; inside a user's jit constraints place
        params = layout.place_params(params)
        ids, mask = layout.place_rows(ids, mask)
        if negative_ids is not None:
            negative_ids, negative_mask = layout.place_rows(negative_ids, negative_mask)
    traced = TracedInputs(
        config=resolved,
        key=key if key is not None else jax.random.key(0),
        offset=jnp.asarray(offset, jnp.int32),
        bounds=bounds,
        stop_strings=stop_strings,
        assistant_params=request.assistant_params,
        logits_processor=as_processors(request.logits_processor),
        automaton=automaton_for(request.constraint, mode, input_ids.shape[0], model, resolved),
        negative_prompt_ids=negative_ids,
        negative_prompt_attention_mask=negative_mask,
    )
    return PreparedCall(
        plan, params, ids, mask, traced, input_ids, prompt_length, new_tokens, offset, policy
    )


def _guidance_cache(plan: CallPlan, width: int) -> CacheRequest:
    """The classifier-free guidance branch's cache: a row per decoded row, the unconditional
    context's ``width`` slots and one per step."""
    rows = plan.caches[0].rows
    return CacheRequest(plan.model, rows, width + plan.steps, plan.quantized)


def _decode_rows(plan: CallPlan, batch: int) -> int:
    """The activation rows of a decode step's products: a row per prompt, beam and returned
    sequence; one per prompt in an assisted call, whose draft decodes one row at a time."""
    if plan.mode is Mode.ASSISTED:
        return batch
    return batch * max(plan.num_beams, plan.num_return_sequences)


def _prepare_encoder_decoder(model, params, input_ids, config, request) -> PreparedCall:
    """:func:`prepare` for an encoder-decoder model (:mod:`genjax.generation.encoder_decoder`):
    ``input_ids`` is the source, right-padded to its bucket; the decoder starts from its prefix,
    and ``max_length`` counts decoder tokens only. With ``max_cache_len`` the decoder's buffer
    has ``M`` slots and ``N`` is traced (``bounds``), as for a decoder-only model."""
    lengths, resolved, mode = _resolve(model, config, request)
    assisted = mode is Mode.ASSISTED
    check_forward_outputs(resolved, model, assisted=assisted, encoder_decoder=True)
    encoder_decoder.check_request(model, request, resolved, assisted)
    input_ids, states, source_length = encoder_decoder.encoder_inputs(
        model, input_ids, request.encoder_outputs, resolved
    )
    input_ids, attention_mask, key = check_inputs(
        model, input_ids, request.attention_mask, request.key, resolved
    )
    batch = input_ids.shape[0]
    layout = call_layout(model, request.mesh, request.rules, batch)
    start = encoder_decoder.start_token_id(resolved, model)
    prefix = encoder_decoder.decoder_prefix(
        start, request.decoder_input_ids, batch, model.vocab_size
    )
    new_tokens = num_new_tokens(lengths, resolved, prefix.shape[1], model)
    if resolved.min_new_tokens is not None:  # transformers: min_new_tokens overrides min_length
        resolved = resolved.replace(min_length=0)
    criteria = as_criteria(request.stopping_criteria)
    request = dataclasses.replace(request, stopping_criteria=criteria)
    stop_strings = stop_string_table_for(resolved, request.tokenizer)
    if request.streamer is not None:  # it gets the decoder's prefix first, as in transformers
        traced = (params, input_ids, attention_mask, key, prefix)
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(traced))
        check_streamer(request.streamer, input_ids, resolved, traced)
    new_slots, bounds = new_tokens, None
    if resolved.max_cache_len is not None:  # M decoder slots; N traced, in bounds
        new_slots, bounds = encoder_decoder.decoder_slots(
            resolved.max_cache_len, prefix.shape[1], new_tokens
        )
        resolved = resolved.replace(max_new_tokens=None, max_length=None)
    pad_token_id, _ = special_ids(resolved)
    if attention_mask is None:  # transformers infers none for an encoder-decoder model
        xp = jnp if isinstance(input_ids, jax.core.Tracer) else np
        attention_mask = xp.ones(input_ids.shape, xp.int32)
    policy = buckets.resolve(request.prompt_buckets)
    ids, mask = encoder_decoder.place_source(input_ids, attention_mask, pad_token_id, policy)
    width = source_length if states is None else states.shape[1]  # P, also without input_ids
    if states is not None:
        states = encoder_decoder.place_states(states, ids.shape[1])
    plan = _plan(model, resolved, mode, ids.shape, new_slots, None, layout, request)
    rows = library_dots(params, _decode_rows(plan, ids.shape[0]), layout is not None)
    plan = dataclasses.replace(plan, caches=(), library_dots=rows)  # no memory check: its
    # sizes are a decoder-only model's caches
    if request.mesh is not None:  # concrete arrays only; inside a user's jit constraints place
        params = layout.place_params(params)
        ids, mask, states, prefix = layout.place_rows(ids, mask, states, prefix)
    traced = TracedInputs(
        config=resolved,
        key=key if key is not None else jax.random.key(0),
        offset=jnp.zeros((), jnp.int32),
        bounds=bounds,
        stop_strings=stop_strings,
        assistant_params=None,
        logits_processor=as_processors(request.logits_processor),
        automaton=automaton_for(request.constraint, mode, batch, model, resolved),
        decoder_input_ids=prefix,
        source_length=jnp.asarray(source_length, jnp.int32),
        encoder_states=states,
    )
    given = encoder_decoder.given_outputs(request.encoder_outputs, resolved)
    return PreparedCall(
        plan, params, ids, mask, traced, prefix, width, new_tokens, 0, policy, given
    )


def _resolve(model, config, request: CallRequest):
    """``(lengths, resolved, mode)``: the call's length settings before the library defaults,
    its config merged with the model's ``generation_config``, the defaults and the overrides
    (:func:`~genjax.generation.inputs.resolve_config`), and its loop, all checked (mode, values
    against the vocabulary, cache options)."""
    if request.assistant_params is not None and request.assistant_model is None:
        raise InputError(
            "assistant_params is given without assistant_model, so nothing would read it: pass "
            "the draft model as assistant_model=, or leave assistant_params unset."
        )
    default = getattr(model, "generation_config", None)
    lengths, resolved = resolve_config(config, dict(request.overrides), default)
    mode = mode_of(resolved, request.assistant_model)
    check_mode(resolved, request.assistant_model, mode)
    validate_config(resolved, model.vocab_size)
    check_cache_options(resolved.cache_implementation, resolved.cache_config)
    return lengths, resolved, mode


def check_mode(config: GenerationConfig, assistant_model, mode: Mode) -> None:
    """Raises UnsupportedError for a mode (or a mode's option) genjax does not run, and for an
    option it would otherwise ignore (:func:`genjax.generation.options.check_options`)."""
    check_options(config, assistant_model, mode is Mode.ASSISTED)
    if mode is Mode.ASSISTED:
        assisted.check_config(config, assistant_model)
    elif mode is Mode.BEAMS:
        beam.check_supported(config)
    name = str(config.get_generation_mode(assistant_model).value)
    if name not in SUPPORTED_MODES:
        raise UnsupportedError(
            f"generation mode {name!r} is not supported by genjax yet; supported: "
            f"{', '.join(SUPPORTED_MODES)}. Set num_beams=1 and leave assistant / contrastive "
            f"/ DoLa options unset."
        )


def _placed_width(input_ids, slots, policy) -> int:
    """The width :func:`_place` lays prompts of ``input_ids``'s shape out in, known before any
    padding is made (the memory check runs first)."""
    if slots is not None:
        return slots.buffer_length
    if isinstance(input_ids, jax.core.Tracer):
        return input_ids.shape[1]
    return policy.length(input_ids.shape[1])


def _place(input_ids, attention_mask, pad_token_id, slots, width: int):
    """Lays int32[B, P] prompts out in the program's slots: the ``max_cache_len`` buffer, else
    left-padded to ``width`` (:func:`_placed_width`: the bucket length), else (traced, inside a
    user's jit) as given.

    Returns:
        ``(ids int32[B, width], mask int32[B, width], offset, prompt_end)``; ``offset`` (``o``)
        and ``prompt_end`` (``e = o + P``) are Python ints.
    """
    prompt_length = input_ids.shape[1]
    if slots is not None:  # one program for every P + N <= max_cache_len: see cache.slots
        return slots.place(input_ids, attention_mask, pad_token_id)
    if isinstance(input_ids, jax.core.Tracer):
        return input_ids, attention_mask, 0, prompt_length
    offset = width - prompt_length
    input_ids, attention_mask = pad_prompt(input_ids, attention_mask, pad_token_id, offset)
    return input_ids, attention_mask, offset, offset + prompt_length


def _plan(model, config, mode, shape, new_tokens, slots, layout, request) -> CallPlan:
    """The :class:`CallPlan` of a call whose program takes prompts of ``shape`` (``[B,
    width]``) and asks for ``new_tokens``; ``config`` is resolved."""
    steps = slots.max_steps if slots is not None else new_tokens
    # the cache slots after the prompt's: the slot buffer holds them, except assisted
    # generation's, which counts every step (genjax.decoding.assisted.cache_lengths)
    cache_new = 0 if slots is not None and mode is not Mode.ASSISTED else steps
    caches = cache_requests(model, config, mode, shape, cache_new, request.assistant_model)
    return CallPlan(
        model=model,
        mode=mode,
        do_sample=bool(config.do_sample),
        width=shape[1],
        steps=steps,
        slots=slots,
        layout=layout,
        quantized=is_quantized(config),
        prefill_chunk=config.prefill_chunk_size,
        num_return_sequences=config.num_return_sequences,
        num_beams=config.num_beams,
        output_scores=bool(config.output_scores),
        output_logits=bool(config.output_logits),
        output_hidden_states=bool(config.output_hidden_states),
        output_attentions=bool(config.output_attentions),
        allowed_tokens_fn=request.allowed_tokens_fn,
        stopping_criteria=tuple(request.stopping_criteria),
        assistant=request.assistant_model,
        streaming=request.streamer is not None,
        caches=tuple(caches),
        guidance=config.is_active("guidance_scale"),
    )


def cache_requests(model, config, mode: Mode, shape, cache_new: int, assistant):
    """The KV caches a call allocates, as the program sizes them (``shape`` is the padded
    ``[B, width]`` of the prompt, ``cache_new`` the slots after it), for the memory check
    before anything is allocated."""
    batch, width = shape
    quantized = is_quantized(config)
    if mode is Mode.ASSISTED:
        candidates = (
            config.num_assistant_tokens
            if assistant is not None
            else config.prompt_lookup_num_tokens
        )
        sizes = assisted.cache_lengths(width, cache_new, batch, int(candidates))
        margin = assisted.ring_margin(int(candidates))
        requests = [CacheRequest(model, batch, sizes[0], quantized, margin)]
        if assistant is not None:
            requests.append(CacheRequest(assistant, batch, sizes[1], quantized, margin))
        return requests
    copies = config.num_beams if mode is Mode.BEAMS else config.num_return_sequences
    return [CacheRequest(model, batch * copies, width + cache_new, quantized)]
