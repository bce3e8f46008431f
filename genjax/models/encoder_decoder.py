"""The encoder-decoder model protocol, and the pieces T5, BART and Marian share.

The encoder-decoder protocol
----------------------------
Beside the decoder-only protocol (:mod:`genjax.models`), an encoder-decoder model (its
``is_encoder_decoder`` is True) has three pure steps, the model static and everything else
traced:

* ``encode(params, input_ids, attention_mask) -> encoder_states`` float[B, Se, D]: the encoder
  over left-padded source ids int[B, Se] and their mask int[B, Se] (nonzero for real tokens).
  Positions are slot indices ``0 .. Se - 1`` whatever the padding, as transformers computes them
  for these models; padding is hidden from attention by the mask alone.
* ``init_cache(batch, max_length, encoder_states, encoder_mask, params, dtype=None)
  -> EncoderDecoderCache``: an empty decoder cache of ``max_length`` slots (static) for
  ``batch`` decoder rows (static), holding every layer's cross-attention keys and values, which
  are computed here, once, from ``encoder_states``, with ``encoder_mask`` beside them.
  ``batch`` may be a multiple ``R`` of the encoder batch: decoder row ``b`` then reads prompt
  ``b // R`` (the cache's ``rows_per_prompt``; see :mod:`genjax.cache.encoder_decoder`), so
  beams and ``num_return_sequences`` never copy the encoder states per row.
* ``apply(params, tokens, positions, cache, attention_mask, logits_to_keep=0)
  -> (logits, cache)``: the decoder, with the shape contract of a decoder-only model's ``apply``
  (``tokens`` int32[B, T] written at ``cache.index``, ``attention_mask`` int[B, S] over the
  decoder slots, float32[B, T or k, V] logits), so the decoding loops drive it unchanged. The
  decoder's positions are its slot indices (``cache.index + t``), as in transformers, whose
  encoder-decoder decoders take no position ids; ``positions`` is accepted for the shared
  signature and ignored. Decoder inputs start with ``decoder_start_token_id`` and are not
  padded in ``generate``.

A full teacher-forced forward pass is ``apply`` on a fresh ``init_cache(B, T, ...)``; decoding
is ``apply`` with ``T = 1`` repeatedly, and equals it.

``encode`` and ``apply`` take the keywords ``output_hidden_states`` and ``output_attentions``
(static; both False: the program without them). With one set they return a dict of the stack's
extra outputs last, in transformers' layout stacked over the layers (:class:`Recorder`)::

    encode  -> (states, {"encoder_hidden_states": dtype[Le+1, B, Se, D],
                         "encoder_attentions":    dtype[Le, B, Ne, Se, Se]})
    apply   -> (logits, cache, {"decoder_hidden_states": dtype[L+1, B, T, D],
                                "decoder_attentions":    dtype[L, B, N, T, S],
                                "cross_attentions":      dtype[L, B, N, T, Se]})

each entry present when its flag is set. Hidden states are the embeddings, the output of each
layer but the last, then the stack's last output after its final norm (T5, mBART; BART and
Marian have none), as transformers returns them; attentions are the softmax weights, 0 on
masked keys (the decoder's over all ``S`` cache slots, later ones masked). ``Le`` and ``Ne``
are the encoder's layers and heads.

The models also carry ``decoder_start_token_id`` (from ``config.json``, None when it has none:
``GenerationConfig`` then supplies it), ``vocab_size``, ``hidden_size`` (``D``), ``num_layers``
(decoder layers),
``dtype`` and ``max_position_embeddings``.

Example::

    model, params = genjax.models.from_pretrained("google-t5/t5-small")
    states = model.encode(params, src_ids, src_mask)                     # [B, Se, D]
    cache = model.init_cache(B, 16, states, src_mask, params)
    start = jnp.full((B, 1), model.decoder_start_token_id)
    mask = jnp.ones((B, 16), jnp.int32)
    logits, cache = model.apply(params, start, jnp.zeros((B, 1), jnp.int32), cache, mask)

Parameters are plain nested dicts whose paths are the HF state-dict names split at the dots,
with the leaf renamed as elsewhere (``weight`` -> ``kernel`` for linear layers, ``scale`` for
norms, ``embedding`` for tables); linear kernels are [out, in], as HF stores them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from genjax.cache import (
    EncoderDecoderCache,
    KVCache,
    fold_rows,
    heads_first,
    slots_last,
    unfold_rows,
)
from genjax.errors import InputError
from genjax.models.attention import attention
from genjax.models.base import ModelBase, _check_inputs
from genjax.models.layers import linear, take_rows
from genjax.typing import Array, PyTree

_LEAF_TO_HF = {"kernel": "weight", "scale": "weight", "embedding": "weight"}


class EncoderDecoderBase(ModelBase):
    """Mixin for an encoder-decoder model: a frozen dataclass with a ``config`` field.

    Subclasses define ``_shapes()`` ({param path: shape}), ``_encode``, ``_cross_kv`` (one
    layer's cross keys and values, each float[B, Se, K, H]) and ``_decode``, plus
    ``num_kv_heads``, ``head_dim``, ``num_layers`` and ``decoder_start_token_id``. ``_encode``
    and ``_decode`` get a :class:`Recorder` and hand it each layer's input and weights.
    """

    is_encoder_decoder = True

    def _shapes(self) -> dict[tuple[str, ...], tuple[int, ...]]:
        raise NotImplementedError

    def _encode(self, params: PyTree, input_ids: Array, attention_mask: Array, record) -> Array:
        raise NotImplementedError

    def _cross_kv(self, params: PyTree, layer: int, states: Array) -> tuple[Array, Array]:
        raise NotImplementedError

    def _decode(self, params, tokens, cache, attention_mask, logits_to_keep, record):
        raise NotImplementedError

    def _hf_transposed(self, path: tuple[str, ...]) -> bool:
        return False  # nn.Linear weights are [out, in] already

    @property
    def hidden_size(self) -> int:
        """``D``, the width of the encoder states and of the decoder (``d_model``)."""
        return self.config.hidden_size

    def encode(
        self,
        params: PyTree,
        input_ids: Array,
        attention_mask: Array | None = None,
        *,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ):
        """Runs the encoder; pure, jittable with the model static.

        Args:
            params: the parameter tree.
            input_ids: int[B, Se] source ids, left-padded.
            attention_mask: int or bool[B, Se], nonzero for real tokens; None means all real.
            output_hidden_states: static; also return every layer's hidden states.
            output_attentions: static; also return every layer's attention weights.

        Returns:
            float[B, Se, D] encoder states, in the model dtype; with an ``output_*`` flag,
            ``(states, outputs)``: ``"encoder_hidden_states"`` dtype[Le+1, B, Se, D] and
            ``"encoder_attentions"`` dtype[Le, B, Ne, Se, Se] (see the module docstring).

        Example:
            >>> states = model.encode(params, ids, mask)  # doctest: +SKIP
        """
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise InputError(
                f"input_ids must be int[B, Se], got {input_ids.dtype}{list(input_ids.shape)}."
            )
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        attention_mask = jnp.asarray(attention_mask)
        if attention_mask.shape != input_ids.shape:
            raise InputError(
                f"attention_mask must match input_ids {tuple(input_ids.shape)}, got shape "
                f"{tuple(attention_mask.shape)}."
            )
        record = Recorder("encoder", output_hidden_states, output_attentions)
        states = self._encode(params, input_ids, attention_mask, record)
        return (states, record.outputs()) if record.active else states

    def init_cache(
        self,
        batch: int,
        max_length: int,
        encoder_states: Array,
        encoder_mask: Array,
        params: PyTree,
        dtype: jnp.dtype | None = None,
    ) -> EncoderDecoderCache:
        """An empty decoder cache with every layer's cross-attention keys and values.

        Args:
            batch: ``B`` (static), the decoder rows: the encoder batch times ``R``, the rows
                per prompt (1, or beams x return sequences); row ``b`` reads prompt ``b // R``.
            max_length: ``S`` (static), the decoder slots.
            encoder_states: float[B / R, Se, D], from :meth:`encode`.
            encoder_mask: int or bool[B / R, Se], the source mask given to :meth:`encode`.
            params: the parameter tree (the cross projections are applied here, once).
            dtype: the key/value dtype; None means the model dtype.

        Example:
            >>> cache = model.init_cache(2, 16, states, mask, params)  # doctest: +SKIP
        """
        prompts, source_length = encoder_states.shape[:2]
        if encoder_states.ndim != 3 or batch % prompts:
            raise InputError(
                f"encoder_states must be float[B / R, Se, D] with {batch} decoder rows a "
                f"multiple of its batch; got shape {tuple(encoder_states.shape)}."
            )
        if tuple(encoder_mask.shape) != (prompts, source_length):
            raise InputError(
                f"encoder_mask must be [B / R, Se] = {(prompts, source_length)}, got shape "
                f"{tuple(encoder_mask.shape)}."
            )
        dtype = self.dtype if dtype is None else jnp.dtype(dtype)
        self_cache = KVCache.create(
            self.num_layers, batch, max_length, self.num_kv_heads, self.head_dim, dtype
        )
        keys, values = [], []
        for layer in range(self.num_layers):
            k, v = self._cross_kv(params, layer, encoder_states)
            keys.append(slots_last(k).astype(dtype))
            values.append(heads_first(v).astype(dtype))
        return EncoderDecoderCache(
            self_attention=self_cache,
            cross_keys=tuple(keys),
            cross_values=tuple(values),
            encoder_mask=jnp.asarray(encoder_mask).astype(jnp.int32),
            rows_per_prompt=batch // prompts,
        )

    def apply(
        self,
        params: PyTree,
        tokens: Array,
        positions: Array,
        cache: EncoderDecoderCache,
        attention_mask: Array,
        logits_to_keep: int = 0,
        *,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> tuple[Array, EncoderDecoderCache] | tuple[Array, EncoderDecoderCache, dict]:
        """Runs the decoder on ``T`` tokens written at ``cache.index`` (see the module docstring).

        Args:
            params: the parameter tree.
            tokens: int32[B, T] decoder ids.
            positions: int32[B, T]; ignored (decoder positions are slot indices).
            cache: from :meth:`init_cache`.
            attention_mask: int or bool[B, S] over the decoder slots.
            logits_to_keep: static; 0 for every position, ``k > 0`` for the last ``k``.
            output_hidden_states: static; also return every layer's hidden states (of all
                ``T`` positions, whatever ``logits_to_keep``).
            output_attentions: static; also return the self- and cross-attention weights.

        Returns:
            ``(logits, cache)``: float32[B, T or k, V] and the cache advanced by ``T``; with an
            ``output_*`` flag, ``(logits, cache, outputs)``: ``"decoder_hidden_states"``
            dtype[L+1, B, T, D], ``"decoder_attentions"`` dtype[L, B, N, T, S] and
            ``"cross_attentions"`` dtype[L, B, N, T, Se] (see the module docstring).

        Example:
            >>> logits, cache = model.apply(params, ids, pos, cache, mask)  # doctest: +SKIP
        """
        _check_inputs(tokens, positions, cache, attention_mask)
        if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise InputError(
                f"logits_to_keep must be an int >= 0 (0: every position), got {logits_to_keep!r}."
            )
        record = Recorder("decoder", output_hidden_states, output_attentions)
        logits, cache = self._decode(params, tokens, cache, attention_mask, logits_to_keep, record)
        logits, cache = logits.astype(jnp.float32), cache.advance(tokens.shape[1])
        return (logits, cache, record.outputs()) if record.active else (logits, cache)

    def param_shapes(self) -> PyTree:
        """The parameter tree as ``jax.ShapeDtypeStruct`` leaves (nothing allocated)."""
        tree: dict = {}
        for path, shape in self._shapes().items():
            _insert(tree, path, jax.ShapeDtypeStruct(shape, self.dtype))
        return tree

    def init_params(self, key: Array) -> PyTree:
        """Random parameters (normal kernels scaled by ``fan_in ** -0.5``, unit norms), for tests
        and benchmarks."""
        tree: dict = {}
        shapes = self._shapes()
        for i, (path, shape) in enumerate(shapes.items()):
            sub = jax.random.fold_in(key, i)
            if path[-1] == "scale":
                value = jnp.ones(shape)
            elif path[-1] == "bias" or path[-1] == "final_logits_bias":
                value = jnp.zeros(shape)
            else:
                value = jax.random.normal(sub, shape) * shape[-1] ** -0.5
            _insert(tree, path, value.astype(self.dtype))
        return tree

    def hf_tensor_name(self, path: tuple[str, ...]) -> tuple[str, bool]:
        """A parameter path's HF state-dict name and transpose flag (never transposed)."""
        return ".".join((*path[:-1], _LEAF_TO_HF.get(path[-1], path[-1]))), False


def _insert(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ------------------------------------------------------------------------------ shared pieces


def dense(p: Mapping[str, Array], x: Array, dtype: jnp.dtype) -> Array:
    """``x @ kernel.T (+ bias)`` for one linear layer's params (an int8 ``kernel`` with its
    ``kernel_scale`` too)."""
    y = linear(x, p["kernel"], p.get("kernel_scale"), dtype)
    return y + p["bias"].astype(dtype) if "bias" in p else y


def embed(p: Mapping[str, Array], ids: Array, dtype: jnp.dtype) -> Array:
    """Rows of ``p["embedding"]`` for int ids (clipped into range, so no NaN from a bad id)."""
    return take_rows(p["embedding"], ids).astype(dtype)


def rms_norm(p: Mapping[str, Array], x: Array, eps: float, dtype: jnp.dtype) -> Array:
    """T5's layer norm: no mean subtraction, no bias; the mean square in float32."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + eps)
    return p["scale"].astype(dtype) * normed.astype(dtype)


def layer_norm(p: Mapping[str, Array], x: Array, eps: float, dtype: jnp.dtype) -> Array:
    """Layer norm with bias (BART, Marian): statistics in float32."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, -1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (normed * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(dtype)


def heads(x: Array, num_heads: int) -> Array:
    """``[B, T, N * H]`` -> ``[B, T, N, H]``."""
    return x.reshape(*x.shape[:2], num_heads, x.shape[-1] // num_heads)


def mask_bias(mask: Array, query_length: int) -> Array:
    """float32[B, 1, T, Se]: the encoder's bidirectional bias, 0 on real source tokens."""
    allowed = jnp.broadcast_to(
        mask[:, None, None, :] != 0, (mask.shape[0], 1, query_length, mask.shape[1])
    )
    return jnp.where(allowed, 0.0, jnp.finfo(jnp.float32).min)


def full_attention(q: Array, k: Array, v: Array, bias: Array, scale: float, record=None):
    """Attention of queries dtype[B, T, N, H] over keys and values dtype[B, Se, N, H] (no cache),
    with ``bias`` float32[B, 1 or N, T, Se]; returns dtype[B, T, N * H]. The weights
    dtype[B, N, T, Se] go to ``record`` (a :class:`Recorder`) as ``encoder_attentions``."""
    return attend(q, slots_last(k), heads_first(v), bias, scale, record, "encoder_attentions")


def attend(q, keys, values, bias, scale: float, record, name: str) -> Array:
    """:func:`~genjax.models.attention.attention`, its weights handed to ``record`` (a
    :class:`Recorder`, or None) as ``name`` when it records attentions."""
    if record is None or not record.attentions:
        return attention(q, keys, values, bias, scale)
    out, weights = attention(q, keys, values, bias, scale, return_weights=True)
    record.weights(name, weights)
    return out


def cross_attention(q: Array, cache: EncoderDecoderCache, layer: int, scale: float, record=None):
    """The decoder's attention over a layer's cached cross keys and values.

    The ``R = rows_per_prompt`` rows of each prompt are folded into one block of ``R * T``
    queries over the prompt's cross entry (a reshape, no copy of the encoder states).

    Args:
        q: dtype[B, T, N, H].
        cache: the cache holding the cross blocks.
        layer: the decoder layer (a Python int).
        scale: the score multiplier (static).
        record: a :class:`Recorder` (or None): gets the weights dtype[B, N, T, Se] as
            ``cross_attentions``, unfolded to one row per decoder row.

    Returns:
        dtype[B, T, N * H].
    """
    rows = cache.rows_per_prompt
    folded = fold_rows(q, rows)  # [B / R, R * T, N, H]
    bias = jnp.broadcast_to(
        cache.cross_bias(), (cache.num_prompts, 1, folded.shape[1], cache.source_length)
    )
    keys, values = cache.cross_keys[layer], cache.cross_values[layer]
    if record is None or not record.attentions:
        return unfold_rows(attention(folded, keys, values, bias, scale), rows)
    out, weights = attention(folded, keys, values, bias, scale, return_weights=True)
    prompts, heads, _, source = weights.shape  # [B / R, N, R * T, Se] -> [B, N, T, Se]
    weights = weights.reshape(prompts, heads, rows, -1, source).transpose(0, 2, 1, 3, 4)
    record.weights("cross_attentions", weights.reshape(prompts * rows, heads, -1, source))
    return unfold_rows(out, rows)


class Recorder:
    """Collects one stack's hidden states and attention weights during one forward pass, for the
    ``output_hidden_states`` / ``output_attentions`` keywords (static flags; with both off it
    keeps nothing and the program is the one without it).

    The stack calls :meth:`layer_input` with each layer's input, :meth:`weights` with each
    layer's softmax weights and :meth:`last` with its final output (after the final norm);
    :meth:`outputs` stacks them over the layers.

    Example:
        >>> record = Recorder("decoder", hidden_states=True, attentions=False)
        >>> for layer in range(2):
        ...     record.layer_input(jnp.zeros((1, 3, 8)))
        >>> record.last(jnp.ones((1, 3, 8)))
        >>> {k: v.shape for k, v in record.outputs().items()}
        {'decoder_hidden_states': (3, 1, 3, 8)}
    """

    def __init__(self, stack: str, hidden_states: bool, attentions: bool):
        self.stack = stack  # "encoder" or "decoder": names the hidden states
        self.hidden_states = bool(hidden_states)
        self.attentions = bool(attentions)
        self._states: list[Array] = []
        self._weights: dict[str, list[Array]] = {}

    @property
    def active(self) -> bool:
        """Whether anything is recorded."""
        return self.hidden_states or self.attentions

    def layer_input(self, x: Array) -> None:
        """A layer's input dtype[B, T, D] (the first: the embeddings)."""
        if self.hidden_states:
            self._states.append(x)

    def last(self, x: Array) -> None:
        """The stack's output dtype[B, T, D] after its final norm, all ``T`` positions."""
        if self.hidden_states:
            self._states.append(x)

    def weights(self, name: str, weights: Array) -> None:
        """One layer's softmax weights dtype[B, N, T, K], kept under ``name``."""
        if self.attentions:
            self._weights.setdefault(name, []).append(weights)

    def outputs(self) -> dict[str, Array]:
        """``{f"{stack}_hidden_states": dtype[L+1, B, T, D]}`` and each kind of weights
        dtype[L, B, N, T, K], as recorded."""
        out = {}
        if self.hidden_states:
            out[f"{self.stack}_hidden_states"] = jnp.stack(self._states)
        for name, weights in self._weights.items():
            out[name] = jnp.stack(weights)
        return out


def slot_positions(cache: EncoderDecoderCache, length: int) -> Array:
    """int32[T]: the decoder slots ``index .. index + T - 1`` of the queries of this call."""
    return cache.index + jnp.arange(length, dtype=jnp.int32)


def sinusoidal_table(num_positions: int, dim: int) -> Array:
    """float32[P, D]: Marian's static position table (sines in the first half of each row,
    cosines in the second), computed in float64 then rounded, as transformers lays it out."""
    pos = np.arange(num_positions)[:, None]
    j = np.arange(dim)[None, :]
    enc = pos / np.power(10000, 2 * (j // 2) / dim)
    half = dim // 2 if dim % 2 == 0 else dim // 2 + 1
    table = np.empty((num_positions, dim), np.float32)
    table[:, :half] = np.sin(enc[:, 0::2])
    table[:, half:] = np.cos(enc[:, 1::2])
    return jnp.asarray(table)


def embed_scale(scale_embedding: bool, width: int) -> float:
    """``sqrt(D)`` when ``scale_embedding``, else 1."""
    return math.sqrt(width) if scale_embedding else 1.0
