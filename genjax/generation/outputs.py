"""What ``generate`` returns, and transition scores computed from it.

Static shapes: every output has the full ``N = max_new_tokens`` steps, even when all rows finished
earlier (transformers returns only the steps it ran). Slots of ``sequences`` past a row's end
hold ``pad_token_id``; steps of ``scores`` and ``logits`` that were never run hold 0; columns of
``beam_indices`` past a hypothesis' end hold -1. Cutting genjax's outputs to transformers' length
``n`` (the steps run) gives transformers' ``scores``/``logits``; for beam search transformers cuts
``sequences`` and ``beam_indices`` further, to the longest returned hypothesis (``P +`` the most
non-negative ``beam_indices`` in a row).

Hidden states and attentions (``output_hidden_states``, ``output_attentions``) come in
transformers' layout: a tuple with one entry per new token ``t = 0 .. N-1``, each a tuple over
the layers, of the model call that computed token ``t``'s logits. Step 0 is the prefill (``q =
P`` query positions, the prompt as given, with its own left padding); step ``t > 0`` fed new
token ``t - 1`` (``q = 1``)::

    hidden_states[t]   L + 1 arrays dtype[rows, q, D]: the embeddings, the output of each layer
                       but the last, then the last layer's after the final norm
    attentions[t]      L arrays dtype[rows, N, q, k], k = P + t keys (P at step 0): the softmax
                       weights over the prompt and the new tokens so far, 0 on masked keys

``rows`` is ``B*R`` (``B*M`` with beams: the running beams in the order they were fed, as
transformers records them), ``D`` the model width, ``N`` its query heads, and the dtype the
model's. A layer with a sliding window ``W`` (:attr:`~genjax.models.LlamaModel.attention_windows`)
has, at steps ``t > 0``, only the last ``min(k, W)`` keys, as transformers' sliding-window
cache returns them. Steps never run (every row finished) hold zeros, as ``scores`` does. Rows of
the user's padding positions (queries that may attend to nothing) are not meaningful: their
values follow from genjax's bucket padding and differ from transformers' (which are not
meaningful either); every real position matches.

Encoder-decoder models (T5, BART, Marian) return transformers' ``GenerateEncoderDecoderOutput``
fields instead of ``hidden_states`` / ``attentions``: the encoder's, once, and the decoder's per
new token, as above with ``q = Pd`` (the decoder's prefix: the start token, or ``Pd`` tokens
with ``decoder_input_ids``) at step 0 and ``P`` the source length::

    encoder_hidden_states   Le + 1 arrays dtype[B, P, D]: the embeddings, each layer's output
                            but the last, the last after the final norm (one row per source
                            row: transformers does not repeat them for beams or R)
    encoder_attentions      Le arrays dtype[B, Ne, P, P]
    decoder_hidden_states   per token: L + 1 arrays dtype[rows, q, D]
    decoder_attentions      per token: L arrays dtype[rows, N, q, Pd + t]
    cross_attentions        per token: L arrays dtype[rows, N, q, P]: the weights over the source

``Le`` and ``Ne`` are the encoder's layers and heads. genjax's padding of the source (right, to
its bucket) is removed; every position matches transformers', the source's own padding
included (its queries still see the real tokens).

Memory: the program keeps, besides the prefill's ``(L + 1) * rows * P * D`` hidden values and
``L * rows * N * P * P`` attention weights, buffers for all ``N - 1`` later steps:
``(N - 1) * (L + 1) * rows * D`` hidden values and ``(N - 1) * L * rows * N * S`` attention
weights (``S`` = the bucket length plus ``N``), in the model dtype. Attentions dominate: with
32 layers, 32 heads, 8 rows and ``S = 2048`` they take 64 MiB of float32 per step, 64 GiB for
1024 new tokens. On a mesh (:mod:`genjax.sharding`) these buffers and the prefill's records
keep their rows on ``batch``, so each device holds and writes its own rows' share; the values
equal one device's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from genjax.errors import InputError
from genjax.typing import Array


@struct.dataclass
class GenerateOutput:
    """The result of :func:`genjax.generate`.

    R is ``num_return_sequences`` and M ``num_beams``; rows of one prompt are adjacent (row
    ``b * R + r``, and ``b * M + m`` for beam search's ``scores`` and ``logits``).
    """

    sequences: Array  # int32[B*R, P+N]: the prompt as given, then new tokens
    scores: Array | None = None  # float32[B*R, N, V] processed scores (beams: [B*M, N, V])
    logits: Array | None = None  # float32[B*R, N, V] raw logits (beams: [B*M, N, V])
    sequences_scores: Array | None = None  # float32[B*R]: beam search only
    beam_indices: Array | None = None  # int32[B*R, N]: beam search only; rows of `scores`
    # int32[B]: assisted generation only; candidate tokens accepted and committed per row
    # (divide by the new tokens for the acceptance rate).
    num_accepted_tokens: Array | None = None
    # bool[]: whether every logit of the first step was finite; set by the compiled program and
    # checked by ``generate`` on the host (which raises for NaN/Inf and returns None here).
    first_logits_finite: Array | None = None
    # output_hidden_states: N tuples (one per new token) of L+1 arrays dtype[rows, q, D]; q = P
    # at the first, 1 after (see the module docstring). Inside the program a ForwardRecord.
    hidden_states: tuple | ForwardRecord | None = None
    # output_attentions: N tuples of L arrays dtype[rows, N, q, k], k = P + t keys at step t.
    attentions: tuple | ForwardRecord | None = None
    # Encoder-decoder models instead (see the module docstring), as transformers names them.
    # Le+1 arrays dtype[B, P, D]; inside the program dtype[Le+1, B, W, D] (W: the source bucket)
    encoder_hidden_states: tuple | Array | None = None
    encoder_attentions: tuple | Array | None = None  # Le arrays dtype[B, Ne, P, P]
    decoder_hidden_states: tuple | ForwardRecord | None = None  # N tuples of L+1 [rows, q, D]
    decoder_attentions: tuple | ForwardRecord | None = None  # N tuples of L [rows, N, q, Pd+t]
    cross_attentions: tuple | ForwardRecord | None = None  # N tuples of L [rows, N, q, P]


@struct.dataclass
class ForwardRecord:
    """One forward output (hidden states or attentions) of every model call of a generate
    program, as the program records it; :func:`per_token` lays it out as transformers does.

    Axes: ``X`` is the output's per-call layer axis (``L + 1`` hidden states, ``L``
    attentions), ``W`` the program's prompt width (bucket padding included), ``S = W + N``.
    """

    # The prefill: hidden states dtype[L+1, rows, W, D], attentions dtype[L, rows, N, W, W]
    prefill: Array
    # The N - 1 decoding calls: dtype[N-1, L+1, rows, 1, D], attentions [N-1, L, rows, N, 1, S]
    steps: Array


def per_token(
    record: ForwardRecord, offset: int, windows: Sequence[int | None] = ()
) -> tuple[tuple[Array, ...], ...]:
    """Transformers' layout of a :class:`ForwardRecord`: one tuple per new token, each over the
    layer axis, without genjax's ``offset`` bucket padding slots (see the module docstring).

    Args:
        record: the program's record.
        offset: ``o``, the padding slots before the prompt (host int).
        windows: per layer the sliding window of attention weights (``W`` keeps the last
            ``min(k, W)`` keys of steps after the prefill), or None; empty for none. Hidden
            states take none.

    Example:
        >>> record = ForwardRecord(prefill=jnp.zeros((3, 2, 16, 8)),
        ...                        steps=jnp.zeros((4, 3, 2, 1, 8)))
        >>> hidden = per_token(record, offset=11)  # a 5-token prompt padded to 16 slots
        >>> len(hidden), len(hidden[0]), hidden[0][0].shape, hidden[1][0].shape
        (5, 3, (2, 5, 8), (2, 1, 8))
    """
    attentions = record.prefill.ndim == 5
    if attentions:  # an encoder-decoder prefill reads the prompt's slots of S: keys past W go
        width = record.prefill.shape[3]
        first = tuple(layer[..., offset:, offset:width] for layer in _layers(record.prefill))
    else:
        first = tuple(layer[:, offset:] for layer in _layers(record.prefill))
    prompt_length = record.prefill.shape[2 + attentions] - offset
    later = []
    for step, layers in enumerate(_layers(record.steps)):
        layers = _layers(layers)
        if attentions:  # k = P + t keys; a sliding-window layer keeps its last W
            keys = prompt_length + step + 1
            layers = [
                layer[..., offset + keys - min(keys, window or keys) : offset + keys]
                for layer, window in zip(layers, _per_layer(windows, len(layers)), strict=True)
            ]
        later.append(tuple(layers))
    return (first, *later)


def over_source(record: ForwardRecord, source_length: int) -> tuple[tuple[Array, ...], ...]:
    """Transformers' layout of recorded cross-attention weights: one tuple per new token, each
    over the layers, keeping the first ``source_length`` keys (host int ``P``) of genjax's
    source bucket.

    Example:
        >>> record = ForwardRecord(prefill=jnp.zeros((2, 3, 4, 1, 16)),
        ...                        steps=jnp.zeros((5, 2, 3, 4, 1, 16)))
        >>> weights = over_source(record, 9)
        >>> len(weights), len(weights[0]), weights[0][0].shape
        (6, 2, (3, 4, 1, 9))
    """
    first = tuple(layer[..., :source_length] for layer in _layers(record.prefill))
    later = [
        tuple(layer[..., :source_length] for layer in _layers(step))
        for step in _layers(record.steps)
    ]
    return (first, *later)


def lay_out(out: GenerateOutput, offset: int, windows=(), source_length=None) -> GenerateOutput:
    """``out`` with every recorded forward output in transformers' layout: :func:`per_token`
    (``offset``, ``windows``) for the per-token ones, :func:`over_source` for
    ``cross_attentions``, the encoder's cut to the first ``source_length`` positions (an
    encoder-decoder model's ``P``; host int). Fields that are None or already tuples (laid
    out, or passed through) stay as they are."""
    changes = {}
    for name in ("hidden_states", "decoder_hidden_states"):
        if isinstance(getattr(out, name), ForwardRecord):
            changes[name] = per_token(getattr(out, name), offset)
    for name in ("attentions", "decoder_attentions"):
        if isinstance(getattr(out, name), ForwardRecord):
            changes[name] = per_token(getattr(out, name), offset, windows)
    if isinstance(out.cross_attentions, ForwardRecord):
        changes["cross_attentions"] = over_source(out.cross_attentions, source_length)
    if _stacked(out.encoder_hidden_states):  # [Le+1, B, W, D]
        changes["encoder_hidden_states"] = tuple(
            layer[:, :source_length] for layer in _layers(out.encoder_hidden_states)
        )
    if _stacked(out.encoder_attentions):  # [Le, B, Ne, W, W]
        changes["encoder_attentions"] = tuple(
            layer[..., :source_length, :source_length] for layer in _layers(out.encoder_attentions)
        )
    return out.replace(**changes) if changes else out


def _layers(stacked: Array) -> tuple[Array, ...]:
    """The arrays along the leading axis of a stacked record. A sharded array is split by one
    jitted program, so the pieces keep its sharding: iterating it copies it through the host
    onto one device."""
    sharding = getattr(stacked, "sharding", None)  # a tracer or numpy array has none
    if sharding is None or len(sharding.device_set) == 1 or stacked.is_fully_replicated:
        return tuple(stacked)
    return _split(stacked)


@jax.jit
def _split(stacked: Array) -> tuple[Array, ...]:
    return tuple(stacked[i] for i in range(stacked.shape[0]))


def _stacked(value) -> bool:
    """Whether an encoder output is still the program's stacked array (not None, not a
    tuple)."""
    return value is not None and not isinstance(value, (tuple, list))


def _per_layer(windows: Sequence[int | None], layers: int) -> Sequence[int | None]:
    return tuple(windows) if windows else (None,) * layers


def compute_transition_scores(
    sequences: Array,
    scores: Array | Sequence[Array],
    beam_indices: Array | None = None,
    normalize_logits: bool = False,
) -> Array:
    """Returns the score of each generated token, as transformers' method of the same name.

    For beam search, ``scores[:, t]`` holds one row per running beam (``B*M`` rows) and
    ``beam_indices[r, t]`` names the row that produced token ``t`` of sequence ``r``, so the
    transition score is ``scores[beam_indices[r, t], t, token]``. Summed over a sequence and divided
    by ``length ** length_penalty`` (``length`` = the non-negative entries of its
    ``beam_indices`` row, its generated tokens including EOS) it gives ``sequences_scores``, when
    ``normalize_logits=False`` (the processed scores already are log-probabilities).

    Args:
        sequences: int32[B*R, P+n], as returned by ``generate`` (or by transformers).
        scores: float32[rows, N, V], the processed scores (or raw logits) of each step; or a
            sequence of float32[rows, V], one per step, as transformers returns them. ``rows`` is
            ``B*R`` without beams and ``B*M`` with them.
        beam_indices: int32[B*R, n] (``n <= N``): the row of ``scores`` each step's token came
            from, -1 after the sequence ended; None for greedy and sampling (then row ``r`` of
            ``scores`` belongs to sequence ``r`` and ``n = N``).
        normalize_logits: apply ``log_softmax`` over V to each step first.

    Returns:
        float32[B*R, n]: the score of each of the last ``n`` tokens of ``sequences``; 0 where
        ``beam_indices`` is -1. (transformers cuts the result to the longest sequence; genjax
        keeps ``n`` columns, the extra ones 0.)

    Example:
        >>> beams = config.replace(num_beams=4, output_scores=True)
        >>> out = genjax.generate(model, params, ids, beams, attention_mask=mask)
        >>> steps = genjax.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
        >>> length = (out.beam_indices >= 0).sum(-1)
        >>> np.allclose(steps.sum(-1) / length, out.sequences_scores)  # length_penalty 1.0
        True

    References:
        Hugging Face transformers v5, ``GenerationMixin.compute_transition_scores``.
    """
    if isinstance(scores, (list, tuple)):
        scores = jnp.stack([jnp.asarray(step) for step in scores], axis=1)
    scores = jnp.asarray(scores, jnp.float32)
    sequences = jnp.asarray(sequences)
    if scores.ndim != 3 or sequences.ndim != 2:
        raise ValueError(
            f"compute_transition_scores expects sequences int[rows, length] and scores "
            f"float[rows, steps, vocab]; got shapes {sequences.shape} and {scores.shape}."
        )
    if beam_indices is None:
        rows, steps = scores.shape[:2]
        beam_indices = jnp.broadcast_to(jnp.arange(rows)[:, None], (rows, steps))
    beam_indices = jnp.asarray(beam_indices)
    steps = beam_indices.shape[1]
    if steps > scores.shape[1] or steps > sequences.shape[1]:
        raise ValueError(
            f"beam_indices covers {steps} steps, but scores holds {scores.shape[1]} and sequences "
            f"{sequences.shape[1]} tokens. Pass the outputs of one generate call."
        )
    return _transition_scores(sequences, scores, beam_indices, normalize_logits)


@functools.partial(jax.jit, static_argnames="normalize_logits")
def _transition_scores(sequences, scores, beam_indices, normalize_logits):
    if normalize_logits:
        scores = jax.nn.log_softmax(scores, axis=-1)
    steps = beam_indices.shape[1]
    unused = beam_indices < 0
    rows = jnp.where(unused, 0, beam_indices)
    new_tokens = sequences[:, sequences.shape[1] - steps :]
    picked = scores[rows, jnp.arange(steps)[None, :], new_tokens]
    return jnp.where(unused, 0.0, picked)


def check_finite(out: GenerateOutput) -> GenerateOutput:
    """``out`` without its ``first_logits_finite`` flag, after raising if the flag is False.

    Called with concrete arrays, it reads the flag: the host waits for the compiled program to
    finish (``generate`` then returns ready arrays rather than dispatching asynchronously) and
    the program pays one ``isfinite`` reduction over the first step's ``[B, V]`` logits.
    Inside a user's ``jax.jit`` (the flag is a tracer) nothing is checked.

    Raises:
        InputError: the model's first-step logits hold NaN or Inf (broken or overflowing
            weights), so every token generated would be meaningless.
    """
    flag = out.first_logits_finite
    out = out.replace(first_logits_finite=None)
    if flag is None or isinstance(flag, jax.core.Tracer):
        return out
    if not bool(flag):
        raise InputError(
            "the model's logits for the first new token hold NaN or Inf: the weights (or the "
            "activations, e.g. float16 overflow) are not finite, so every generated token "
            "would be meaningless. Check the checkpoint with jax.tree.map(lambda x: "
            "bool(jnp.isfinite(x).all()), params), or load it in float32 (dtype='float32')."
        )
    return out
