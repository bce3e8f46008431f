"""T5 (v1.0, v1.1, flan-t5) and mT5: an encoder-decoder with relative position buckets.

What makes T5 T5: no position embeddings but a learned bias per relative-position bucket and
head, computed by layer 0 of each stack and added to the scores of every layer (bidirectional
buckets in the encoder, causal ones in the decoder's self-attention, none in cross-attention);
no ``H ** -0.5`` score scaling; an RMS layer norm (no mean subtraction, no bias) before each
sublayer; bias-free linear layers. v1.0 has a ReLU MLP and a head tied to the embedding with
the decoder output rescaled by ``D ** -0.5``; v1.1 / flan-t5 / mT5 have a gated-GELU MLP
(``gelu_new``, the tanh approximation) and an untied head without the rescale.

Parameter tree (HF name = path joined by dots, ``kernel``/``scale``/``embedding`` ->
``weight``; no prefix; every kernel [out, in]; ``I = N * H``)::

    shared/embedding                                          [V, D]
    encoder/block/<i>/layer/0/SelfAttention/{q,k,v}/kernel    [I, D]
    encoder/block/<i>/layer/0/SelfAttention/o/kernel          [D, I]
    encoder/block/0/layer/0/SelfAttention/relative_attention_bias/embedding   [buckets, N]
    encoder/block/<i>/layer/0/layer_norm/scale                [D]
    encoder/block/<i>/layer/1/DenseReluDense/wi/kernel        [F, D]  (gated: wi_0 and wi_1)
    encoder/block/<i>/layer/1/DenseReluDense/wo/kernel        [D, F]
    encoder/block/<i>/layer/1/layer_norm/scale                [D]
    encoder/final_layer_norm/scale                            [D]
    decoder/block/<i>/layer/0/...                             self-attention, as the encoder's
    decoder/block/<i>/layer/1/EncDecAttention/{q,k,v,o}/kernel, layer/1/layer_norm/scale
    decoder/block/<i>/layer/2/DenseReluDense/..., layer/2/layer_norm/scale
    decoder/final_layer_norm/scale                            [D]
    lm_head/kernel                                            [V, D]  (untied only)

``encoder.embed_tokens.weight`` and ``decoder.embed_tokens.weight`` are ``shared.weight`` (skipped
at load when stored).

config.json keys (besides ``_hf.IGNORED_KEYS``):

    handled   vocab_size d_model d_kv d_ff num_layers num_decoder_layers num_heads
              relative_attention_num_buckets relative_attention_max_distance layer_norm_epsilon
              feed_forward_proj dense_act_fn is_gated_act (as transformers v5 saves them; they
              win over feed_forward_proj) tie_word_embeddings scale_decoder_outputs
              is_encoder_decoder (true only) decoder_start_token_id, and the aliases
              hidden_size num_attention_heads num_hidden_layers head_dim
    ignored   dropout_rate initializer_factor classifier_dropout (training only), n_positions
              output_past gradient_checkpointing (old configs; transformers does not read them)

The head: tied unless ``tie_word_embeddings`` is false (transformers v5 ties T5's head to
``shared`` and unties it only when a checkpoint stores a different ``lm_head.weight``, which is
what configs with ``tie_word_embeddings: false`` come with). The ``D ** -0.5`` rescale:
``scale_decoder_outputs`` when the config has it, else ``tie_word_embeddings`` not false, as
transformers v5 reads it; mT5 never rescales (transformers' MT5 model has no rescale).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import jax.numpy as jnp

from genjax.cache import attention_bias
from genjax.errors import UnsupportedError
from genjax.models import _hf
from genjax.models import encoder_decoder as ed
from genjax.models.layers import ACTIVATIONS, check_activation, linear
from genjax.typing import Array

_DEFAULTS = {
    "vocab_size": 32128,
    "d_model": 512,
    "d_kv": 64,
    "d_ff": 2048,
    "num_layers": 6,
    "num_decoder_layers": None,
    "num_heads": 8,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6,
    "feed_forward_proj": "relu",
    "tie_word_embeddings": True,
    "decoder_start_token_id": None,
}
_ALIASES = {
    "hidden_size": "d_model",
    "num_attention_heads": "num_heads",
    "num_hidden_layers": "num_layers",
    "head_dim": "d_kv",
}
_DERIVED = ("dense_act_fn", "is_gated_act", "scale_decoder_outputs", "is_encoder_decoder")
_IGNORED = (
    "dropout_rate",
    "initializer_factor",
    "classifier_dropout",
    "n_positions",
    "output_past",
    "gradient_checkpointing",
)


@dataclasses.dataclass(frozen=True)
class T5Config:
    """Static structure of a T5 / mT5 model (hashable).

    Attributes:
        model_type: ``"t5"`` or ``"mt5"``.
        vocab_size: ``V``.
        hidden_size: ``D`` (``d_model``).
        head_dim: ``H`` (``d_kv``; ``N * H`` need not equal ``D``).
        num_heads: ``N``.
        intermediate_size: ``F`` (``d_ff``).
        num_encoder_layers: ``num_layers``.
        num_layers: ``L``, the decoder layers (``num_decoder_layers``, default ``num_layers``).
        num_buckets: ``relative_attention_num_buckets``.
        max_distance: ``relative_attention_max_distance``.
        layer_norm_eps: ``layer_norm_epsilon``.
        activation: the MLP activation, a key of ``layers.ACTIVATIONS``.
        gated: a gated MLP (``wi_0``, ``wi_1``).
        tie_word_embeddings: logits use ``shared``; no ``lm_head``.
        scale_decoder_outputs: multiply the decoder output by ``D ** -0.5`` before the head.
        decoder_start_token_id: from config.json, or None.
        dtype: the activation and parameter dtype name.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    head_dim: int
    num_heads: int
    intermediate_size: int
    num_encoder_layers: int
    num_layers: int
    num_buckets: int = 32
    max_distance: int = 128
    layer_norm_eps: float = 1e-6
    activation: str = "relu"
    gated: bool = False
    tie_word_embeddings: bool = True
    scale_decoder_outputs: bool = True
    decoder_start_token_id: int | None = None
    dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        check_activation(self.activation, "feed_forward_proj")

    @property
    def max_position_embeddings(self) -> None:
        """None: relative positions put no hard limit on lengths."""
        return None

    @classmethod
    def from_hf(
        cls,
        config: Mapping[str, Any],
        dtype: str = "float32",
        ignore_config_keys: Iterable[str] = (),
    ) -> T5Config:
        """Reads an HF T5 / mT5 ``config.json`` dict.

        Raises:
            UnsupportedError: naming a config key or value genjax does not implement.

        Example:
            >>> T5Config.from_hf({"model_type": "t5", "feed_forward_proj": "gated-gelu"}).activation
            'gelu_new'
        """
        model_type = config.get("model_type", "t5")
        vouched = (*ignore_config_keys, "is_encoder_decoder")  # checked below instead
        _hf.check_keys(config, model_type, (*_DEFAULTS, *_ALIASES, *_DERIVED), _IGNORED, vouched)
        if not config.get("is_encoder_decoder", True):
            raise UnsupportedError(
                "config.json sets is_encoder_decoder=false: a T5 decoder or encoder alone is not "
                "supported; load the full encoder-decoder checkpoint."
            )
        config = dict(config)
        for alias, name in _ALIASES.items():
            if alias in config:
                config[name] = config.pop(alias)

        def get(key):
            return _hf.read(config, key, _DEFAULTS)

        proj = get("feed_forward_proj")
        parts = proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise UnsupportedError(
                f"feed_forward_proj={proj!r} is not valid; expected 'ACT' or 'gated-ACT', "
                "e.g. 'relu' or 'gated-gelu'."
            )
        activation = "gelu_new" if proj == "gated-gelu" else parts[-1]
        activation = config.get("dense_act_fn", activation)
        gated = bool(config.get("is_gated_act", parts[0] == "gated"))
        tied = get("tie_word_embeddings") is not False
        if model_type == "mt5":
            scale = False
        else:
            scale = bool(config.get("scale_decoder_outputs", tied))
        layers = get("num_layers")
        return cls(
            model_type=model_type,
            vocab_size=get("vocab_size"),
            hidden_size=get("d_model"),
            head_dim=get("d_kv"),
            num_heads=get("num_heads"),
            intermediate_size=get("d_ff"),
            num_encoder_layers=layers,
            num_layers=get("num_decoder_layers") or layers,
            num_buckets=get("relative_attention_num_buckets"),
            max_distance=get("relative_attention_max_distance"),
            layer_norm_eps=float(get("layer_norm_epsilon")),
            activation=activation,
            gated=gated,
            tie_word_embeddings=tied,
            scale_decoder_outputs=scale,
            decoder_start_token_id=get("decoder_start_token_id"),
            dtype=dtype,
        )


def relative_buckets(relative: Array, bidirectional: bool, num_buckets: int, max_distance: int):
    """T5's bucket of each relative position ``key - query`` (int32 in, int32 out).

    Half the buckets (a quarter per direction when bidirectional) hold exact small distances;
    the rest grow logarithmically up to ``max_distance``, beyond which all share the last one.
    Causal buckets count only keys before the query (later keys map to bucket 0 and are masked).

    References:
        Raffel et al., "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
        Transformer" (2020), section 2.1.
    """
    buckets = jnp.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).astype(jnp.int32) * num_buckets
        distance = jnp.abs(relative)
    else:
        distance = -jnp.minimum(relative, 0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # The same float32 operations in the same order as transformers, so that truncation agrees.
    ratio = jnp.log(distance.astype(jnp.float32) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (ratio * (num_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(jnp.where(is_small, 0, large), num_buckets - 1)
    return buckets + jnp.where(is_small, distance, large)


class _T5:
    """The forward pass over a params dict (functions of one config)."""

    def __init__(self, config: T5Config):
        self.c = config
        self.dtype = jnp.dtype(config.dtype)

    def norm(self, p, x):
        return ed.rms_norm(p, x, self.c.layer_norm_eps, self.dtype)

    def position_bias(self, table, query_positions, key_length: int, bidirectional: bool):
        """float32[1, N, T, S] from layer 0's bucket table [buckets, N]."""
        relative = jnp.arange(key_length, dtype=jnp.int32)[None, :] - query_positions[:, None]
        buckets = relative_buckets(relative, bidirectional, self.c.num_buckets, self.c.max_distance)
        values = ed.embed(table, buckets, jnp.float32)  # [T, S, N]
        return values.transpose(2, 0, 1)[None]

    def qkv(self, p, x, states=None):
        states = x if states is None else states
        n, dt = self.c.num_heads, self.dtype
        q = ed.heads(ed.dense(p["q"], x, dt), n)
        k = ed.heads(ed.dense(p["k"], states, dt), n)
        v = ed.heads(ed.dense(p["v"], states, dt), n)
        return q, k, v

    def mlp(self, p, x):
        dt, act = self.dtype, ACTIVATIONS[self.c.activation]
        if self.c.gated:
            h = act(ed.dense(p["wi_0"], x, dt)) * ed.dense(p["wi_1"], x, dt)
        else:
            h = act(ed.dense(p["wi"], x, dt))
        return ed.dense(p["wo"], h, dt)

    def encode(self, params, ids, mask, record):
        enc, dt = params["encoder"], self.dtype
        x = ed.embed(params["shared"], ids, dt)
        length = ids.shape[1]
        table = enc["block"]["0"]["layer"]["0"]["SelfAttention"]["relative_attention_bias"]
        positions = jnp.arange(length, dtype=jnp.int32)
        bias = ed.mask_bias(mask, length) + self.position_bias(table, positions, length, True)
        for i in range(self.c.num_encoder_layers):
            record.layer_input(x)
            block = enc["block"][str(i)]["layer"]
            attn = block["0"]["SelfAttention"]
            q, k, v = self.qkv(attn, self.norm(block["0"]["layer_norm"], x))
            x = x + ed.dense(attn["o"], ed.full_attention(q, k, v, bias, 1.0, record), dt)
            x = x + self.mlp(block["1"]["DenseReluDense"], self.norm(block["1"]["layer_norm"], x))
        x = self.norm(enc["final_layer_norm"], x)
        record.last(x)
        return x

    def cross_kv(self, params, layer, states):
        p = params["decoder"]["block"][str(layer)]["layer"]["1"]["EncDecAttention"]
        n, dt = self.c.num_heads, self.dtype
        states = states.astype(dt)
        return ed.heads(ed.dense(p["k"], states, dt), n), ed.heads(ed.dense(p["v"], states, dt), n)

    def decode(self, params, tokens, cache, mask, logits_to_keep, record):
        dec, dt = params["decoder"], self.dtype
        length = tokens.shape[1]
        x = ed.embed(params["shared"], tokens, dt)
        table = dec["block"]["0"]["layer"]["0"]["SelfAttention"]["relative_attention_bias"]
        queries = ed.slot_positions(cache, length)
        bias = attention_bias(mask, cache.index, length, jnp.float32) + self.position_bias(
            table, queries, cache.length, False
        )
        for i in range(self.c.num_layers):
            record.layer_input(x)
            block = dec["block"][str(i)]["layer"]
            attn = block["0"]["SelfAttention"]
            q, k, v = self.qkv(attn, self.norm(block["0"]["layer_norm"], x))
            keys, values, cache = cache.update_layer(i, k, v)
            mixed = ed.attend(q, keys, values, bias, 1.0, record, "decoder_attentions")
            x = x + ed.dense(attn["o"], mixed, dt)
            cross = block["1"]["EncDecAttention"]
            h = self.norm(block["1"]["layer_norm"], x)
            q = ed.heads(ed.dense(cross["q"], h, dt), self.c.num_heads)
            x = x + ed.dense(cross["o"], ed.cross_attention(q, cache, i, 1.0, record), dt)
            x = x + self.mlp(block["2"]["DenseReluDense"], self.norm(block["2"]["layer_norm"], x))
        if logits_to_keep and not record.hidden_states:  # the norm is per position: cut first
            x = x[:, -logits_to_keep:]
        x = self.norm(dec["final_layer_norm"], x)
        record.last(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        if self.c.scale_decoder_outputs:
            x = x * jnp.asarray(self.c.hidden_size**-0.5, dt)
        if self.c.tie_word_embeddings:
            return linear(x, params["shared"]["embedding"], None, dt), cache
        return ed.dense(params["lm_head"], x, dt), cache


@dataclasses.dataclass(frozen=True)
class T5Model(ed.EncoderDecoderBase):
    """A T5 / mT5 encoder-decoder: hashable and pure (see :mod:`genjax.models.encoder_decoder`).

    Example:
        >>> model, params = genjax.models.from_pretrained("google/flan-t5-small")
        ...  # doctest: +SKIP
    """

    config: T5Config

    config_class = T5Config
    hf_prefix = ""
    _hf_buffers = re.compile(
        r"^(encoder|decoder)\.embed_tokens\.weight$"
        r"|^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$"
    )

    @property
    def num_kv_heads(self) -> int:
        """``K = N``."""
        return self.config.num_heads

    @property
    def decoder_start_token_id(self) -> int | None:
        """The first decoder token, from config.json (T5 checkpoints use the pad id, 0)."""
        return self.config.decoder_start_token_id

    def _encode(self, params, input_ids, attention_mask, record):
        return _T5(self.config).encode(params, input_ids, attention_mask, record)

    def _cross_kv(self, params, layer, states):
        return _T5(self.config).cross_kv(params, layer, states)

    def _decode(self, params, tokens, cache, attention_mask, logits_to_keep, record):
        t5 = _T5(self.config)
        return t5.decode(params, tokens, cache, attention_mask, logits_to_keep, record)

    def _shapes(self) -> dict[tuple[str, ...], tuple[int, ...]]:
        c = self.config
        inner, d, f = c.num_heads * c.head_dim, c.hidden_size, c.intermediate_size
        shapes = {("shared", "embedding"): (c.vocab_size, d)}

        def attn(prefix, relative):
            for name in ("q", "k", "v"):
                shapes[(*prefix, name, "kernel")] = (inner, d)
            shapes[(*prefix, "o", "kernel")] = (d, inner)
            if relative:
                shapes[(*prefix, "relative_attention_bias", "embedding")] = (
                    c.num_buckets,
                    c.num_heads,
                )

        def mlp(prefix):
            for name in ("wi_0", "wi_1") if c.gated else ("wi",):
                shapes[(*prefix, name, "kernel")] = (f, d)
            shapes[(*prefix, "wo", "kernel")] = (d, f)

        for stack, count in (("encoder", c.num_encoder_layers), ("decoder", c.num_layers)):
            for i in range(count):
                block = (stack, "block", str(i), "layer")
                attn((*block, "0", "SelfAttention"), i == 0)
                shapes[(*block, "0", "layer_norm", "scale")] = (d,)
                if stack == "decoder":
                    attn((*block, "1", "EncDecAttention"), False)
                    shapes[(*block, "1", "layer_norm", "scale")] = (d,)
                last = "2" if stack == "decoder" else "1"
                mlp((*block, last, "DenseReluDense"))
                shapes[(*block, last, "layer_norm", "scale")] = (d,)
            shapes[(stack, "final_layer_norm", "scale")] = (d,)
        if not c.tie_word_embeddings:
            shapes[("lm_head", "kernel")] = (c.vocab_size, d)
        return shapes
