"""Phi-3 and Phi-4 (model_type phi3): the shared decoder with fused projections and LongRoPE.

Differences from Llama (``fused_projections``): attention reads one ``qkv_proj`` matrix
[(N + 2K) * H, D] whose outputs are ``[q | k | v]``, and the MLP one ``gate_up_proj`` matrix
[2F, D] whose outputs are ``[gate | up]``; both are split in the layer, so the parameters are the
checkpoint's tensors as stored. Rotary embeddings may be ``longrope`` (short or long factors by
the longest position of the call, see :mod:`genjax.models.rope`) and partial
(``partial_rotary_factor``: Phi-4-mini rotates 3/4 of each head). Parameter tree:
:mod:`genjax.models.decoder`.

``longrope`` and ``generate``: transformers' Phi-3 drops its cache once the sequence grows past
``original_max_position_embeddings`` and recomputes every key with the long factors; genjax keeps
the keys it cached with the short factors. Prompts that already pass that length, and calls that
stay within it, match transformers; a call that crosses it does not, from that step on.

config.json keys: those of every rotary decoder (``llama.COMMON_KEYS``), ``sliding_window``
(every layer, as Mistral) and ``partial_rotary_factor``. Ignored as in transformers:
``resid_pdrop``, ``embd_pdrop`` (dropout), ``attention_bias``, ``mlp_bias``, ``lm_head_bias``
(Phi-3 has no biases), ``full_attn_mod``, ``interpolate_factor`` (remote-code keys it never
reads). A legacy ``rope_scaling`` of type ``su`` or ``yarn`` is LongRoPE, as transformers reads
it for Phi-3.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from genjax.models import _hf
from genjax.models.llama import COMMON_KEYS, LlamaConfig, LlamaModel, common_fields
from genjax.models.rope import rope_from_hf

# transformers' Phi3Config defaults, used when config.json omits a key.
_DEFAULTS = {
    "vocab_size": 32064,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "sliding_window": None,
}
_HANDLED = (*COMMON_KEYS, "sliding_window", "partial_rotary_factor")
# Ignored as transformers' Phi3 ignores them: dropout, and keys of the remote-code Phi-3/Phi-4
# configs (Phi-4-mini writes all four) that its modeling never reads.
_IGNORED = (
    "resid_pdrop",
    "embd_pdrop",
    "attention_bias",
    "mlp_bias",
    "lm_head_bias",
    "full_attn_mod",
    "interpolate_factor",
)
_LONGROPE_ALIASES = ("su", "yarn")  # transformers' Phi-3 reads both as longrope


def phi3_config(
    config: Mapping[str, Any], dtype: str = "float32", ignore_config_keys: Iterable[str] = ()
) -> LlamaConfig:
    """Reads a Phi-3 / Phi-4 ``config.json`` dict into the shared decoder's config.

    Raises:
        UnsupportedError: naming a config key or value genjax does not implement.

    Example:
        >>> phi3_config({"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4,
        ...              "partial_rotary_factor": 0.5}).rope.dim
        8
    """
    _hf.check_keys(
        config, "phi3", _HANDLED, _IGNORED, ignore_config_keys, ("partial_rotary_factor",)
    )

    def get(key):
        return _hf.read(config, key, _DEFAULTS)

    head_dim = get("head_dim") or get("hidden_size") // get("num_attention_heads")
    rope_config = {**_DEFAULTS, **config}
    for key in ("rope_scaling", "rope_parameters"):
        params = rope_config.get(key)
        if isinstance(params, Mapping) and params.get("type") in _LONGROPE_ALIASES:
            rope_config[key] = {
                **{k: v for k, v in params.items() if k != "type"},
                "rope_type": "longrope",
            }
        elif isinstance(params, Mapping) and params.get("rope_type") in _LONGROPE_ALIASES:
            rope_config[key] = {**params, "rope_type": "longrope"}
    window = get("sliding_window")
    return LlamaConfig(
        **common_fields(get, head_dim),
        rope=rope_from_hf(rope_config, head_dim, ignore_config_keys, partial_rotary=True),
        sliding_windows=(window,) * get("num_hidden_layers"),
        model_type="phi3",
        dtype=dtype,
        fused_projections=True,
    )


class Phi3Model(LlamaModel):
    """A Phi-3 / Phi-4 causal LM (``Phi3ForCausalLM``): :class:`LlamaModel` read from a ``phi3``
    config.json."""

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any], dtype: str = "float32", ignore_config_keys=()
    ) -> Phi3Model:
        """Builds the model from an HF ``config.json`` dict (see :func:`phi3_config`)."""
        return cls(phi3_config(config, dtype, ignore_config_keys))
