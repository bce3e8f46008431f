"""OLMo 2: the shared decoder with norms on the residual branch and whole-projection q/k norms.

Differences from Llama (``norm_layout="post"``, ``qk_norm="projection"``, ``norm_upcast``):
each layer normalizes the attention output (``post_attention_layernorm``) and the MLP output
(``post_feedforward_layernorm``) before adding them to the residual stream, with no norm on the
layer input; queries and keys are RMS-normalized over the whole ``N*H`` / ``K*H`` projection
before they are split into heads and rotated; norms multiply their weight in float32 and round
once. Parameter tree: :mod:`genjax.models.decoder`.

config.json keys: those of every rotary decoder (``llama.COMMON_KEYS``) and ``attention_bias``
(q/k/v/o biases). ``partial_rotary_factor`` other than 1 is refused. No sliding window.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from genjax.models import _hf
from genjax.models.llama import COMMON_KEYS, LlamaConfig, LlamaModel, common_fields
from genjax.models.rope import rope_from_hf

# transformers' Olmo2Config defaults, used when config.json omits a key.
_DEFAULTS = {
    "vocab_size": 50304,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
}


def olmo2_config(
    config: Mapping[str, Any], dtype: str = "float32", ignore_config_keys: Iterable[str] = ()
) -> LlamaConfig:
    """Reads an OLMo 2 ``config.json`` dict into the shared decoder's config.

    Raises:
        UnsupportedError: naming a config key or value genjax does not implement.

    Example:
        >>> olmo2_config({"model_type": "olmo2", "hidden_size": 64,
        ...               "num_attention_heads": 4}).qk_norm
        'projection'
    """
    _hf.check_keys(config, "olmo2", (*COMMON_KEYS, "attention_bias"), (), ignore_config_keys)

    def get(key):
        return _hf.read(config, key, _DEFAULTS)

    head_dim = get("head_dim") or get("hidden_size") // get("num_attention_heads")
    bias = bool(get("attention_bias"))
    return LlamaConfig(
        **common_fields(get, head_dim),
        qkv_bias=bias,
        o_bias=bias,
        rope=rope_from_hf({**_DEFAULTS, **config}, head_dim, ignore_config_keys),
        model_type="olmo2",
        dtype=dtype,
        qk_norm="projection",
        norm_layout="post",
        norm_upcast=True,
    )


class Olmo2Model(LlamaModel):
    """An OLMo 2 causal LM (``Olmo2ForCausalLM``): :class:`LlamaModel` read from an ``olmo2``
    config.json."""

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any], dtype: str = "float32", ignore_config_keys=()
    ) -> Olmo2Model:
        """Builds the model from an HF ``config.json`` dict (see :func:`olmo2_config`)."""
        return cls(olmo2_config(config, dtype, ignore_config_keys))
