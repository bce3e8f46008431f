"""The shared decoder core of the rotary architectures: one flax module tree, switched by config.

Every rotary architecture genjax supports (Llama, Mistral, Qwen2/3, OLMo 2, Phi-3, Gemma 2/3) is
this decoder with a :class:`~genjax.models.llama.LlamaConfig`; the per-architecture modules only
read ``config.json`` into that config. The options, each a static config field:

==========================  ===============================================================
``qkv_bias``/``o_bias``     projection biases (Qwen2; Llama's ``attention_bias``)
``fused_projections``       one ``qkv_proj`` and one ``gate_up_proj`` matrix (Phi-3), split
                            in the layer: ``[q | k | v]`` and ``[gate | up]`` along outputs
``qk_norm``                 RMSNorm of queries and keys before rope: ``"head"`` over each
                            head's ``H`` features (Qwen3, Gemma 3), ``"projection"`` over the
                            whole ``N*H`` / ``K*H`` projection (OLMo 2)
``norm_layout``             ``"pre"`` (Llama), ``"post"`` (OLMo 2: norms on the attention and
                            MLP outputs, before the residual add), ``"sandwich"`` (Gemma: both)
``norm_offset``             ``1.0``: norms scale by ``1 + w`` (Gemma)
``norm_upcast``             norms multiply their scale in float32 (OLMo 2, Gemma)
``embed_scale``             embeddings times ``sqrt(D)`` rounded to the model dtype (Gemma)
``attention_scale``         the score multiplier (Gemma: ``query_pre_attn_scalar ** -0.5``)
``attn_softcap``            ``c * tanh(scores / c)`` before the mask (Gemma 2)
``final_softcap``           the same on the logits (Gemma 2/3)
``sliding_windows``         per layer window or None (Mistral, Qwen2/3, Phi-3, Gemma 2/3);
                            masked in the full layout, or read from a ring of ``W`` cache
                            slots (``ring_cache``, :mod:`genjax.cache.ring`)
``local_rope``              rope settings of the sliding layers (Gemma 3's local base)
==========================  ===============================================================

Parameter tree (HF name = path joined by dots, ``kernel``/``scale``/``embedding`` -> ``weight``,
prefix ``model.`` except ``lm_head``; every ``kernel`` is the HF weight as stored, [out, in])::

    embed_tokens/embedding                       [V, D]
    layers/<i>/input_layernorm/scale             [D]        ("pre", "sandwich")
    layers/<i>/self_attn/q_proj/kernel           [N*H, D]   (+ bias [N*H])
    layers/<i>/self_attn/k_proj/kernel           [K*H, D]   (+ bias [K*H])
    layers/<i>/self_attn/v_proj/kernel           [K*H, D]   (+ bias [K*H])
    layers/<i>/self_attn/qkv_proj/kernel         [(N+2K)*H, D]  (instead, fused_projections)
    layers/<i>/self_attn/q_norm/scale            [H] or [N*H]   (qk_norm)
    layers/<i>/self_attn/k_norm/scale            [H] or [K*H]   (qk_norm)
    layers/<i>/self_attn/o_proj/kernel           [D, N*H]   (+ bias [D])
    layers/<i>/post_attention_layernorm/scale    [D]
    layers/<i>/pre_feedforward_layernorm/scale   [D]        ("sandwich")
    layers/<i>/post_feedforward_layernorm/scale  [D]        ("post", "sandwich")
    layers/<i>/mlp/gate_proj/kernel              [F, D]     (+ bias [F])
    layers/<i>/mlp/up_proj/kernel                [F, D]     (+ bias [F])
    layers/<i>/mlp/gate_up_proj/kernel           [2F, D]    (instead, fused_projections)
    layers/<i>/mlp/down_proj/kernel              [D, F]     (+ bias [D])
    norm/scale                                   [D]
    lm_head/kernel                               [V, D]     (absent when tie_word_embeddings)

In the ``"pre"`` layout ``post_attention_layernorm`` is the norm before the MLP (its HF name);
in the others it normalizes the attention output.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from genjax.cache import KVCache, attention_bias, ring_bias, ring_to_slots
from genjax.models.attention import attention
from genjax.models.layers import (
    ACTIVATIONS,
    Embed,
    RMSNorm,
    dense,
    forward_outputs,
    keep_positions,
)
from genjax.models.rope import apply_rope, rope_cos_sin

NORM_LAYOUTS = ("pre", "post", "sandwich")
QK_NORMS = (None, "head", "projection")


def _norm(config: Any, name: str) -> RMSNorm:
    return RMSNorm(
        config.rms_norm_eps,
        jnp.dtype(config.dtype),
        offset=config.norm_offset,
        upcast_scale=config.norm_upcast,
        name=name,
    )


def _soft_cap(x, cap: float | None):
    """``cap * tanh(x / cap)`` in ``x``'s dtype; ``x`` when ``cap`` is None."""
    if cap is None:
        return x
    cap = jnp.asarray(cap, x.dtype)
    return jnp.tanh(x / cap) * cap


class _Attention(nn.Module):
    config: Any
    layer: int

    @nn.compact
    def __call__(self, x, cos, sin, bias, cache: KVCache, output_attentions: bool = False):
        c, dtype = self.config, jnp.dtype(self.config.dtype)
        batch, length, _ = x.shape
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if c.fused_projections:
            qkv = dense(q_width + 2 * kv_width, c.qkv_bias, dtype, "qkv_proj")(x)
            q, k, v = jnp.split(qkv, [q_width, q_width + kv_width], axis=-1)
        else:
            q = dense(q_width, c.qkv_bias, dtype, "q_proj")(x)
            k = dense(kv_width, c.qkv_bias, dtype, "k_proj")(x)
            v = dense(kv_width, c.qkv_bias, dtype, "v_proj")(x)
        if c.qk_norm == "projection":
            q, k = _norm(c, "q_norm")(q), _norm(c, "k_norm")(k)
        q = q.reshape(batch, length, c.num_heads, c.head_dim)
        k = k.reshape(batch, length, c.num_kv_heads, c.head_dim)
        v = v.reshape(batch, length, c.num_kv_heads, c.head_dim)
        if c.qk_norm == "head":
            q, k = _norm(c, "q_norm")(q), _norm(c, "k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values, cache = cache.update_layer(self.layer, k, v)
        scale = c.head_dim**-0.5 if c.attention_scale is None else c.attention_scale
        out = attention(
            q, keys, values, bias, scale, softcap=c.attn_softcap, return_weights=output_attentions
        )
        weights = None
        if output_attentions:  # [B, N, T, S]: over the logical slots, rings laid out in full
            out, weights = out
            ring = _ring_slots(cache, self.layer)
            if ring is not None:
                weights = ring_to_slots(weights, cache.index, ring, cache.length)
        return dense(c.hidden_size, c.o_bias, dtype, "o_proj")(out), cache, weights


class _MLP(nn.Module):
    config: Any

    @nn.compact
    def __call__(self, x):
        c, dtype = self.config, jnp.dtype(self.config.dtype)
        if c.fused_projections:
            fused = dense(2 * c.intermediate_size, c.mlp_bias, dtype, "gate_up_proj")(x)
            gate, up = jnp.split(fused, 2, axis=-1)
        else:
            gate = dense(c.intermediate_size, c.mlp_bias, dtype, "gate_proj")(x)
            up = dense(c.intermediate_size, c.mlp_bias, dtype, "up_proj")(x)
        return dense(c.hidden_size, c.mlp_bias, dtype, "down_proj")(
            ACTIVATIONS[c.hidden_act](gate) * up
        )


class _DecoderLayer(nn.Module):
    config: Any
    layer: int

    @nn.compact
    def __call__(self, x, cos, sin, bias, cache, output_attentions: bool = False):
        """``(x, cache, weights)``; ``weights`` (the attention's) is None unless asked for."""
        c = self.config
        attend = _Attention(c, self.layer, name="self_attn")
        mlp = _MLP(c, name="mlp")
        if c.norm_layout == "pre":
            h, cache, weights = attend(
                _norm(c, "input_layernorm")(x), cos, sin, bias, cache, output_attentions
            )
            x = x + h
            return x + mlp(_norm(c, "post_attention_layernorm")(x)), cache, weights
        if c.norm_layout == "sandwich":
            h, cache, weights = attend(
                _norm(c, "input_layernorm")(x), cos, sin, bias, cache, output_attentions
            )
            x = x + _norm(c, "post_attention_layernorm")(h)
            h = mlp(_norm(c, "pre_feedforward_layernorm")(x))
            return x + _norm(c, "post_feedforward_layernorm")(h), cache, weights
        h, cache, weights = attend(x, cos, sin, bias, cache, output_attentions)  # "post"
        x = x + _norm(c, "post_attention_layernorm")(h)
        return x + _norm(c, "post_feedforward_layernorm")(mlp(x)), cache, weights


class _Layers(nn.Module):
    config: Any

    @nn.compact
    def __call__(self, x, tables, biases, cache, output_attentions: bool = False):
        """``(x, cache, inputs, weights)``: the last layer's output, the cache, each layer's
        input (the embeddings first) and each layer's attention weights (None unless asked
        for). Values nobody reads cost nothing: XLA drops them."""
        c = self.config
        inputs, weights = [], []
        for i, window in enumerate(c.sliding_windows):
            local = window is not None and c.local_rope is not None
            cos, sin = tables["local" if local else "global"]
            bias = biases[window, _ring_slots(cache, i)]
            inputs.append(x)
            layer = _DecoderLayer(c, i, name=str(i))
            x, cache, layer_weights = layer(x, cos, sin, bias, cache, output_attentions)
            weights.append(layer_weights)
        return x, cache, inputs, weights


def _ring_slots(cache, layer: int) -> int | None:
    """The ring size of ``layer``'s cache block, or None (full layout, or a cache without
    rings); static. See :mod:`genjax.cache.ring`."""
    ring_slots = getattr(cache, "ring_slots", None)
    return None if ring_slots is None else ring_slots(layer)


def _biases(config, attention_mask, cache, length: int) -> dict:
    """The attention bias of each (window, ring size) the layers have, built once per call."""
    kinds = {(w, _ring_slots(cache, i)) for i, w in enumerate(config.sliding_windows)}
    return {
        (window, ring): (
            attention_bias(attention_mask, cache.index, length, jnp.float32, window)
            if ring is None
            else ring_bias(attention_mask, cache.index, length, window, ring)
        )
        for window, ring in kinds
    }


class DecoderLM(nn.Module):
    """The causal LM of the shared core: embed, the layers, the final norm, the output head.

    ``__call__(tokens, positions, cache, attention_mask, logits_to_keep, output_hidden_states,
    output_attentions)`` follows the model protocol of :mod:`genjax.models` and returns
    ``(float32[B, T or k, V] logits, cache)``, plus the dict of :func:`forward_outputs` when an
    ``output_*`` flag (static) is set.
    """

    config: Any

    @nn.compact
    def __call__(
        self,
        tokens,
        positions,
        cache,
        attention_mask,
        logits_to_keep=0,
        output_hidden_states=False,
        output_attentions=False,
    ):
        c, dtype = self.config, jnp.dtype(self.config.dtype)
        length = tokens.shape[1]
        embed = Embed(c.vocab_size, c.hidden_size, dtype, name="embed_tokens")
        x = embed(tokens)
        if c.embed_scale:  # sqrt(D) rounded to the model dtype, as transformers' Gemma
            x = x * jnp.asarray(np.float32(math.sqrt(c.hidden_size)), dtype)
        tables = {"global": rope_cos_sin(c.rope, positions, dtype)}
        if c.local_rope is not None:
            tables["local"] = rope_cos_sin(c.local_rope, positions, dtype)
        biases = _biases(c, attention_mask, cache, length)
        x, cache, hidden, weights = _Layers(c, name="layers")(
            x, tables, biases, cache, output_attentions
        )
        norm = _norm(c, "norm")
        if output_hidden_states:  # the last hidden state is the final norm's output
            x = norm(x)
            hidden.append(x)
        x = keep_positions(x, logits_to_keep)  # a prefill needs one position's logits
        if not output_hidden_states:
            x = norm(x)
        if c.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = dense(c.vocab_size, False, dtype, "lm_head")(x)
        logits = _soft_cap(logits, c.final_softcap)
        result = (logits.astype(jnp.float32), cache.advance(length))
        outputs = forward_outputs(
            hidden if output_hidden_states else None, weights if output_attentions else None
        )
        return (*result, outputs) if outputs else result
