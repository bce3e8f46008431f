"""The Llama family: Llama 2/3 (and SmolLM, TinyLlama...), Mistral and Qwen2.

One pre-norm decoder covers them: RMSNorm, rotary embeddings, grouped-query attention, a SiLU
gated MLP. They differ only in config: biases (Qwen2: q/k/v projections), the sliding window
(Mistral: every layer; Qwen2: layers at and after ``max_window_layers`` when
``use_sliding_window``), tied embeddings (SmolLM, Llama 3.2).

Parameter tree (HF name = path joined by dots, ``kernel``/``scale``/``embedding`` -> ``weight``,
prefix ``model.`` except ``lm_head``; every ``kernel`` is the HF weight as stored, [out, in])::

    embed_tokens/embedding                     [V, D]
    layers/<i>/input_layernorm/scale           [D]
    layers/<i>/self_attn/q_proj/kernel         [N*H, D]   (+ bias [N*H])
    layers/<i>/self_attn/k_proj/kernel         [K*H, D]   (+ bias [K*H])
    layers/<i>/self_attn/v_proj/kernel         [K*H, D]   (+ bias [K*H])
    layers/<i>/self_attn/o_proj/kernel         [D, N*H]   (+ bias [D])
    layers/<i>/post_attention_layernorm/scale  [D]
    layers/<i>/mlp/gate_proj/kernel            [F, D]     (+ bias [F])
    layers/<i>/mlp/up_proj/kernel              [F, D]     (+ bias [F])
    layers/<i>/mlp/down_proj/kernel            [D, F]     (+ bias [D])
    norm/scale                                 [D]
    lm_head/kernel                             [V, D]     (absent when tie_word_embeddings)

config.json keys, by model_type (``_hf.IGNORED_KEYS`` lists the ones every architecture ignores):

    handled (all)  vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads
                   num_key_value_heads head_dim hidden_act max_position_embeddings rms_norm_eps
                   tie_word_embeddings rope_parameters rope_scaling rope_theta
                   original_max_position_embeddings partial_rotary_factor (1.0 only)
    llama          attention_bias mlp_bias
    mistral        sliding_window; ignored as in transformers: layer_types, attention_bias,
                   mlp_bias (Mistral has no biases)
    qwen2          use_sliding_window sliding_window max_window_layers layer_types use_mrope (false
                   only); ignored as in transformers: attention_bias, mlp_bias (Qwen2 hardcodes
                   q/k/v bias and no o/MLP bias)
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
from genjax.models.base import ModelBase
from genjax.models.layers import (
    ACTIVATIONS,
    Embed,
    RMSNorm,
    attention,
    check_activation,
    dense,
)
from genjax.models.rope import RopeConfig, apply_rope, rope_cos_sin, rope_from_hf

_COMMON_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "head_dim": None,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# transformers' config-class defaults, used when config.json omits a key.
_DEFAULTS = {
    "llama": {
        **_COMMON_DEFAULTS,
        "intermediate_size": 11008,
        "num_key_value_heads": None,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "mistral": {
        **_COMMON_DEFAULTS,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
    },
    "qwen2": {
        **_COMMON_DEFAULTS,
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "layer_types": None,
    },
}
_HANDLED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "original_max_position_embeddings",
)
_ARCH_KEYS = {
    "llama": {"handled": ("attention_bias", "mlp_bias"), "ignored": ()},
    "mistral": {
        "handled": ("sliding_window",),
        "ignored": ("layer_types", "attention_bias", "mlp_bias"),
    },
    "qwen2": {
        "handled": ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
        "ignored": ("attention_bias", "mlp_bias"),
    },
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Static structure of a Llama-family model (hashable).

    Attributes:
        vocab_size: ``V``.
        hidden_size: ``D``.
        intermediate_size: ``F``.
        num_layers: ``L``.
        num_heads: ``N``.
        num_kv_heads: ``K`` (divides ``N``).
        head_dim: ``H``; attention scores are scaled by ``H ** -0.5``.
        rms_norm_eps: the RMSNorm epsilon.
        hidden_act: the MLP gate activation, a key of ``layers.ACTIVATIONS``.
        qkv_bias: q/k/v projections have biases (Llama ``attention_bias``; Qwen2 always).
        o_bias: the output projection has a bias (Llama ``attention_bias``).
        mlp_bias: the MLP projections have biases.
        tie_word_embeddings: logits use the input embedding; no ``lm_head``.
        rope: the rotary embedding settings.
        sliding_windows: per layer, the attention window ``W`` or None for full attention;
            ``()`` means full attention everywhere.
        max_position_embeddings: the trained context from config.json (not a hard limit).
        model_type: ``"llama"``, ``"mistral"`` or ``"qwen2"`` (informational).
        dtype: the activation and parameter dtype name, e.g. ``"float32"``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    rope: RopeConfig = RopeConfig()
    sliding_windows: tuple[int | None, ...] = ()
    max_position_embeddings: int | None = None
    model_type: str = "llama"
    dtype: str = "float32"

    def __post_init__(self):
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        object.__setattr__(self, "sliding_windows", tuple(self.sliding_windows))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        if self.rope.dim == 0:
            object.__setattr__(self, "rope", dataclasses.replace(self.rope, dim=self.head_dim))
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})."
            )
        if len(self.sliding_windows) != self.num_layers:
            raise CheckpointError(
                f"sliding_windows has {len(self.sliding_windows)} entries for "
                f"{self.num_layers} layers."
            )
        check_activation(self.hidden_act, "hidden_act")

    @classmethod
    def from_hf(
        cls,
        config: Mapping[str, Any],
        dtype: str = "float32",
        ignore_config_keys: Iterable[str] = (),
    ) -> LlamaConfig:
        """Reads an HF ``config.json`` dict of model_type llama, mistral or qwen2.

        Raises:
            UnsupportedError: naming a config key or value genjax does not implement.

        Example:
            >>> LlamaConfig.from_hf({"model_type": "llama", "hidden_size": 64,
            ...                      "num_attention_heads": 4}).head_dim
            16
        """
        model_type = config.get("model_type", "llama")
        if model_type not in _DEFAULTS:
            raise CheckpointError(f"LlamaConfig reads llama, mistral or qwen2, not {model_type!r}.")
        keys = _ARCH_KEYS[model_type]
        _hf.check_keys(
            config, model_type, _HANDLED + keys["handled"], keys["ignored"], ignore_config_keys
        )
        defaults = _DEFAULTS[model_type]

        def get(key):
            return _hf.read(config, key, defaults)

        num_heads = get("num_attention_heads")
        num_layers = get("num_hidden_layers")
        head_dim = get("head_dim") or get("hidden_size") // num_heads
        has_bias = model_type == "llama" and bool(get("attention_bias"))
        return cls(
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps")),
            hidden_act=get("hidden_act"),
            qkv_bias=has_bias or model_type == "qwen2",
            o_bias=has_bias,
            mlp_bias=model_type == "llama" and bool(get("mlp_bias")),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            rope=rope_from_hf({**defaults, **config}, head_dim, ignore_config_keys),
            sliding_windows=_sliding_windows(model_type, get, num_layers),
            max_position_embeddings=get("max_position_embeddings"),
            model_type=model_type,
            dtype=dtype,
        )


def _sliding_windows(model_type: str, get, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer windows as transformers' Mistral and Qwen2 choose them."""
    if model_type == "llama":
        return (None,) * num_layers
    if model_type == "mistral":
        return (get("sliding_window"),) * num_layers
    window = get("sliding_window") if get("use_sliding_window") else None
    layer_types = get("layer_types")
    if layer_types is None:
        first = get("max_window_layers")
        layer_types = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(num_layers)
        ]
    if len(layer_types) != num_layers or set(layer_types) - set(_LAYER_TYPES):
        raise CheckpointError(
            f"layer_types must list {num_layers} entries among {_LAYER_TYPES}, got {layer_types}."
        )
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


class _Attention(nn.Module):
    config: LlamaConfig
    layer: int

    @nn.compact
    def __call__(self, x, cos, sin, bias, cache: KVCache):
        c, dtype = self.config, jnp.dtype(self.config.dtype)
        batch, length, _ = x.shape
        q = dense(c.num_heads * c.head_dim, c.qkv_bias, dtype, "q_proj")(x)
        k = dense(c.num_kv_heads * c.head_dim, c.qkv_bias, dtype, "k_proj")(x)
        v = dense(c.num_kv_heads * c.head_dim, c.qkv_bias, dtype, "v_proj")(x)
        q = apply_rope(q.reshape(batch, length, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.reshape(batch, length, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.reshape(batch, length, c.num_kv_heads, c.head_dim)
        keys, values, cache = cache.update_layer(self.layer, k, v)
        out = attention(q, keys, values, bias, c.head_dim**-0.5)
        return dense(c.hidden_size, c.o_bias, dtype, "o_proj")(out), cache


class _MLP(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, x):
        c, dtype = self.config, jnp.dtype(self.config.dtype)
        gate = dense(c.intermediate_size, c.mlp_bias, dtype, "gate_proj")(x)
        up = dense(c.intermediate_size, c.mlp_bias, dtype, "up_proj")(x)
        return dense(c.hidden_size, c.mlp_bias, dtype, "down_proj")(
            ACTIVATIONS[c.hidden_act](gate) * up
        )


class _DecoderLayer(nn.Module):
    config: LlamaConfig
    layer: int

    @nn.compact
    def __call__(self, x, cos, sin, bias, cache):
        c, dtype = self.config, jnp.dtype(self.config.dtype)
        h = RMSNorm(c.rms_norm_eps, dtype, name="input_layernorm")(x)
        h, cache = _Attention(c, self.layer, name="self_attn")(h, cos, sin, bias, cache)
        x = x + h
        h = RMSNorm(c.rms_norm_eps, dtype, name="post_attention_layernorm")(x)
        return x + _MLP(c, name="mlp")(h), cache


class _Layers(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, x, cos, sin, biases, cache):
        for i, window in enumerate(self.config.sliding_windows):
            x, cache = _DecoderLayer(self.config, i, name=str(i))(
                x, cos, sin, biases[window], cache
            )
        return x, cache


class _LlamaLM(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens, positions, cache, attention_mask, logits_to_keep=0):
        c, dtype = self.config, jnp.dtype(self.config.dtype)
        length = tokens.shape[1]
        embed = Embed(c.vocab_size, c.hidden_size, dtype, name="embed_tokens")
        x = embed(tokens)
        cos, sin = rope_cos_sin(c.rope, positions, dtype)
        biases = {
            window: attention_bias(attention_mask, cache.index, length, jnp.float32, window)
            for window in set(c.sliding_windows)
        }
        x, cache = _Layers(c, name="layers")(x, cos, sin, biases, cache)
        if logits_to_keep:  # only the last positions' logits (prefill needs one)
            x = x[:, -logits_to_keep:]
        x = RMSNorm(c.rms_norm_eps, dtype, name="norm")(x)
        if c.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = dense(c.vocab_size, False, dtype, "lm_head")(x)
        return logits.astype(jnp.float32), cache.advance(length)


@dataclasses.dataclass(frozen=True)
class LlamaModel(ModelBase):
    """A Llama, Mistral or Qwen2 causal LM: a hashable, pure model (see ``genjax.models``).

    Example:
        >>> model, params = genjax.models.from_pretrained("HuggingFaceTB/SmolLM2-135M")
        ...  # doctest: +SKIP
        >>> cache = model.init_cache(batch=1, max_length=8)
    """

    config: LlamaConfig

    config_class = LlamaConfig
    hf_prefix = "model."
    _hf_buffers = re.compile(r"rotary_emb\.inv_freq$")

    @property
    def num_kv_heads(self) -> int:
        """``K``."""
        return self.config.num_kv_heads

    def _module(self) -> nn.Module:
        return _LlamaLM(self.config)

    def _hf_transposed(self, path: tuple[str, ...]) -> bool:
        return False  # every tensor is stored as HF stores it
