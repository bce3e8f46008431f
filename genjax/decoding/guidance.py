"""Classifier-free guidance: an unconditional branch decoded beside the conditional one.

``guidance_scale`` (``g``) mixes each step's next-token log-probabilities of the prompt
(conditional) with those of an unconditional context, as transformers'
``UnbatchedClassifierFreeGuidanceLogitsProcessor`` does (credit: Sanchez et al., "Stay on topic
with Classifier-Free Guidance", 2023)::

    scores = g * (log_softmax(cond) - log_softmax(uncond)) + log_softmax(uncond)

first in the processor chain, so every later processor and warper sees the mixed scores. The
unconditional context is ``negative_prompt_ids`` (with ``negative_prompt_attention_mask``), or
by default each row's last prompt token. It has its own KV cache, prefilled before the first
token and fed each chosen token, inside the same ``lax.while_loop`` (transformers calls the
model from the processor on the host side of its loop).

Positions follow transformers: its processor calls the model without position ids, so the
model counts slots (``0, 1, ...`` over the negative prompt, its padding included, then one per
new token), not real tokens as ``generate``'s own prefill does.

Static or traced:
    Static: whether guidance runs (``guidance_scale`` set and not 1), the negative prompt's
    width ``Pn`` and the number of new slots ``N`` (the cache holds ``Pn + N``).
    Traced: ``guidance_scale`` (a scalar or one per row), the negative prompt, the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from genjax.processors.base import per_row
from genjax.typing import Array


@struct.dataclass
class GuidanceState:
    """The unconditional branch, carried through the decoding loop beside the prompt's."""

    cache: object  # the branch's KV cache of Pn + N slots; index = slots seen
    attention_mask: Array  # int32[B, Pn + N]: the negative prompt's mask, then 1 per new slot
    slot: Array  # int32[]: the slot (and position id) of the next token fed to the branch
    logits: Array  # float32[B, V]: the branch's latest next-token logits
    scale: Array  # float32[] or float32[B]: guidance_scale


def start(prefill, ids: Array, mask: Array, scale: Array) -> GuidanceState:
    """Prefills the unconditional context and returns the branch's state.

    Args:
        prefill: ``prefill(ids, mask, positions) -> (logits float32[B, 1 or Pn, V], cache,
            cache_mask int32[B, Pn + N], tokens)`` (:func:`genjax.generation.prefill.prefill`
            with the call's model, params and sizes bound).
        ids: int32[B, Pn] the unconditional context.
        mask: int32[B, Pn], 1 on its real tokens.
        scale: guidance_scale, float32[] or float32[B].
    """
    width = ids.shape[1]
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), ids.shape)
    logits, cache, cache_mask, _ = prefill(ids, mask, positions)
    return GuidanceState(
        cache=cache,
        attention_mask=cache_mask,
        slot=jnp.asarray(width, jnp.int32),
        logits=logits[:, -1].astype(jnp.float32),
        scale=jnp.asarray(scale, jnp.float32),
    )


def advance(step_fn, params, state: GuidanceState, tokens: Array) -> GuidanceState:
    """Feeds int32[B, 1] ``tokens`` (the last chosen ones) to the unconditional branch.

    ``step_fn`` is the model's ``apply`` (see :mod:`genjax.decoding.sampling`).
    """
    positions = jnp.broadcast_to(state.slot, tokens.shape)
    # A step function that records (output_hidden_states, ...) returns more: only the
    # prompt's branch is recorded, as in transformers, so the rest is dropped (and not computed).
    logits, cache = step_fn(params, tokens, positions, state.cache, state.attention_mask)[:2]
    return state.replace(cache=cache, slot=state.slot + 1, logits=logits[:, -1].astype(jnp.float32))


def guide(scores: Array, state: GuidanceState) -> Array:
    """float32[B, V]: ``scores`` (the conditional logits) mixed with the branch's logits."""
    conditional = jax.nn.log_softmax(scores, axis=-1)
    unconditional = jax.nn.log_softmax(state.logits, axis=-1)
    return per_row(state.scale) * (conditional - unconditional) + unconditional


def repeat_rows(state: GuidanceState, count: int) -> GuidanceState:
    """The state with each row repeated ``count`` (static) times in place, as the prompt's rows
    are for ``num_return_sequences``."""
    if count == 1:
        return state
    rows = lambda x: jnp.repeat(x, count, axis=0)  # noqa: E731
    scale = state.scale if state.scale.ndim == 0 else rows(state.scale)
    return state.replace(
        cache=state.cache.repeat_rows(count),
        attention_mask=rows(state.attention_mask),
        logits=rows(state.logits),
        scale=scale,
    )
