"""The Llama family: Llama 2/3 (and SmolLM, TinyLlama...), Mistral, Qwen2 and Qwen3.

:class:`LlamaConfig` is the static structure of every rotary decoder genjax runs (this family,
and OLMo 2, Phi-3 and Gemma 2/3 in their own modules); :class:`LlamaModel` runs it with the
shared core of :mod:`genjax.models.decoder`, whose docstring lists the options and the parameter
tree. The Llama family is the plain pre-norm decoder: RMSNorm, rotary embeddings, grouped-query
attention, a SiLU gated MLP. Its members differ only in config: biases (Qwen2: q/k/v
projections), the sliding window (Mistral: every layer; Qwen2/Qwen3: layers at and after
``max_window_layers`` when ``use_sliding_window``), tied embeddings (SmolLM, Llama 3.2), and
Qwen3's per-head RMSNorm on queries and keys (before rope) with an explicit ``head_dim``.

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
    qwen3          attention_bias (q/k/v/o) use_sliding_window sliding_window max_window_layers
                   layer_types
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from genjax.errors import CheckpointError
from genjax.models import _hf
from genjax.models.base import ModelBase
from genjax.models.decoder import NORM_LAYOUTS, QK_NORMS, DecoderLM
from genjax.models.layers import check_activation
from genjax.models.rope import RopeConfig, rope_from_hf

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
_DEFAULTS["qwen3"] = {**_DEFAULTS["qwen2"], "head_dim": 128, "attention_bias": False}
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
    "qwen3": {
        "handled": (
            "attention_bias",
            "use_sliding_window",
            "sliding_window",
            "max_window_layers",
            "layer_types",
        ),
        "ignored": (),
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
        model_type: the config.json ``model_type`` (informational).
        dtype: the activation and parameter dtype name, e.g. ``"float32"``.
        qk_norm: None, ``"head"`` or ``"projection"``: RMSNorm on queries and keys before rope.
        norm_layout: ``"pre"``, ``"post"`` or ``"sandwich"`` (see :mod:`genjax.models.decoder`).
        norm_offset: norms scale by ``norm_offset + scale`` (Gemma: 1).
        norm_upcast: norms multiply their scale in float32 before rounding.
        fused_projections: ``qkv_proj`` and ``gate_up_proj`` matrices (Phi-3).
        embed_scale: embeddings are multiplied by ``sqrt(D)`` in the model dtype.
        attention_scale: the attention score multiplier; None means ``H ** -0.5``.
        attn_softcap: attention scores become ``c * tanh(scores / c)``; None for none.
        final_softcap: the same on the logits.
        local_rope: rope settings of the sliding-window layers; None means ``rope``.
        ring_cache: sliding-window layers keep a ring of ``W`` cache slots instead of ``S``
            (:mod:`genjax.cache.ring`; the same tokens, less memory); False keeps every layer
            at ``S`` slots with the window applied by the mask.
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
    qk_norm: str | None = None
    norm_layout: str = "pre"
    norm_offset: float = 0.0
    norm_upcast: bool = False
    fused_projections: bool = False
    embed_scale: bool = False
    attention_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    local_rope: RopeConfig | None = None
    ring_cache: bool = True

    def __post_init__(self):
        if self.norm_layout not in NORM_LAYOUTS or self.qk_norm not in QK_NORMS:
            raise CheckpointError(
                f"norm_layout must be one of {NORM_LAYOUTS} and qk_norm one of {QK_NORMS}; got "
                f"{self.norm_layout!r} and {self.qk_norm!r}."
            )
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        object.__setattr__(self, "sliding_windows", tuple(self.sliding_windows))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        for field in ("rope", "local_rope"):
            rope = getattr(self, field)
            if rope is not None and rope.dim == 0:
                object.__setattr__(self, field, dataclasses.replace(rope, dim=self.head_dim))
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
        """Reads an HF ``config.json`` dict of model_type llama, mistral, qwen2 or qwen3.

        Raises:
            UnsupportedError: naming a config key or value genjax does not implement.

        Example:
            >>> LlamaConfig.from_hf({"model_type": "llama", "hidden_size": 64,
            ...                      "num_attention_heads": 4}).head_dim
            16
        """
        model_type = config.get("model_type", "llama")
        if model_type not in _DEFAULTS:
            raise CheckpointError(
                f"LlamaConfig.from_hf reads {', '.join(_DEFAULTS)}, not {model_type!r}."
            )
        keys = _ARCH_KEYS[model_type]
        _hf.check_keys(
            config, model_type, _HANDLED + keys["handled"], keys["ignored"], ignore_config_keys
        )
        defaults = _DEFAULTS[model_type]

        def get(key):
            return _hf.read(config, key, defaults)

        head_dim = get("head_dim") or get("hidden_size") // get("num_attention_heads")
        has_bias = model_type in ("llama", "qwen3") and bool(get("attention_bias"))
        return cls(
            **common_fields(get, head_dim),
            qkv_bias=has_bias or model_type == "qwen2",
            o_bias=has_bias,
            mlp_bias=model_type == "llama" and bool(get("mlp_bias")),
            rope=rope_from_hf({**defaults, **config}, head_dim, ignore_config_keys),
            sliding_windows=_sliding_windows(model_type, get, get("num_hidden_layers")),
            model_type=model_type,
            dtype=dtype,
            qk_norm="head" if model_type == "qwen3" else None,
        )


COMMON_KEYS = _HANDLED
"""The config.json keys :func:`common_fields` and ``rope_from_hf`` read, for every architecture
of the shared decoder (``hidden_act`` aside: Gemma names it ``hidden_activation``)."""


def common_fields(get, head_dim: int, act_key: str = "hidden_act") -> dict[str, Any]:
    """The :class:`LlamaConfig` fields every rotary decoder reads the same way.

    Args:
        get: ``get(key)``: the config.json value, or the architecture's default.
        head_dim: ``H``, as the architecture derives it.
        act_key: the key of the MLP activation.
    """
    num_heads = get("num_attention_heads")
    return dict(
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        intermediate_size=get("intermediate_size"),
        num_layers=get("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("rms_norm_eps")),
        hidden_act=check_activation(get(act_key), act_key),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        max_position_embeddings=get("max_position_embeddings"),
    )


def layer_windows(layer_types, window: int | None, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer windows from transformers' ``layer_types`` (``"sliding_attention"`` layers get
    ``window``), checking the list."""
    if len(layer_types) != num_layers or set(layer_types) - set(_LAYER_TYPES):
        raise CheckpointError(
            f"layer_types must list {num_layers} entries among {_LAYER_TYPES}, got {layer_types}."
        )
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


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
    return layer_windows(layer_types, window, num_layers)


@dataclasses.dataclass(frozen=True)
class LlamaModel(ModelBase):
    """A causal LM of the shared rotary decoder: a hashable, pure model (see ``genjax.models``).

    ``from_hf_config`` reads the Llama family; OLMo 2, Phi-3 and Gemma have subclasses that read
    their own ``config.json`` into the same :class:`LlamaConfig`.

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

    @property
    def attention_windows(self) -> tuple[int | None, ...]:
        """Per layer the sliding window ``W`` of its attention, or None (static). ``generate``'s
        ``output_attentions`` keeps the last ``W`` keys of such a layer's decoding steps, as
        transformers' sliding-window cache holds them."""
        return self.config.sliding_windows

    @property
    def cache_windows(self) -> tuple[int | None, ...]:
        """The sliding windows when ``config.ring_cache``, else none (static)."""
        return self.config.sliding_windows if self.config.ring_cache else ()

    def _module(self) -> nn.Module:
        return DecoderLM(self.config)

    def _hf_transposed(self, path: tuple[str, ...]) -> bool:
        return False  # every tensor is stored as HF stores it
