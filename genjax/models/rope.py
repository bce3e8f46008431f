"""Rotary position embeddings (RoPE) with the Hugging Face ``rope_type`` variants genjax supports.

A checkpoint's rope settings live in ``config.json``: transformers v5 writes one dict,
``rope_parameters = {"rope_type": ..., "rope_theta": ..., "factor": ...}``; v4 files write
``rope_theta`` at the top level and the scaling dict as ``rope_scaling`` (whose type key may be
``"type"``). :func:`rope_from_hf` reads both into a frozen :class:`RopeConfig`.

Supported types (the math of transformers' ``modeling_rope_utils``):

    default   inv_freq[i] = 1 / theta ** (2i / H)
    linear    inv_freq / factor
    dynamic   NTK: theta grows with the longest position of the call once it passes
              max_position_embeddings (see :func:`rope_cos_sin` for the one difference)
    llama3    Llama 3.1 piecewise scaling of the low and middle frequencies
    yarn      YaRN blend of interpolated and extrapolated frequencies, with cos/sin scaled by the
              attention factor
    longrope  LongRoPE (Phi-3): inv_freq / short_factor, or / long_factor once the longest position
              of the call passes original_max_position_embeddings; cos/sin scaled by the
              attention factor

A rotated width ``dim`` below the head dimension (``partial_rotary_factor``) rotates the first
``dim`` features of each head and passes the rest through, as transformers' Phi-3 does.

Static or traced: the :class:`RopeConfig` is static; positions are traced.

References:
    Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021.
    Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models", 2023.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from genjax.errors import CheckpointError, UnsupportedError
from genjax.typing import Array

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# Keys each rope type reads, besides "rope_type"/"type", "rope_theta" and "partial_rotary_factor".
_TYPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
    "longrope": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "short_factor",
            "long_factor",
        }
    ),
}
_REQUIRED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings (static, hashable).

    Attributes:
        rope_type: one of ``SUPPORTED_ROPE_TYPES``.
        theta: the base wavelength (``rope_theta``).
        dim: the rotated width: the head dimension ``H``, or less with a partial rotary factor.
        factor: the scaling factor (all types but ``default``).
        low_freq_factor: ``llama3`` only.
        high_freq_factor: ``llama3`` only.
        original_max_position_embeddings: the pretraining context (``llama3``, ``yarn``,
            ``longrope``).
        max_position_embeddings: the model's ``max_position_embeddings`` (``dynamic``, ``yarn``,
            ``longrope``).
        attention_factor: ``yarn``, ``longrope``: the cos/sin scale; None derives it from
            ``factor``.
        beta_fast: ``yarn`` ramp bound (None means 32).
        beta_slow: ``yarn`` ramp bound (None means 1).
        mscale: ``yarn``: with ``mscale_all_dim``, sets the derived attention factor.
        mscale_all_dim: ``yarn``.
        truncate: ``yarn``: round the correction range to whole dimensions.
        short_factor: ``longrope``: ``dim // 2`` divisors of the frequencies for calls whose
            longest position is within ``original_max_position_embeddings``.
        long_factor: ``longrope``: the divisors past it.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    dim: int = 0
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedError(
                f"rope type {self.rope_type!r} is not supported; supported rope types: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}."
            )
        for key in _REQUIRED_KEYS.get(self.rope_type, ()):
            if getattr(self, key) is None:
                raise CheckpointError(
                    f"rope type {self.rope_type!r} needs {key!r} in rope_parameters/rope_scaling, "
                    "but config.json does not set it."
                )
        if self.rope_type == "longrope" and self.dim:
            for key in ("short_factor", "long_factor"):
                if len(getattr(self, key)) != self.dim // 2:
                    raise CheckpointError(
                        f"longrope {key} must hold one number per rotated frequency, "
                        f"dim // 2 = {self.dim // 2}; got {len(getattr(self, key))}."
                    )
        if (
            self.rope_type in ("dynamic", "yarn", "longrope")
            and self.max_position_embeddings is None
        ):
            raise CheckpointError(
                f"rope type {self.rope_type!r} needs max_position_embeddings in config.json."
            )
        if (
            self.rope_type in _ORIGINAL_LENGTH_TYPES
            and self.original_max_position_embeddings is None
        ):
            raise CheckpointError(
                f"rope type {self.rope_type!r} needs original_max_position_embeddings (or "
                "max_position_embeddings) in config.json."
            )

    @property
    def attention_scaling(self) -> float:
        """The factor applied to cos and sin (1 except for ``yarn`` and ``longrope``)."""
        if self.rope_type == "longrope":
            return self._longrope_attention_factor()
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        factor = self._yarn_factor()
        if self.mscale and self.mscale_all_dim:
            return float(
                _yarn_mscale(factor, self.mscale) / _yarn_mscale(factor, self.mscale_all_dim)
            )
        return _yarn_mscale(factor)

    def _longrope_attention_factor(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)
        original = self.original_max_position_embeddings
        factor = self.factor
        if factor is None:
            factor = self.max_position_embeddings / original
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(original))

    def _yarn_factor(self) -> float:
        if self.factor is not None:
            return float(self.factor)
        return self.max_position_embeddings / self.original_max_position_embeddings


def rope_from_hf(
    config: Mapping[str, Any],
    head_dim: int,
    ignore_keys: Iterable[str] = (),
    partial_rotary: bool = False,
) -> RopeConfig:
    """Reads the rope settings of an HF ``config.json`` dict (v4 or v5 layout).

    ``rope_scaling`` wins over ``rope_parameters`` when both are set, as in transformers. The
    top-level keys read here are ``rope_parameters``, ``rope_scaling``, ``rope_theta``,
    ``original_max_position_embeddings`` and ``max_position_embeddings``.

    Args:
        config: the parsed ``config.json``.
        head_dim: the head dimension ``H``.
        ignore_keys: rope keys the caller vouches for (``from_pretrained(ignore_config_keys=)``).
        partial_rotary: the architecture rotates ``int(H * partial_rotary_factor)`` features of
            each head (Phi-3); otherwise a factor other than 1 is refused.

    Returns:
        The :class:`RopeConfig`.

    Raises:
        UnsupportedError: for a rope type genjax does not implement, per-layer-type rope
            parameters, a partial rotary factor, or a rope key that no supported type reads.

    Example:
        >>> rope_from_hf({"rope_theta": 500000.0}, head_dim=64).theta
        500000.0
    """
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise CheckpointError(f"rope_parameters/rope_scaling must be a dict, got {params!r}.")
    if params and all(isinstance(value, Mapping) for value in params.values()):
        raise UnsupportedError(
            f"per-layer-type rope parameters (keys {sorted(params)}) are not supported; "
            "use a checkpoint with one rope_parameters dict."
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedError(
            f"rope type {rope_type!r} (config.json rope_parameters/rope_scaling) is not supported; "
            f"supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is None:
        partial = 1.0
    if not partial_rotary and partial != 1:
        raise UnsupportedError(
            f"partial_rotary_factor={partial} is not supported: these architectures rotate the "
            "whole head."
        )
    allowed = _TYPE_KEYS[rope_type] | {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    unknown = sorted(set(params) - allowed - set(ignore_keys))
    if unknown:
        raise UnsupportedError(
            f"rope_parameters key(s) {unknown} are not read by rope type {rope_type!r}; genjax "
            f"reads only {sorted(allowed)} for it. If they are stale, pass "
            f"from_pretrained(..., ignore_config_keys={unknown})."
        )
    original = config.get(
        "original_max_position_embeddings", params.get("original_max_position_embeddings")
    )
    if original is None and rope_type in _ORIGINAL_LENGTH_TYPES:
        original = config.get("max_position_embeddings")
    return RopeConfig(
        rope_type=rope_type,
        theta=float(params.get("rope_theta", config.get("rope_theta", 10000.0))),
        dim=int(head_dim * partial),
        factor=_float_or_none(params.get("factor")),
        low_freq_factor=_float_or_none(params.get("low_freq_factor")),
        high_freq_factor=_float_or_none(params.get("high_freq_factor")),
        original_max_position_embeddings=original,
        max_position_embeddings=config.get("max_position_embeddings"),
        attention_factor=_float_or_none(params.get("attention_factor")),
        beta_fast=_float_or_none(params.get("beta_fast")),
        beta_slow=_float_or_none(params.get("beta_slow")),
        mscale=_float_or_none(params.get("mscale")),
        mscale_all_dim=_float_or_none(params.get("mscale_all_dim")),
        truncate=bool(params.get("truncate", True)),
        short_factor=_floats_or_none(params.get("short_factor")),
        long_factor=_floats_or_none(params.get("long_factor")),
    )


def inverse_frequencies(rope: RopeConfig) -> np.ndarray:
    """Returns the static inverse frequencies, float32[dim // 2] (``dynamic``: before scaling;
    ``longrope``: with the short factors)."""
    exponents = np.arange(0, rope.dim, 2, dtype=np.float32) / np.float32(rope.dim)
    inv_freq = np.float32(1.0) / (np.float32(rope.theta) ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / np.float32(rope.factor)
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq)
    if rope.rope_type == "yarn":
        return _yarn(rope, exponents)
    if rope.rope_type == "longrope":
        return _longrope(rope, exponents, rope.short_factor)
    return inv_freq


def rope_cos_sin(rope: RopeConfig, positions: Array, dtype: jnp.dtype) -> tuple[Array, Array]:
    """Returns the cos and sin tables for the given positions.

    For ``dynamic`` the base grows with ``max(positions) + 1`` of this call once it passes
    ``max_position_embeddings``. transformers computes the same thing, but keeps the largest
    length seen in module state across calls; here each call starts afresh, so the two agree
    within one ``generate`` (whose positions only grow) and may differ after an earlier, longer
    call on the same HF module. ``longrope`` picks its long factors the same way, when
    ``max(positions) + 1`` passes ``original_max_position_embeddings`` (see :func:`_longrope`).

    Args:
        rope: the settings (static).
        positions: int32[B, T] position ids.
        dtype: the dtype of the returned tables.

    Returns:
        ``(cos, sin)``, each dtype[B, T, dim]: the half-width angles repeated twice, as HF's
        ``rotate_half`` layout expects, and scaled by ``rope.attention_scaling``.
    """
    inv_freq = jnp.asarray(inverse_frequencies(rope))
    if rope.rope_type == "dynamic":
        inv_freq = _dynamic_inv_freq(rope, positions, inv_freq)
    if rope.rope_type == "longrope":
        exponents = np.arange(0, rope.dim, 2, dtype=np.float32) / np.float32(rope.dim)
        long = jnp.asarray(_longrope(rope, exponents, rope.long_factor))
        beyond = jnp.max(positions) + 1 > rope.original_max_position_embeddings
        inv_freq = jnp.where(beyond, long, inv_freq)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, H]
    scale = rope.attention_scaling
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotates ``x`` (dtype[B, T, N, H]) by the tables (dtype[B, T, dim]) in HF rotate_half style;
    with ``dim < H`` only the first ``dim`` features of each head turn."""
    rotated_width = cos.shape[-1]
    if rotated_width < x.shape[-1]:
        turned = apply_rope(x[..., :rotated_width], cos, sin)
        return jnp.concatenate([turned, x[..., rotated_width:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _floats_or_none(value: Any) -> tuple[float, ...] | None:
    return None if value is None else tuple(float(v) for v in value)


def _longrope(rope: RopeConfig, exponents: np.ndarray, factors: tuple[float, ...]) -> np.ndarray:
    """``1 / (factors * theta ** (2i / dim))``, float32[dim // 2] (transformers' LongRoPE).

    transformers chooses the long factors in a forward pass whose longest position id passes
    ``original_max_position_embeddings``, else the short ones; Phi-3's ``generate`` also drops
    its cache once the sequence grows past that length, recomputing every earlier key with the
    long factors. genjax keeps its cache, so a ``generate`` call that crosses the length keeps
    the short-factor keys of the earlier tokens (prompts that start past it, or calls that stay
    within it, match transformers).
    """
    inv_freq = np.asarray(factors, np.float32) * (np.float32(rope.theta) ** exponents)
    return (np.float32(1.0) / inv_freq).astype(np.float32)


def _llama3(rope: RopeConfig, inv_freq: np.ndarray) -> np.ndarray:
    factor = np.float32(rope.factor)
    old_context = rope.original_max_position_embeddings
    low_wavelen = old_context / rope.low_freq_factor
    high_wavelen = old_context / rope.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (np.float32(old_context) / wavelen - np.float32(rope.low_freq_factor)) / np.float32(
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, exponents: np.ndarray) -> np.ndarray:
    dim, base = rope.dim, rope.theta
    factor = rope._yarn_factor()
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1
    original = rope.original_max_position_embeddings

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = (1 - ramp).astype(np.float32)
    pos_freqs = np.float32(base) ** exponents
    extrapolated = np.float32(1.0) / pos_freqs
    interpolated = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq.astype(np.float32)


def _dynamic_inv_freq(rope: RopeConfig, positions: Array, inv_freq: Array) -> Array:
    original = rope.max_position_embeddings
    length = jnp.maximum(jnp.max(positions) + 1, original)
    factor = jnp.float32(rope.factor)
    growth = factor * length.astype(jnp.float32) / original - (factor - 1)
    base = jnp.float32(rope.theta) * growth ** jnp.float32(rope.dim / (rope.dim - 2))
    exponents = jnp.arange(0, rope.dim, 2, dtype=jnp.float32) / rope.dim
    scaled = 1.0 / (base**exponents)
    return jnp.where(length > original, scaled, inv_freq)
