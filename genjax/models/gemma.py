"""Gemma 2 and Gemma 3 (text only): the shared decoder with Gemma's norms, scaling and caps.

Both (``norm_layout="sandwich"``, ``norm_offset=1``, ``norm_upcast``, ``embed_scale``): four
RMSNorms per layer (before and after attention, before and after the MLP, the "after" ones on the
residual branch), each scaling by ``1 + w`` in float32; embeddings multiplied by ``sqrt(D)``
rounded to the model dtype; a GELU-tanh gated MLP (``hidden_activation``); attention scores
scaled by ``query_pre_attn_scalar ** -0.5``; sliding-window and global layers (``layer_types``).
Tied embeddings by default. Parameter tree: :mod:`genjax.models.decoder`.

Gemma 2 adds attention logit soft-capping (``attn_logit_softcapping``) and final logit
soft-capping (``final_logit_softcapping``); its default layers alternate sliding, global.
Gemma 3 (``Gemma3ForCausalLM``, model_type ``gemma3_text``) adds per-head q/k RMSNorm before rope,
a ``sliding_window_pattern`` (every n-th layer global) when ``layer_types`` is absent, and its own
rope for the sliding layers: ``rope_parameters["sliding_attention"]`` (or ``rope_local_base_freq``)
while the global layers read ``rope_parameters["full_attention"]`` (or ``rope_theta`` and
``rope_scaling``).

config.json keys (besides ``llama.COMMON_KEYS``, whose ``hidden_act`` Gemma ignores as
transformers does, reading ``hidden_activation``):

    both      hidden_activation attention_bias query_pre_attn_scalar sliding_window layer_types
              final_logit_softcapping use_bidirectional_attention (false only);
              ignored: cache_implementation (the cache layout, not the math)
    gemma2    attn_logit_softcapping
    gemma3    sliding_window_pattern rope_local_base_freq; ignored as in transformers:
              attn_logit_softcapping (Gemma 3's attention does not apply it),
              _sliding_window_pattern (written beside layer_types, never read back)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from genjax.errors import CheckpointError, UnsupportedError
from genjax.models import _hf
from genjax.models.llama import COMMON_KEYS, LlamaConfig, LlamaModel, common_fields, layer_windows
from genjax.models.rope import RopeConfig, rope_from_hf

# transformers' Gemma2Config / Gemma3TextConfig defaults, used when config.json omits a key.
_DEFAULTS = {
    "gemma2": {
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "layer_types": None,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "use_bidirectional_attention": None,
    },
}
_DEFAULTS["gemma3_text"] = {
    **_DEFAULTS["gemma2"],
    "vocab_size": 262208,
    "max_position_embeddings": 131072,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
    "sliding_window_pattern": 6,
}
_BOTH = (
    "hidden_activation",
    "attention_bias",
    "query_pre_attn_scalar",
    "sliding_window",
    "layer_types",
    "final_logit_softcapping",
    "use_bidirectional_attention",
)
_KEYS = {
    "gemma2": {
        "handled": (*COMMON_KEYS, *_BOTH, "attn_logit_softcapping"),
        "ignored": ("cache_implementation",),
    },
    "gemma3_text": {
        "handled": (*COMMON_KEYS, *_BOTH, "sliding_window_pattern", "rope_local_base_freq"),
        # _sliding_window_pattern: transformers writes its private copy of the pattern beside
        # layer_types and never reads it back.
        "ignored": ("cache_implementation", "attn_logit_softcapping", "_sliding_window_pattern"),
    },
}
_LAYER_TYPE_KEYS = {"sliding_attention", "full_attention"}
_SOFT_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")  # read (or, Gemma 3's attention
# cap, ignored as transformers ignores it), not rejected as for other architectures


def gemma_config(
    config: Mapping[str, Any], dtype: str = "float32", ignore_config_keys: Iterable[str] = ()
) -> LlamaConfig:
    """Reads a Gemma 2 or Gemma 3 text ``config.json`` dict into the shared decoder's config.

    Raises:
        UnsupportedError: naming a config key or value genjax does not implement.

    Example:
        >>> gemma_config({"model_type": "gemma2", "num_hidden_layers": 4}).sliding_windows
        (4096, None, 4096, None)
    """
    model_type = config.get("model_type")
    if model_type not in _DEFAULTS:
        raise CheckpointError(f"gemma_config reads gemma2 or gemma3_text, not {model_type!r}.")
    keys = _KEYS[model_type]
    _hf.check_keys(
        config, model_type, keys["handled"], keys["ignored"], ignore_config_keys, _SOFT_CAPS
    )
    defaults = _DEFAULTS[model_type]

    def get(key):
        return _hf.read(config, key, defaults)

    if get("use_bidirectional_attention"):
        raise UnsupportedError(
            "config.json sets use_bidirectional_attention=true: bidirectional (encoder) "
            "attention is not supported by genjax's causal decoder."
        )
    head_dim = get("head_dim") or get("hidden_size") // get("num_attention_heads")
    num_layers, window = get("num_hidden_layers"), get("sliding_window")
    layer_types = get("layer_types")
    if layer_types is None:
        period = 2 if model_type == "gemma2" else get("sliding_window_pattern")
        layer_types = [
            "sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)
        ]
    if model_type == "gemma2":
        rope = rope_from_hf({**defaults, **config}, head_dim, ignore_config_keys)
        local_rope = None
    else:
        rope, local_rope = _gemma3_ropes(config, get, head_dim, ignore_config_keys)
        if window is None and "sliding_attention" in layer_types:
            raise UnsupportedError(
                "config.json of this gemma3_text checkpoint has sliding layers but "
                "sliding_window=null; genjax needs the window to tell its local layers."
            )
    bias = bool(get("attention_bias"))
    attn_cap = get("attn_logit_softcapping") if model_type == "gemma2" else None
    final_cap = get("final_logit_softcapping")
    return LlamaConfig(
        **common_fields(get, head_dim, act_key="hidden_activation"),
        qkv_bias=bias,
        o_bias=bias,
        rope=rope,
        local_rope=local_rope,
        sliding_windows=layer_windows(layer_types, window, num_layers),
        model_type=model_type,
        dtype=dtype,
        qk_norm="head" if model_type == "gemma3_text" else None,
        norm_layout="sandwich",
        norm_offset=1.0,
        norm_upcast=True,
        embed_scale=True,
        attention_scale=float(get("query_pre_attn_scalar")) ** -0.5,
        attn_softcap=None if attn_cap is None else float(attn_cap),
        final_softcap=None if final_cap is None else float(final_cap),
    )


def _gemma3_ropes(config, get, head_dim, ignore_config_keys) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) rope settings, read as transformers' Gemma3TextConfig reads them."""
    params = config.get("rope_parameters") or {}
    if not isinstance(params, Mapping) or set(params) - _LAYER_TYPE_KEYS:
        raise UnsupportedError(
            f"gemma3_text rope_parameters must be keyed by {sorted(_LAYER_TYPE_KEYS)}, got "
            f"{params!r}."
        )
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    if config.get("rope_scaling"):
        full.update(config["rope_scaling"])
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
    context = {"max_position_embeddings": get("max_position_embeddings")}
    return (
        rope_from_hf({**context, "rope_parameters": full}, head_dim, ignore_config_keys),
        rope_from_hf({**context, "rope_parameters": local}, head_dim, ignore_config_keys),
    )


class GemmaModel(LlamaModel):
    """A Gemma 2 or Gemma 3 text causal LM (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``):
    :class:`LlamaModel` read from a ``gemma2`` or ``gemma3_text`` config.json."""

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any], dtype: str = "float32", ignore_config_keys=()
    ) -> GemmaModel:
        """Builds the model from an HF ``config.json`` dict (see :func:`gemma_config`)."""
        return cls(gemma_config(config, dtype, ignore_config_keys))
