"""BART, mBART and Marian: encoder-decoders with absolute positions and biased layers.

One forward pass, three variants (``model_type``):

* ``bart``: learned positions with BART's offset of 2 (table row ``position + 2``), a layer norm
  on the embeddings (``layernorm_embedding``), post-norm blocks (the norm after each residual).
* ``mbart``: as BART, but pre-norm blocks (the norm before each sublayer) and a final layer
  norm after each stack (``encoder.layer_norm``, ``decoder.layer_norm``).
* ``marian``: static sinusoidal positions (no offset; transformers'
  ``MarianSinusoidalPositionalEmbedding`` layout, sines then cosines), no embedding layer norm,
  post-norm blocks.

All three: token embeddings times ``sqrt(D)`` when ``scale_embedding``, scores scaled by
``H ** -0.5``, biases on every projection, an activation MLP (``fc1``, ``fc2``), the head tied to
``model.shared`` plus ``final_logits_bias``. Positions are slot indices (padding included), as
transformers computes them for these models.

Parameter tree (HF name = path joined by dots; ``kernel``/``scale``/``embedding`` ->
``weight``; no prefix stripped; kernels [out, in]; ``P`` = max_position_embeddings)::

    model/shared/embedding                                    [V, D]
    model/encoder/embed_positions/embedding                   [P + 2, D]   (bart, mbart)
    model/encoder/layernorm_embedding/{scale,bias}            [D]          (bart, mbart)
    model/encoder/layers/<i>/self_attn/{q,k,v,out}_proj/{kernel,bias}   [D, D], [D]
    model/encoder/layers/<i>/self_attn_layer_norm/{scale,bias}
    model/encoder/layers/<i>/fc1/{kernel,bias}                [F, D], [F]
    model/encoder/layers/<i>/fc2/{kernel,bias}                [D, F], [D]
    model/encoder/layers/<i>/final_layer_norm/{scale,bias}
    model/encoder/layer_norm/{scale,bias}                     [D]          (mbart)
    model/decoder/...                                         the same, plus per layer
        encoder_attn/{q,k,v,out}_proj and encoder_attn_layer_norm
    lm_head/kernel                                            [V, D]  (tie_word_embeddings false)
    final_logits_bias                                         [1, V]

``model.encoder.embed_tokens.weight``, ``model.decoder.embed_tokens.weight`` (= shared) and
Marian's stored sinusoidal tables are skipped at load. ``final_logits_bias`` must be in the
checkpoint (transformers' converted checkpoints all store it).

config.json keys (besides ``_hf.IGNORED_KEYS``):

    handled   vocab_size d_model max_position_embeddings encoder_layers decoder_layers
              encoder_attention_heads decoder_attention_heads encoder_ffn_dim decoder_ffn_dim
              activation_function scale_embedding tie_word_embeddings is_encoder_decoder
              (true only) decoder_start_token_id; Marian: decoder_vocab_size (equal to
              vocab_size or null) share_encoder_decoder_embeddings (true only); the aliases
              hidden_size num_attention_heads
    ignored   dropout activation_dropout encoder_layerdrop decoder_layerdrop init_std
              classifier_dropout classif_dropout (training only); num_hidden_layers (an old
              copy of encoder_layers); add_bias_logits add_final_layer_norm normalize_before
              normalize_embedding static_position_embeddings extra_pos_embeddings
              force_bos_token_to_be_generated output_past gradient_checkpointing (keys of
              configs written by transformers 3 and 4 that transformers v5 no longer reads:
              the model class alone decides the architecture)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

import jax.numpy as jnp

from genjax.cache import attention_bias
from genjax.errors import UnsupportedError
from genjax.models import _hf
from genjax.models import encoder_decoder as ed
from genjax.models.layers import ACTIVATIONS, check_activation, linear

MODEL_TYPES = ("bart", "mbart", "marian")
_DEFAULTS = {
    "vocab_size": 50265,
    "d_model": 1024,
    "max_position_embeddings": 1024,
    "encoder_layers": 12,
    "decoder_layers": 12,
    "encoder_attention_heads": 16,
    "decoder_attention_heads": 16,
    "encoder_ffn_dim": 4096,
    "decoder_ffn_dim": 4096,
    "activation_function": "gelu",
    "scale_embedding": False,
    "tie_word_embeddings": True,
    "decoder_start_token_id": None,
}
_ALIASES = {"hidden_size": "d_model", "num_attention_heads": "encoder_attention_heads"}
_HANDLED = ("is_encoder_decoder", "decoder_vocab_size", "share_encoder_decoder_embeddings")
_IGNORED = (
    "dropout",
    "activation_dropout",
    "encoder_layerdrop",
    "decoder_layerdrop",
    "init_std",
    "classifier_dropout",
    "classif_dropout",
    "num_hidden_layers",
    "add_bias_logits",
    "add_final_layer_norm",
    "normalize_before",
    "normalize_embedding",
    "static_position_embeddings",
    "extra_pos_embeddings",
    "force_bos_token_to_be_generated",
    "output_past",
    "gradient_checkpointing",
)
_OFFSET = 2  # BART's learned position table starts at row 2


@dataclasses.dataclass(frozen=True)
class BartConfig:
    """Static structure of a BART / mBART / Marian model (hashable).

    Attributes:
        model_type: ``"bart"``, ``"mbart"`` or ``"marian"``.
        vocab_size: ``V``.
        hidden_size: ``D`` (``d_model``).
        max_position_embeddings: ``P``.
        num_encoder_layers: ``encoder_layers``.
        num_layers: ``L``, the decoder layers.
        encoder_heads: ``encoder_attention_heads``.
        num_heads: ``N``, ``decoder_attention_heads``.
        encoder_ffn: ``encoder_ffn_dim``.
        intermediate_size: ``F``, ``decoder_ffn_dim``.
        activation: ``activation_function``, a key of ``layers.ACTIVATIONS``.
        scale_embedding: multiply token embeddings by ``sqrt(D)``.
        tie_word_embeddings: logits use ``model.shared``; no ``lm_head``.
        decoder_start_token_id: from config.json, or None.
        dtype: the activation and parameter dtype name.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    num_encoder_layers: int
    num_layers: int
    encoder_heads: int
    num_heads: int
    encoder_ffn: int
    intermediate_size: int
    activation: str = "gelu"
    scale_embedding: bool = False
    tie_word_embeddings: bool = True
    decoder_start_token_id: int | None = None
    dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        check_activation(self.activation, "activation_function")
        for heads in (self.encoder_heads, self.num_heads):
            if self.hidden_size % heads:
                raise UnsupportedError(
                    f"d_model ({self.hidden_size}) must be a multiple of the attention heads "
                    f"({heads})."
                )

    @property
    def head_dim(self) -> int:
        """``H = D // N``."""
        return self.hidden_size // self.num_heads

    @property
    def learned_positions(self) -> bool:
        """BART and mBART learn their position table; Marian's is sinusoidal."""
        return self.model_type != "marian"

    @property
    def pre_norm(self) -> bool:
        """mBART normalizes before each sublayer and after each stack."""
        return self.model_type == "mbart"

    @classmethod
    def from_hf(
        cls,
        config: Mapping[str, Any],
        dtype: str = "float32",
        ignore_config_keys: Iterable[str] = (),
    ) -> BartConfig:
        """Reads an HF BART / mBART / Marian ``config.json`` dict.

        Raises:
            UnsupportedError: naming a config key or value genjax does not implement.

        Example:
            >>> BartConfig.from_hf({"model_type": "marian", "d_model": 64}).learned_positions
            False
        """
        model_type = config.get("model_type", "bart")
        vouched = (*ignore_config_keys, "is_encoder_decoder")  # checked below instead
        _hf.check_keys(config, model_type, (*_DEFAULTS, *_ALIASES, *_HANDLED), _IGNORED, vouched)
        if not config.get("is_encoder_decoder", True):
            raise UnsupportedError(
                f"config.json sets is_encoder_decoder=false: a {model_type} decoder alone is not "
                "supported; load the full encoder-decoder checkpoint."
            )
        config = dict(config)
        for alias, name in _ALIASES.items():
            if alias in config:
                config[name] = config.pop(alias)

        def get(key):
            return _hf.read(config, key, _DEFAULTS)

        if not config.get("share_encoder_decoder_embeddings", True):
            raise UnsupportedError(
                "config.json sets share_encoder_decoder_embeddings=false (separate source and "
                "target vocabularies): not supported."
            )
        target_vocab = config.get("decoder_vocab_size")
        if target_vocab not in (None, get("vocab_size")):
            raise UnsupportedError(
                f"config.json sets decoder_vocab_size={target_vocab} != vocab_size="
                f"{get('vocab_size')}: separate target vocabularies are not supported."
            )
        return cls(
            model_type=model_type,
            vocab_size=get("vocab_size"),
            hidden_size=get("d_model"),
            max_position_embeddings=get("max_position_embeddings"),
            num_encoder_layers=get("encoder_layers"),
            num_layers=get("decoder_layers"),
            encoder_heads=get("encoder_attention_heads"),
            num_heads=get("decoder_attention_heads"),
            encoder_ffn=get("encoder_ffn_dim"),
            intermediate_size=get("decoder_ffn_dim"),
            activation=get("activation_function"),
            scale_embedding=bool(get("scale_embedding")),
            tie_word_embeddings=get("tie_word_embeddings") is not False,
            decoder_start_token_id=get("decoder_start_token_id"),
            dtype=dtype,
        )


_EPS = 1e-5  # torch.nn.LayerNorm's default, which these models use


class _Bart:
    """The forward pass over a params dict (functions of one config)."""

    def __init__(self, config: BartConfig):
        self.c = config
        self.dtype = jnp.dtype(config.dtype)

    def norm(self, p, x):
        return ed.layer_norm(p, x, _EPS, self.dtype)

    def embed(self, params, stack, ids, positions):
        c, dt = self.c, self.dtype
        x = ed.embed(params["model"]["shared"], ids, dt)
        x = x * jnp.asarray(ed.embed_scale(c.scale_embedding, c.hidden_size), dt)
        if c.learned_positions:
            table = params["model"][stack]["embed_positions"]
            x = x + ed.embed(table, positions + _OFFSET, dt)
            return self.norm(params["model"][stack]["layernorm_embedding"], x)
        table = ed.sinusoidal_table(c.max_position_embeddings, c.hidden_size)
        return x + jnp.take(table, positions, axis=0, mode="clip").astype(dt)

    def project(self, p, x, num_heads):
        return ed.heads(ed.dense(p, x, self.dtype), num_heads)

    def sublayer(self, p_norm, x, fn):
        """``x + fn(x)`` with the norm before (mBART) or after (BART, Marian)."""
        if self.c.pre_norm:
            return x + fn(self.norm(p_norm, x))
        return self.norm(p_norm, x + fn(x))

    def mlp(self, p, x):
        act = ACTIVATIONS[self.c.activation]
        return ed.dense(p["fc2"], act(ed.dense(p["fc1"], x, self.dtype)), self.dtype)

    def encode(self, params, ids, mask, record):
        c, dt = self.c, self.dtype
        enc = params["model"]["encoder"]
        length = ids.shape[1]
        x = self.embed(params, "encoder", ids, jnp.arange(length, dtype=jnp.int32))
        bias = ed.mask_bias(mask, length)
        scale = (c.hidden_size // c.encoder_heads) ** -0.5
        for i in range(c.num_encoder_layers):
            record.layer_input(x)
            layer = enc["layers"][str(i)]
            p = layer["self_attn"]

            def attend(h, p=p):
                q, k, v = (self.project(p[f"{n}_proj"], h, c.encoder_heads) for n in "qkv")
                mixed = ed.full_attention(q, k, v, bias, scale, record)
                return ed.dense(p["out_proj"], mixed, dt)

            x = self.sublayer(layer["self_attn_layer_norm"], x, attend)
            x = self.sublayer(layer["final_layer_norm"], x, lambda h, p=layer: self.mlp(p, h))
        x = self.norm(enc["layer_norm"], x) if c.pre_norm else x
        record.last(x)
        return x

    def cross_kv(self, params, layer, states):
        p = params["model"]["decoder"]["layers"][str(layer)]["encoder_attn"]
        states = states.astype(self.dtype)
        n = self.c.num_heads
        return self.project(p["k_proj"], states, n), self.project(p["v_proj"], states, n)

    def decode(self, params, tokens, cache, mask, logits_to_keep, record):
        c, dt = self.c, self.dtype
        dec = params["model"]["decoder"]
        length = tokens.shape[1]
        x = self.embed(params, "decoder", tokens, ed.slot_positions(cache, length)[None])
        bias = attention_bias(mask, cache.index, length, jnp.float32)
        scale = c.head_dim**-0.5
        for i in range(c.num_layers):
            record.layer_input(x)
            layer = dec["layers"][str(i)]

            def self_attend(h, p=layer["self_attn"], i=i):
                nonlocal cache
                q, k, v = (self.project(p[f"{n}_proj"], h, c.num_heads) for n in "qkv")
                keys, values, cache = cache.update_layer(i, k, v)
                mixed = ed.attend(q, keys, values, bias, scale, record, "decoder_attentions")
                return ed.dense(p["out_proj"], mixed, dt)

            def cross_attend(h, p=layer["encoder_attn"], i=i):
                q = self.project(p["q_proj"], h, c.num_heads)
                return ed.dense(p["out_proj"], ed.cross_attention(q, cache, i, scale, record), dt)

            x = self.sublayer(layer["self_attn_layer_norm"], x, self_attend)
            x = self.sublayer(layer["encoder_attn_layer_norm"], x, cross_attend)
            x = self.sublayer(layer["final_layer_norm"], x, lambda h, p=layer: self.mlp(p, h))
        if logits_to_keep and not record.hidden_states:  # the norm is per position: cut first
            x = x[:, -logits_to_keep:]
        if c.pre_norm:
            x = self.norm(dec["layer_norm"], x)
        record.last(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        if c.tie_word_embeddings:
            logits = linear(x, params["model"]["shared"]["embedding"], None, dt)
        else:
            logits = ed.dense(params["lm_head"], x, dt)
        return logits + params["final_logits_bias"][0].astype(dt), cache


@dataclasses.dataclass(frozen=True)
class BartModel(ed.EncoderDecoderBase):
    """A BART / mBART / Marian encoder-decoder: hashable and pure (see
    :mod:`genjax.models.encoder_decoder`).

    Example:
        >>> model, params = genjax.models.from_pretrained("Helsinki-NLP/opus-mt-en-de")
        ...  # doctest: +SKIP
    """

    config: BartConfig

    config_class = BartConfig
    hf_prefix = ""

    def is_hf_buffer(self, name: str) -> bool:
        """Tied token tables; Marian's stored sinusoidal tables (BART's are parameters)."""
        if re.fullmatch(r"model\.(encoder|decoder)\.embed_tokens\.weight", name):
            return True
        positions = re.fullmatch(r"model\.(encoder|decoder)\.embed_positions\.weight", name)
        return positions is not None and not self.config.learned_positions

    @property
    def num_kv_heads(self) -> int:
        """``K = N``."""
        return self.config.num_heads

    @property
    def decoder_start_token_id(self) -> int | None:
        """The first decoder token, from config.json."""
        return self.config.decoder_start_token_id

    def _encode(self, params, input_ids, attention_mask, record):
        return _Bart(self.config).encode(params, input_ids, attention_mask, record)

    def _cross_kv(self, params, layer, states):
        return _Bart(self.config).cross_kv(params, layer, states)

    def _decode(self, params, tokens, cache, attention_mask, logits_to_keep, record):
        bart = _Bart(self.config)
        return bart.decode(params, tokens, cache, attention_mask, logits_to_keep, record)

    def _shapes(self) -> dict[tuple[str, ...], tuple[int, ...]]:
        c = self.config
        d = c.hidden_size
        shapes = {("model", "shared", "embedding"): (c.vocab_size, d)}

        def norm(*path):
            shapes[(*path, "scale")] = (d,)
            shapes[(*path, "bias")] = (d,)

        def linear_(path, out, inp):
            shapes[(*path, "kernel")] = (out, inp)
            shapes[(*path, "bias")] = (out,)

        stacks = (
            ("encoder", c.num_encoder_layers, c.encoder_ffn),
            ("decoder", c.num_layers, c.intermediate_size),
        )
        for stack, count, ffn in stacks:
            root = ("model", stack)
            if c.learned_positions:
                shapes[(*root, "embed_positions", "embedding")] = (
                    c.max_position_embeddings + _OFFSET,
                    d,
                )
                norm(*root, "layernorm_embedding")
            for i in range(count):
                layer = (*root, "layers", str(i))
                attentions = ("self_attn", "encoder_attn") if stack == "decoder" else ("self_attn",)
                for attn in attentions:
                    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                        linear_((*layer, attn, proj), d, d)
                    norm(*layer, f"{attn}_layer_norm")
                linear_((*layer, "fc1"), ffn, d)
                linear_((*layer, "fc2"), d, ffn)
                norm(*layer, "final_layer_norm")
            if c.pre_norm:
                norm(*root, "layer_norm")
        if not c.tie_word_embeddings:
            shapes[("lm_head", "kernel")] = (c.vocab_size, d)
        shapes[("final_logits_bias",)] = (1, c.vocab_size)
        return shapes
