"""What every decoding path of ``generate`` does first, inside the compiled program.

The special token ids, the stopping rules with their ``max_time`` clock, the prefill into a cache
preallocated to its final length, and the processors' view of the prompt. Shapes use the axis
letters of :mod:`genjax.typing`; everything here runs under ``generate``'s ``jax.jit``, so the
arguments are traced except where a docstring says static.
"""

from __future__ import annotations

import inspect

import jax.numpy as jnp

from genjax.cache.quantized import init_cache
from genjax.cache.slots import prefill_chunks
from genjax.config import GenerationConfig
from genjax.processors import LogitsContext
from genjax.stopping import start_timer, stopping_rules
from genjax.typing import Array


def special_ids(config: GenerationConfig) -> tuple[Array, Array | None]:
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


def start_stopping(config, eos_token_ids, criteria, stop_strings, offset, input_ids):
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


def prefill(
    model,
    params,
    input_ids,
    attention_mask,
    max_new_tokens: int,
    pad_token_id,
    quantized=False,
    chunk: int | None = None,
    ring_margin: int = 0,
    positions=None,
    forward_flags: dict[str, bool] | None = None,
):
    """Runs the prompt through the model and returns a cache sized for all ``S = P + N`` slots
    (int8 codes when ``quantized``, static: see :mod:`genjax.cache.quantized`).

    The prompt goes into a cache of its own ``P`` slots, which then grows to ``S``
    (``with_length``): the prefill's attention reads the ``P`` prompt slots rather than all
    ``S``, so its cost does not grow with ``max_new_tokens`` (the empty slots it skips are masked
    out either way, so the result is the same). With ``chunk`` (``prefill_chunk_size``, static)
    the prompt goes through the model ``chunk`` slots at a time
    (:func:`genjax.cache.slots.prefill_chunks`, the ``max_cache_len`` path's loop), the last
    chunk holding the ``P mod chunk`` slots left: the activations of one chunk at a time instead
    of ``P``, the same logits and cache.

    Sliding-window layers (:mod:`genjax.cache.ring`): the final cache keeps a layer of window
    ``W`` as a ring of ``W + ring_margin`` slots (static; assisted decoding passes its ``G + 1``)
    when that is less than ``S``. An unchunked prefill writes the prompt in the full layout of
    ``P`` slots (as many as its activations hold anyway) and keeps the last ``W + ring_margin``
    when the cache grows; a chunked one writes into rings from the start, each chunk reading the
    ring before it and its own slots, so its cache stays at ``W`` slots for any ``P``.

    ``positions`` int32[B, P]: the prompt's position ids; default: as transformers v5's
    ``generate`` counts them, real tokens only (padding gets 0).

    ``forward_flags`` (static, e.g. ``{"output_hidden_states": True}``) go to the model's
    ``apply``, unchunked (the call plan refuses ``prefill_chunk_size`` with them); the dict of
    its extra outputs over all ``P`` prompt slots is then returned fifth.

    Returns:
        ``(logits float32[B, 1 or P, V], cache, cache_mask int32[B, S], tokens int32[B, S])``
        (one row of logits when the model takes ``logits_to_keep`` or ``chunk`` is set; callers
        use the last): ``cache_mask`` marks real prompt tokens and every new slot; ``tokens`` is
        the prompt followed by ``pad_token_id`` in the new slots. With ``forward_flags``, the
        model's extra outputs follow.
    """
    flags = forward_flags or {}
    batch, prompt_length = input_ids.shape
    if positions is None:
        positions = jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0)
    new_slots = jnp.ones((batch, max_new_tokens), jnp.int32)
    cache_mask = jnp.concatenate([attention_mask, new_slots], axis=1)
    cache = init_cache(model, batch, prompt_length, quantized)
    chunked = chunk is not None and chunk < prompt_length
    if not chunked and getattr(cache, "span", 0):  # ring layers: the prompt goes in full
        cache = cache.with_length(prompt_length, ring=False)
    if chunked:
        logits, cache = _prefill_in_chunks(
            model, params, input_ids, positions, attention_mask, cache, chunk
        )
    elif accepts_logits_to_keep(model):  # the last position's logits only: [B, 1, V]
        outputs = model.apply(
            params, input_ids, positions, cache, attention_mask, logits_to_keep=1, **flags
        )
        logits, cache = outputs[:2]
    else:
        outputs = model.apply(params, input_ids, positions, cache, attention_mask, **flags)
        logits, cache = outputs[:2]
    extra = {"margin": ring_margin} if ring_margin else {}  # a model's own cache may lack it
    cache = cache.with_length(prompt_length + max_new_tokens, **extra)
    tokens = jnp.concatenate([input_ids, new_slots * pad_token_id], axis=1)
    if flags:
        return logits, cache, cache_mask, tokens, outputs[2]
    return logits, cache, cache_mask, tokens


def _prefill_in_chunks(model, params, input_ids, positions, attention_mask, cache, chunk: int):
    """``(logits float32[B, 1, V], cache)``: the ``P // chunk`` full chunks in a loop, then the
    ``P mod chunk`` slots left in one more call (as ``torch.split``'s shorter last chunk)."""
    keep_one = accepts_logits_to_keep(model)
    full, rest = divmod(input_ids.shape[1], chunk)
    logits, cache = prefill_chunks(
        model, params, input_ids, positions, attention_mask, cache, chunk, full, keep_one=keep_one
    )
    if rest:
        extra = {"logits_to_keep": 1} if keep_one else {}
        tail = [x[:, full * chunk :] for x in (input_ids, positions)]
        logits, cache = model.apply(params, *tail, cache, attention_mask, **extra)
        logits = logits[:, -1].astype(jnp.float32)
    return logits[:, None], cache


def is_quantized(config: GenerationConfig) -> bool:
    """Whether the call's KV caches hold int8 codes (``cache_implementation="quantized"``)."""
    return config.cache_implementation == "quantized"


def accepts_logits_to_keep(model) -> bool:
    """Whether ``model.apply`` takes the protocol's optional ``logits_to_keep`` keyword."""
    try:
        return "logits_to_keep" in inspect.signature(model.apply).parameters
    except (TypeError, ValueError):  # no introspectable signature
        return False


def prompt_context(tokens, length, attention_mask, offset) -> LogitsContext:
    """The processors' view of the prompt, before the first new token."""
    return LogitsContext(
        tokens=tokens,
        length=length,
        offset=offset,
        prompt_end=length,
        first_valid=jnp.argmax(attention_mask != 0, axis=-1).astype(jnp.int32),
    )
