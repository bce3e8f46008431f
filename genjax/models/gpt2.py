"""GPT-2: learned position embeddings, pre-norm LayerNorm blocks, fused q/k/v projection.

Parameter tree (HF name = path joined by dots, ``kernel``/``scale``/``embedding`` -> ``weight``,
prefix ``transformer.`` except ``lm_head``). Every ``kernel`` is [out, in] (see
``layers.Dense``): GPT-2's ``Conv1D`` weights, stored [in, out], are transposed at load and save;
an untied ``lm_head`` (an ``nn.Linear``) loads as it is::

    wte/embedding                 [V, D]
    wpe/embedding                 [P, D]      (P = n_positions, indexed by position ids)
    h/<i>/ln_1/{scale,bias}       [D]
    h/<i>/attn/c_attn/kernel      [3D, D]     (+ bias [3D]; q, k, v in that order)
    h/<i>/attn/c_proj/kernel      [D, D]      (+ bias [D])
    h/<i>/ln_2/{scale,bias}       [D]
    h/<i>/mlp/c_fc/kernel         [F, D]      (+ bias [F])
    h/<i>/mlp/c_proj/kernel       [D, F]      (+ bias [D])
    ln_f/{scale,bias}             [D]
    lm_head/kernel                [V, D]      (only when tie_word_embeddings is false)

config.json keys (besides ``_hf.IGNORED_KEYS``):

    handled   vocab_size n_positions n_embd n_layer n_head n_inner activation_function
              layer_norm_epsilon scale_attn_weights scale_attn_by_inverse_layer_idx
              reorder_and_upcast_attn tie_word_embeddings add_cross_attention (false only), and
              the aliases max_position_embeddings hidden_size num_hidden_layers
              num_attention_heads
    ignored   n_ctx (unused by transformers) resid_pdrop embd_pdrop attn_pdrop summary_type
              summary_use_proj summary_activation summary_proj_to_labels summary_first_dropout
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from genjax.cache import KVCache, attention_bias
from genjax.errors import CheckpointError
from genjax.models import _hf
from genjax.models.attention import attention
from genjax.models.base import ModelBase
from genjax.models.layers import (
    ACTIVATIONS,
    Embed,
    LayerNorm,
    check_activation,
    dense,
    forward_outputs,
    keep_positions,
)

_DEFAULTS = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_inner": None,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "tie_word_embeddings": True,
}
# transformers' GPT2Config.attribute_map: a config.json may use the generic names.
_ALIASES = {
    "max_position_embeddings": "n_positions",
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
}
_IGNORED = (
    "n_ctx",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
)


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """Static structure of a GPT-2 model (hashable).

    Attributes:
        vocab_size: ``V``.
        hidden_size: ``D`` (``n_embd``).
        num_layers: ``L`` (``n_layer``).
        num_heads: ``N`` (``n_head``); the head dimension is ``D // N``.
        intermediate_size: ``F`` (``n_inner``, default ``4 D``).
        max_position_embeddings: ``P`` (``n_positions``), the rows of ``wpe``.
        layer_norm_eps: ``layer_norm_epsilon``.
        activation: ``activation_function``, a key of ``layers.ACTIVATIONS``.
        scale_attn_weights: scale scores by ``H ** -0.5``.
        scale_attn_by_inverse_layer_idx: further divide layer ``i``'s scores by ``i + 1``.
        reorder_and_upcast_attn: compute ``Q K^T`` in float32 (same math in float32 models).
        tie_word_embeddings: logits use ``wte``; no ``lm_head``.
        dtype: the activation and parameter dtype name.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_new"
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    reorder_and_upcast_attn: bool = False
    tie_word_embeddings: bool = True
    dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        if self.hidden_size % self.num_heads:
            raise CheckpointError(
                f"n_embd ({self.hidden_size}) must be a multiple of n_head ({self.num_heads})."
            )
        check_activation(self.activation, "activation_function")

    @property
    def head_dim(self) -> int:
        """``H = D // N``."""
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(
        cls,
        config: Mapping[str, Any],
        dtype: str = "float32",
        ignore_config_keys: Iterable[str] = (),
    ) -> GPT2Config:
        """Reads an HF GPT-2 ``config.json`` dict.

        Raises:
            UnsupportedError: naming a config key or value genjax does not implement.

        Example:
            >>> GPT2Config.from_hf({"model_type": "gpt2", "n_embd": 64, "n_head": 4}).head_dim
            16
        """
        _hf.check_keys(
            config,
            "gpt2",
            (*_DEFAULTS, *_ALIASES, "add_cross_attention"),
            _IGNORED,
            ignore_config_keys,
        )
        config = dict(config)
        for alias, name in _ALIASES.items():
            if alias in config:
                config[name] = config.pop(alias)

        def get(key):
            return _hf.read(config, key, _DEFAULTS)

        hidden = get("n_embd")
        return cls(
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            num_layers=get("n_layer"),
            num_heads=get("n_head"),
            intermediate_size=get("n_inner") or 4 * hidden,
            max_position_embeddings=get("n_positions"),
            layer_norm_eps=float(get("layer_norm_epsilon")),
            activation=get("activation_function"),
            scale_attn_weights=bool(get("scale_attn_weights")),
            scale_attn_by_inverse_layer_idx=bool(get("scale_attn_by_inverse_layer_idx")),
            reorder_and_upcast_attn=bool(get("reorder_and_upcast_attn")),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            dtype=dtype,
        )


class _Attention(nn.Module):
    config: GPT2Config
    layer: int

    @nn.compact
    def __call__(self, x, bias, cache: KVCache, output_attentions: bool = False):
        c, dtype = self.config, jnp.dtype(self.config.dtype)
        batch, length, _ = x.shape
        qkv = dense(3 * c.hidden_size, True, dtype, "c_attn")(x)
        qkv = qkv.reshape(batch, length, 3, c.num_heads, c.head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        keys, values, cache = cache.update_layer(self.layer, k, v)
        scale = c.head_dim**-0.5 if c.scale_attn_weights else 1.0
        if c.scale_attn_by_inverse_layer_idx:
            scale /= float(self.layer + 1)
        out = attention(
            q,
            keys,
            values,
            bias,
            scale,
            upcast_scores=c.reorder_and_upcast_attn,
            return_weights=output_attentions,
        )
        weights = None
        if output_attentions:  # [B, N, T, S]
            out, weights = out
        return dense(c.hidden_size, True, dtype, "c_proj")(out), cache, weights


class _MLP(nn.Module):
    config: GPT2Config

    @nn.compact
    def __call__(self, x):
        c, dtype = self.config, jnp.dtype(self.config.dtype)
        h = ACTIVATIONS[c.activation](dense(c.intermediate_size, True, dtype, "c_fc")(x))
        return dense(c.hidden_size, True, dtype, "c_proj")(h)


class _Block(nn.Module):
    config: GPT2Config
    layer: int

    @nn.compact
    def __call__(self, x, bias, cache, output_attentions: bool = False):
        """``(x, cache, weights)``; ``weights`` (the attention's) is None unless asked for."""
        c, dtype = self.config, jnp.dtype(self.config.dtype)
        h = LayerNorm(c.layer_norm_eps, dtype, name="ln_1")(x)
        h, cache, weights = _Attention(c, self.layer, name="attn")(
            h, bias, cache, output_attentions
        )
        x = x + h
        h = LayerNorm(c.layer_norm_eps, dtype, name="ln_2")(x)
        return x + _MLP(c, name="mlp")(h), cache, weights


class _Blocks(nn.Module):
    config: GPT2Config

    @nn.compact
    def __call__(self, x, bias, cache, output_attentions: bool = False):
        """``(x, cache, inputs, weights)``: as the shared decoder's ``_Layers``."""
        inputs, weights = [], []
        for i in range(self.config.num_layers):
            inputs.append(x)
            x, cache, block_weights = _Block(self.config, i, name=str(i))(
                x, bias, cache, output_attentions
            )
            weights.append(block_weights)
        return x, cache, inputs, weights


class _GPT2LM(nn.Module):
    config: GPT2Config

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
        wte = Embed(c.vocab_size, c.hidden_size, dtype, name="wte")
        wpe = Embed(c.max_position_embeddings, c.hidden_size, dtype, name="wpe")
        x = wte(tokens) + wpe(positions)
        bias = attention_bias(attention_mask, cache.index, length, jnp.float32)
        x, cache, hidden, weights = _Blocks(c, name="h")(x, bias, cache, output_attentions)
        final_norm = LayerNorm(c.layer_norm_eps, dtype, name="ln_f")
        if output_hidden_states:  # the last hidden state is ln_f's output
            x = final_norm(x)
            hidden.append(x)
        x = keep_positions(x, logits_to_keep)  # a prefill needs one position's logits
        if not output_hidden_states:
            x = final_norm(x)
        if c.tie_word_embeddings:
            logits = wte.attend(x)
        else:
            logits = dense(c.vocab_size, False, dtype, "lm_head")(x)
        result = (logits.astype(jnp.float32), cache.advance(length))
        outputs = forward_outputs(
            hidden if output_hidden_states else None, weights if output_attentions else None
        )
        return (*result, outputs) if outputs else result


@dataclasses.dataclass(frozen=True)
class GPT2Model(ModelBase):
    """A GPT-2 causal LM: a hashable, pure model (see ``genjax.models``).

    Example:
        >>> model, params = genjax.models.from_pretrained("openai-community/gpt2")
        ...  # doctest: +SKIP
    """

    config: GPT2Config

    config_class = GPT2Config
    hf_prefix = "transformer."
    # The causal-mask buffers old GPT-2 checkpoints saved with the weights.
    _hf_buffers = re.compile(r"(^|\.)(attn|crossattention)\.(bias|masked_bias)$")

    @property
    def num_kv_heads(self) -> int:
        """``K = N``."""
        return self.config.num_heads

    def _module(self) -> nn.Module:
        return _GPT2LM(self.config)

    def _hf_transposed(self, path: tuple[str, ...]) -> bool:
        return path[-1] == "kernel" and path[0] != "lm_head"  # the Conv1D weights
