"""``generate`` for encoder-decoder models (T5, BART, mBART, Marian): the source and the prefix.

An encoder-decoder call runs one compiled program, as a decoder-only call does. Its
``input_ids`` are the source, which the encoder reads once; the decoding loops of
:mod:`genjax.decoding` then drive the decoder exactly as they drive a decoder-only model, over
a token buffer that holds the decoder's tokens only::

    source (encoder)   slot 0 .......... P-1 | P ...... Pb-1      Pb: the bucket length
                       the user's input_ids  | padding (masked; genjax's, right of the source)

    decoder buffer     slot 0 ...... Pd-1 | Pd ........... Pd+N-1
                       the prefix         | the new tokens (N)

The prefix is ``decoder_start_token_id`` (the config's, else the model's, else
``bos_token_id``, as transformers v5 picks it), or ``decoder_input_ids`` given by the caller,
with the start token put in front when no row starts with it (transformers' rule).
``max_length`` counts the decoder's tokens only, so ``N = max_length - Pd``, and
``sequences`` are the decoder's tokens, starting with the start token, as transformers returns
them.

The source is padded on the right, not the left: BART and Marian number the encoder's positions
by slot whatever the mask, so left padding would move them, while masked slots at the end
change nothing. The cross-attention keys and values are computed once after the encoder
(``model.init_cache``) and kept per prompt: beams and ``num_return_sequences`` multiply the
cache's ``rows_per_prompt`` and reorder only the self-attention slots
(:mod:`genjax.cache.encoder_decoder`). The ``encoder_*`` processors read the source, through
``LogitsContext.encoder_tokens`` (one row per decoder row; -1 in genjax's padding).

``encoder_outputs`` (the encoder's states float[B, Ps, D], from an earlier ``model.encode``)
replace the encoder: they are right-padded with zeros to the source's bucket, beside the mask,
and go straight to ``model.init_cache``; ``input_ids`` is then optional, read only by the
``encoder_*`` processors.

A ``streamer`` gets the decoder's tokens, as transformers' ``generate`` puts them for these
models: the prefix first (``[[decoder_start_token_id]]``, or the start token and the forced
``decoder_input_ids``), then each new token; never the source.

The int8 cache (``cache_implementation="quantized"``, :mod:`genjax.cache.quantized`) holds the
decoder's self-attention slots; the cross-attention keys and values, written once and read at
every step, stay in the model dtype. Beyond transformers, whose ``generate`` raises for a
quantized cache on an encoder-decoder model.

A ``constraint`` (:mod:`genjax.constraints`) applies to the new decoder tokens, as for a
decoder-only model's continuation: the prefix (the start token, ``decoder_input_ids``) is not
read by the automaton, which starts in its initial state at the first new token.

``output_hidden_states`` / ``output_attentions`` (:mod:`genjax.generation.outputs`): the
prefill runs the encoder and the decoder's prefix with the flags and returns the encoder's
outputs (over the source bucket ``Pb``, one row per prompt) beside the decoder's; the loops
record every later decoder call as for a decoder-only model. ``PreparedCall.finish`` cuts the
bucket to the source's ``P``. With ``encoder_outputs`` the encoder does not run: the encoder
fields are the given object's (:func:`given_outputs`), as transformers passes them through.

``mesh=`` (or a user's ``jax.jit`` under ``jax.set_mesh``) runs the call sharded as a
decoder-only call (:mod:`genjax.sharding`): the T5 and BART params split by the logical-axis
rules (attention heads and MLP width on ``model``), the source, its mask, the decoder's prefix
and any ``encoder_outputs`` with their rows on ``data``, and the cache's decoder slots
``[B, K, H, S]`` and per-prompt cross-attention blocks ``[B / R, K, H, Se]`` with rows on
``data`` and heads on ``model``. The prompts of a ``data`` block keep their beams and returned
sequences on that block, so the per-prompt cross blocks are never gathered.

``max_cache_len = M`` (:func:`decoder_slots`) gives the decoder's self-attention cache and its
token buffer ``M`` slots, as it gives a decoder-only model's prompt and new tokens (see
:mod:`genjax.cache.slots`), and makes ``N`` traced: every call with ``Pd + N <= M`` and the same
source bucket runs one program::

    decoder buffer     slot 0 ...... Pd-1 | Pd ........... Pd+N-1 | Pd+N ...... M-1
                       the prefix         | the new tokens (N)    | pad, never written

The loops stop at slot ``Pd + N`` (greedy and sampling: ``DecodeRules.end``; beams:
``BeamRules.num_new_tokens``, so that the length rules and ``early_stopping`` see ``N`` as
without ``max_cache_len``). ``sequences`` are int32[B*R, M], ``pad_token_id`` after slot
``Pd + N - 1``; ``scores`` / ``logits`` and ``beam_indices`` hold ``M - Pd`` steps, 0 (-1) after
step ``N``. Their first ``Pd + N`` columns (``N`` steps) are what the call returns without
``max_cache_len``. The prefix is not chunked: its length ``Pd`` is static (1 unless
``decoder_input_ids`` are given). The cross-attention cache keeps the source's bucket length.
``Pd + N > M`` raises ``InputError``. Beyond a decoder-only model, beam search and beam sampling
take ``max_cache_len`` too (their prompt, the prefix, has a static length).

Not supported for encoder-decoder models yet, each raising ``UnsupportedError`` by name:
assisted generation and classifier-free guidance.

Static or traced:
    Static: the source's bucket length ``Pb``, the prefix length ``Pd``, ``N`` (with
    ``max_cache_len``: ``M``). Traced: the source ids and mask, the source length ``P`` within
    its bucket, the prefix's ids (the start token included), with ``max_cache_len`` ``N``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from genjax.cache.quantized import QuantizedKVCache
from genjax.cache.slots import check_length, pad_prompt
from genjax.errors import InputError, UnsupportedError
from genjax.typing import Array, vary_like

__all__ = [
    "check_request",
    "decoder_prefix",
    "decoder_slots",
    "encoder_inputs",
    "encoder_states",
    "given_outputs",
    "is_encoder_decoder",
    "place_source",
    "prefill",
    "source_tokens",
    "start_token_id",
]

_REFUSED = {
    "assistant_model": "assistant_model= (assisted generation)",
    "negative_prompt_ids": "negative_prompt_ids= (classifier-free guidance)",
}


def is_encoder_decoder(model) -> bool:
    """Whether ``model`` follows the encoder-decoder protocol of :mod:`genjax.models`."""
    return bool(getattr(model, "is_encoder_decoder", False))


def check_request(model, request, config, assisted: bool) -> None:
    """Raises UnsupportedError for what encoder-decoder generation does not run yet, naming it.

    Args:
        model: the encoder-decoder model.
        request: the call's :class:`~genjax.generation.plan.CallRequest`.
        config: the resolved :class:`~genjax.GenerationConfig`.
        assisted: whether the call's mode is assisted generation (a draft or prompt lookup).
    """
    refused = [text for name, text in _REFUSED.items() if getattr(request, name) is not None]
    if assisted and request.assistant_model is None:
        refused.append("prompt_lookup_num_tokens (assisted generation)")
    if config.is_active("guidance_scale"):
        refused.append(f"guidance_scale={config.guidance_scale!r} (classifier-free guidance)")
    if refused:
        raise UnsupportedError(
            f"{', '.join(dict.fromkeys(refused))} is not supported with encoder-decoder models "
            f"({type(model).__name__}) yet: generate runs them with greedy decoding, sampling, "
            f"beam search and beam sampling, on one device or a mesh. Drop it."
        )


def start_token_id(config, model):
    """The decoder's first token: the config's ``decoder_start_token_id``, else the model's,
    else ``bos_token_id`` (transformers v5's order); an int or int[B], possibly traced.

    Raises:
        InputError: none of them is set.
    """
    for value in (
        config.decoder_start_token_id,
        getattr(model, "decoder_start_token_id", None),
        config.bos_token_id,
    ):
        if value is not None:
            return value
    raise InputError(
        f"encoder-decoder generation needs decoder_start_token_id (or bos_token_id): neither "
        f"the config nor {type(model).__name__}'s config.json sets one. Pass "
        f"decoder_start_token_id=<id> (T5: the pad id 0; BART: the EOS id 2)."
    )


def decoder_prefix(start, decoder_input_ids, batch: int, vocab_size: int) -> Array:
    """int32[B, Pd]: the decoder's prefix, as transformers'
    ``_prepare_decoder_input_ids_for_generation`` builds it (numpy unless ``start`` is traced).

    Args:
        start: the start token (an int, int[] or int[B]; concrete or traced).
        decoder_input_ids: None, or int[B, T] forced decoder tokens; the start token is put in
            front unless some row already starts with it.
        batch: ``B`` (static).
        vocab_size: to check the ids of a concrete ``decoder_input_ids``.

    Raises:
        InputError: a start token of the wrong shape; ``decoder_input_ids`` that is not
            int[B, T] or holds ids outside the vocabulary.

    Example:
        >>> decoder_prefix(0, None, 2, 32).tolist()
        [[0], [0]]
        >>> decoder_prefix(0, np.array([[5, 6], [7, 8]]), 2, 32).tolist()
        [[0, 5, 6], [0, 7, 8]]
    """
    xp = jnp if isinstance(start, jax.core.Tracer) else np  # numpy: no program per batch size
    start = xp.asarray(start, xp.int32)
    if start.ndim > 1 or (start.ndim == 1 and start.shape[0] not in (1, batch)):
        raise InputError(
            f"decoder_start_token_id must be one id or one per input row ({batch}); got shape "
            f"{tuple(start.shape)}."
        )
    column = xp.broadcast_to(start.reshape(-1, 1), (batch, 1))
    if decoder_input_ids is None:
        return column
    if not hasattr(decoder_input_ids, "shape"):
        decoder_input_ids = np.asarray(decoder_input_ids)
    shape = tuple(decoder_input_ids.shape)
    integer = jnp.issubdtype(decoder_input_ids.dtype, jnp.integer)
    if len(shape) != 2 or shape[0] != batch or not integer:
        raise InputError(
            f"decoder_input_ids must be int[B, T] with B = {batch} (the rows of input_ids); got "
            f"{decoder_input_ids.dtype}{list(shape)}."
        )
    if shape[1] == 0:
        return column
    if any(isinstance(x, jax.core.Tracer) for x in (decoder_input_ids, start)):
        raise InputError(
            "decoder_input_ids needs concrete ids and a concrete decoder_start_token_id (not "
            "traced inside a jit): whether the start token goes in front changes the shape."
        )
    values = np.asarray(decoder_input_ids)
    if values.min() < 0 or values.max() >= vocab_size:
        raise InputError(
            f"decoder_input_ids holds ids in [{values.min()}, {values.max()}], outside the "
            f"model's vocabulary [0, {vocab_size - 1}]."
        )
    ids = values.astype(np.int32)
    if (ids[:, 0] == column[:, 0]).any():  # transformers: unless no row does
        return ids
    return np.concatenate([column, ids], axis=1)


def decoder_slots(max_cache_len: int, prefix_length: int, num_new_tokens: int):
    """The decoder buffer of a ``max_cache_len`` call (module docstring): ``(new_slots,
    bounds)``, the static slots after the prefix ``M - Pd`` and int32[2] ``[Pd, Pd + N]``, the
    traced end of the prefix and of the call.

    Raises:
        InputError: ``Pd + N > max_cache_len``.

    Example:
        >>> new_slots, bounds = decoder_slots(16, 1, 5)
        >>> new_slots, bounds.tolist()
        (15, [1, 6])
    """
    check_length(max_cache_len, prefix_length, num_new_tokens, prompt="decoder prefix")
    bounds = np.array([prefix_length, prefix_length + num_new_tokens], np.int32)
    return max_cache_len - prefix_length, jax.device_put(bounds)


def encoder_states(encoder_outputs, model, batch: int | None) -> Array:
    """float[B, Ps, D]: the last hidden state of the encoder in ``generate(encoder_outputs=)``.

    Args:
        encoder_outputs: transformers' ``encoder_outputs`` (a ``BaseModelOutput`` or anything
            with ``last_hidden_state``, a dict with that key, or a tuple whose first item it
            is) or the array itself; numpy, torch (CPU) or jax, concrete or traced.
        model: the encoder-decoder model (its ``hidden_size`` ``D`` is checked).
        batch: ``B``, the rows of ``input_ids``, or None when no ``input_ids`` are given.

    Raises:
        InputError: no last hidden state, or one that is not float[B, Ps, D].

    Example:
        >>> states = model.encode(params, ids, mask)  # doctest: +SKIP
        >>> encoder_states({"last_hidden_state": states}, model, None).shape  # doctest: +SKIP
        (2, 9, 32)
    """
    states = encoder_outputs
    if isinstance(states, dict):
        states = states.get("last_hidden_state")
    elif hasattr(states, "last_hidden_state"):
        states = states.last_hidden_state
    elif isinstance(states, (tuple, list)) and states:
        states = states[0]
    if states is not None and not isinstance(states, jax.Array):
        detach = getattr(states, "detach", None)  # a torch tensor
        states = np.asarray(states.detach().cpu() if detach else states)
    width = model.hidden_size
    shape = tuple(getattr(states, "shape", ()))
    floating = states is not None and jnp.issubdtype(states.dtype, jnp.floating)
    if len(shape) != 3 or not floating or shape[2] != width or batch not in (None, shape[0]):
        rows = "B" if batch is None else batch
        got = "None" if states is None else f"{states.dtype}{list(shape)}"
        raise InputError(
            f"encoder_outputs must hold the encoder's last hidden state float[B, Ps, D] with "
            f"B = {rows} (the rows of input_ids) and D = {width} (the model width); got "
            f"{got}. Pass model.encode(params, ids, mask), or transformers' encoder output."
        )
    return states.astype(model.dtype)


def encoder_inputs(model, input_ids, encoder_outputs, config):
    """``(input_ids, states, source_length)`` of an encoder-decoder call (``config`` resolved):
    with ``encoder_outputs``, its states float[B, Ps, D] and ``input_ids`` (for the ``encoder_*``
    processors only) checked against them, or ids of 0 when None, which no processor reads
    (``source_length`` 0); without, the ids as given, None and their length.

    Raises:
        InputError: ``input_ids`` None without ``encoder_outputs``, or with ``encoder_*``
            processors; ``input_ids`` whose shape is not the states' ``[B, Ps]``.
    """
    if encoder_outputs is None:
        if input_ids is None:
            raise InputError(
                "input_ids is None: pass the source ids, or encoder_outputs= (the encoder's "
                "states from an earlier call) to skip the encoder."
            )
        return input_ids, None, np.shape(input_ids)[1]
    batch = None if input_ids is None else np.shape(input_ids)[0]
    states = encoder_states(encoder_outputs, model, batch)
    if input_ids is not None:
        if tuple(np.shape(input_ids)) != tuple(states.shape[:2]):
            raise InputError(
                f"input_ids {tuple(np.shape(input_ids))} must be the [B, Ps] of encoder_outputs "
                f"{tuple(states.shape)}: the source the states were computed from (read by the "
                f"encoder_* processors only), or None."
            )
        return input_ids, states, states.shape[1]
    ngrams = config.encoder_no_repeat_ngram_size
    active = {
        "encoder_repetition_penalty": config.is_active("encoder_repetition_penalty"),
        "encoder_no_repeat_ngram_size": ngrams is not None and ngrams > 0,
    }
    for name, on in active.items():
        if on:
            raise InputError(
                f"{name} reads the source ids, but input_ids is None (encoder_outputs= alone). "
                f"Pass the source ids as input_ids too, or unset {name}."
            )
    xp = jnp if isinstance(states, jax.core.Tracer) else np
    return xp.zeros(states.shape[:2], xp.int32), states, 0


def given_outputs(encoder_outputs, config) -> dict:
    """The ``encoder_hidden_states`` / ``encoder_attentions`` of a call given
    ``encoder_outputs``, for the ``output_*`` flags of ``config`` that are set: as transformers,
    the given object's own ``hidden_states`` / ``attentions`` (a ``BaseModelOutput``, a dict,
    or an object with those attributes), as jax arrays, or None when it carries none. Empty
    without ``encoder_outputs`` (the program records the encoder then).

    Example:
        >>> states = np.zeros((1, 3, 32), np.float32)
        >>> given = given_outputs({"last_hidden_state": states, "hidden_states": (states,)},
        ...                       genjax.GenerationConfig(output_hidden_states=True))
        >>> given["encoder_hidden_states"][0].shape
        (1, 3, 32)
    """
    if encoder_outputs is None:
        return {}
    given = {}
    for key in ("hidden_states", "attentions"):
        if not getattr(config, f"output_{key}"):
            continue
        if isinstance(encoder_outputs, dict):
            layers = encoder_outputs.get(key)
        else:
            layers = getattr(encoder_outputs, key, None)
        given[f"encoder_{key}"] = None if layers is None else tuple(_as_jax(x) for x in layers)
    return given


def _as_jax(value) -> Array:
    """A jax array (or tracer) from a jax, numpy or torch (CPU) array."""
    if isinstance(value, (jax.Array, jax.core.Tracer)):
        return value
    detach = getattr(value, "detach", None)  # a torch tensor
    return jnp.asarray(np.asarray(value.detach().cpu() if detach else value))


def place_states(states, width: int):
    """float[B, width, D]: encoder states right-padded with zeros to the source's bucket length
    ``width`` (slots its mask hides); as given when they fill it (or are traced)."""
    right = width - states.shape[1]
    if not right or isinstance(states, jax.core.Tracer):
        return states if isinstance(states, jax.Array) else jax.device_put(states)
    padded = np.zeros((states.shape[0], width, states.shape[2]), states.dtype)
    padded[:, : states.shape[1]] = np.asarray(states)
    return jax.device_put(padded)


def place_source(input_ids, attention_mask, pad_token_id, policy):
    """``(ids int32[B, Pb], mask int32[B, Pb])``: the source right-padded to its bucket length
    (masked slots holding ``pad_token_id``); inside a user's jit, where the shape is fixed, as
    given."""
    if isinstance(input_ids, jax.core.Tracer):
        return jnp.asarray(input_ids, jnp.int32), jnp.asarray(attention_mask, jnp.int32)
    if isinstance(input_ids, jax.Array) and not input_ids.is_fully_addressable:
        # a multi-host global array: its rows lie partly on other processes; pad_prompt pads
        # it with JAX
        ids, mask = input_ids.astype(jnp.int32), jnp.asarray(attention_mask).astype(jnp.int32)
    else:
        ids, mask = np.asarray(input_ids, np.int32), np.asarray(attention_mask, np.int32)
    right = policy.length(ids.shape[1]) - ids.shape[1]
    if not right:
        return jax.device_put(ids), jax.device_put(mask)
    return pad_prompt(ids, mask, pad_token_id, 0, right)


def prefill(
    model,
    params,
    source,
    source_mask,
    prefix,
    new_slots: int,
    pad_token_id,
    quantized,
    states=None,
    forward_flags=None,
):
    """Runs the encoder once (unless ``states`` are given), builds the decoder cache with its
    cross-attention keys and values, and runs the decoder over the prefix.

    Args:
        model: the encoder-decoder model (static).
        params: its parameters.
        source: int32[B, Pb] source ids; ``source_mask`` int32[B, Pb], 1 on real tokens.
        prefix: int32[B, Pd] decoder prefix (the start token first).
        new_slots: ``N`` (static), the decoder slots after the prefix.
        pad_token_id: int32[], written in the new slots of the returned buffer.
        quantized: (static) whether the decoder's self-attention slots are int8
            (:class:`~genjax.cache.quantized.QuantizedKVCache`); the cross-attention keys and
            values stay in the model dtype.
        states: None, or float[B, Pb, D] encoder states to use instead of running the encoder
            (``generate(encoder_outputs=)``); then ``source`` is read by nobody here.
        forward_flags: None, or the ``output_*`` keywords (static) for the encoder and the
            decoder (:mod:`genjax.models.encoder_decoder`).

    Returns:
        ``(logits float32[B, 1, V], cache, cache_mask int32[B, Pd + N], tokens int32[B, Pd + N])``
        as :func:`genjax.generation.prefill.prefill` returns them for a decoder-only model: the
        loops of :mod:`genjax.decoding` take them unchanged. With ``forward_flags``, a fifth
        value: the dict of the encoder's outputs (none when ``states`` are given) and the
        decoder's over the prefix.
    """
    flags = forward_flags or {}
    batch, length = prefix.shape
    recorded = {}
    if states is None:
        states = model.encode(params, source, source_mask, **flags)
        if flags:
            states, recorded = states
    cache = model.init_cache(batch, length + new_slots, states, source_mask, params)
    if quantized:  # the float slots are never read: XLA drops them
        cache = cache.replace(self_attention=QuantizedKVCache.like(cache.self_attention))
    cache_mask = jnp.ones((batch, length + new_slots), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    logits, cache, *decoded = model.apply(
        params, prefix, positions, cache, cache_mask, logits_to_keep=1, **flags
    )
    filler = jnp.full((batch, new_slots), pad_token_id, jnp.int32)
    result = (logits, cache, cache_mask, jnp.concatenate([prefix, filler], axis=1))
    # Inside a user's shard_map the first self-attention keys and values and the prefix come from
    # the start token alone, typed as not varying over the rows' axis, while the loop's later
    # writes are: lax.while_loop refuses a carry whose type changes.
    result = vary_like(result, states)
    return (*result, {**recorded, **decoded[0]}) if flags else result


def source_tokens(source, source_length, rows_per_prompt: int) -> Array:
    """int32[B * R, Pb]: the source ids for the ``encoder_*`` processors, one row per decoder
    row (prompt ``b``'s row repeated ``R`` times, static), -1 in genjax's padding (slots from
    ``source_length``, int32[])."""
    slots = jnp.arange(source.shape[1])[None, :]
    marked = jnp.where(slots < source_length, source, -1)
    return jnp.repeat(marked, rows_per_prompt, axis=0)
