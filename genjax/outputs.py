"""What ``generate`` returns, and transition scores computed from it.

Static shapes: every output has the full ``N = max_new_tokens`` steps, even when all rows finished
earlier (transformers returns only the steps it ran). Slots of ``sequences`` past a row's end
hold ``pad_token_id``; steps of ``scores`` and ``logits`` that were never run hold 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from genjax.typing import Array


@struct.dataclass
class GenerateOutput:
    """The result of :func:`genjax.generate`.

    R is ``num_return_sequences``; rows of one prompt are adjacent (row ``b * R + r``).
    """

    sequences: Array  # int32[B*R, P+N]: the prompt as given, then new tokens
    scores: Array | None = None  # float32[B*R, N, V]: processed scores, if output_scores
    logits: Array | None = None  # float32[B*R, N, V]: raw logits, if output_logits
    sequences_scores: Array | None = None  # float32[B*R]: beam search only
    beam_indices: Array | None = None  # int32[B*R, N]: beam search only


def compute_transition_scores(
    sequences: Array,
    scores: Array,
    beam_indices: Array | None = None,
    normalize_logits: bool = False,
) -> Array:
    """Returns the score of each generated token, as transformers' method of the same name.

    Args:
        sequences: int32[B, P+N], as returned by ``generate``.
        scores: float32[B, N, V], the processed scores (or raw logits) of each step.
        beam_indices: int32[B, N], the beam each step's token came from (beam search), where -1
            marks steps after the sequence ended; None for greedy and sampling.
        normalize_logits: apply ``log_softmax`` over V to each step first.

    Returns:
        float32[B, N]: ``scores[b, t, sequences[b, P + t]]`` (for beam search, read in the row of
        ``beam_indices[b, t]``); 0 where ``beam_indices`` is -1.

    Example:
        >>> out = genjax.generate(model, params, ids, cfg.replace(output_scores=True))
        >>> genjax.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    """
    scores = jnp.asarray(scores, jnp.float32)
    batch, steps, _ = scores.shape
    if normalize_logits:
        scores = jax.nn.log_softmax(scores, axis=-1)
    new_tokens = jnp.asarray(sequences)[:, -steps:]
    if beam_indices is None:
        rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, steps))
        unused = jnp.zeros((batch, steps), bool)
    else:
        beam_indices = jnp.asarray(beam_indices)
        unused = beam_indices < 0
        rows = jnp.where(unused, 0, beam_indices)
    picked = scores[rows, jnp.arange(steps)[None, :], new_tokens]
    return jnp.where(unused, 0.0, picked)
