"""Tiny random Hugging Face checkpoints (``config.json`` + safetensors), written without torch.

The tensor names and shapes are written out here by hand, from transformers' state dicts, so
that loading them checks ``genjax.models``' own name mapping rather than repeating it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

_T5_V1_0 = {  # ReLU MLP, head tied to the embedding with the D ** -0.5 rescale
    "model_type": "t5",
    "architectures": ["T5ForConditionalGeneration"],
    "vocab_size": 101,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
    "feed_forward_proj": "relu",
    "is_encoder_decoder": True,
    "tie_word_embeddings": True,
    "decoder_start_token_id": 0,
}
_ROTARY = {  # the sizes every tiny rotary decoder shares
    "vocab_size": 101,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
_GEMMA = {
    **_ROTARY,
    "head_dim": 16,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 12,
    "sliding_window": 4,
    "tie_word_embeddings": True,
}
_TINY = {
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 101,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "transformers_version": "5.0.0",
    },
    "mistral": {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 101,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_window": 4,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 101,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
        "tie_word_embeddings": False,
    },
    "qwen3": {
        **_ROTARY,
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
    },
    "olmo2": {
        **_ROTARY,
        "model_type": "olmo2",
        "architectures": ["Olmo2ForCausalLM"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "attention_bias": False,
    },
    "phi3": {
        **_ROTARY,
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        "original_max_position_embeddings": 8,
        "partial_rotary_factor": 0.5,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.5],
            "long_factor": [2.0, 4.0],
        },
        "sliding_window": None,
    },
    "gemma2": {
        **_GEMMA,
        "model_type": "gemma2",
        "architectures": ["Gemma2ForCausalLM"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0,
    },
    "gemma3_text": {
        **_GEMMA,
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "num_hidden_layers": 3,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "final_logit_softcapping": None,
    },
    "gpt2": {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": 101,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_inner": None,
        "n_positions": 64,
        "n_ctx": 64,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attn_pdrop": 0.1,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
    },
    "t5": _T5_V1_0,
    "t5_v1_1": {  # v1.1 / flan-t5: gated GELU, untied head, no rescale
        **_T5_V1_0,
        "num_decoder_layers": 3,
        "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False,
    },
    **{
        name: {
            "model_type": name,
            "vocab_size": 101,
            "d_model": 32,
            "max_position_embeddings": 64,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64,
            "activation_function": "swish" if name == "marian" else "gelu",
            "scale_embedding": name != "bart",
            "is_encoder_decoder": True,
            "tie_word_embeddings": True,
            "decoder_start_token_id": 2,
            "pad_token_id": 1,
        }
        for name in ("bart", "mbart", "marian")
    },
}


def tiny_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    """Returns a tiny HF ``config.json`` dict; an override of None removes the key.

    Example:
        >>> tiny_config("llama", num_hidden_layers=1)["num_hidden_layers"]
        1
    """
    if model_type not in _TINY:
        raise ValueError(f"model_type must be one of {sorted(_TINY)}, got {model_type!r}.")
    config = {**_TINY[model_type], **overrides}
    return {key: value for key, value in config.items() if value is not None}


def write_random_checkpoint(
    path: str | os.PathLike,
    model_type: str,
    *,
    seed: int = 0,
    dtype: str = "float32",
    num_shards: int = 1,
    prefix: bool = True,
    **config_overrides: Any,
) -> dict[str, Any]:
    """Writes ``config.json`` and random safetensors weights with HF names into ``path``.

    Weights are scaled so activations stay of order one (kernels ~ 1/sqrt(fan_in), norms near 1),
    which makes numeric comparisons meaningful.

    Args:
        path: the folder (created if needed).
        model_type: a preset of :func:`tiny_config`: ``"llama"``, ``"mistral"``, ``"qwen2"``,
            ``"qwen3"``, ``"olmo2"``, ``"phi3"``, ``"gemma2"``, ``"gemma3_text"``, ``"gpt2"``, or
            the encoder-decoders ``"t5"`` (v1.0), ``"t5_v1_1"``, ``"bart"``, ``"mbart"``,
            ``"marian"`` (whose names are always full: ``prefix`` is ignored).
        seed: the numpy seed.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: the stored dtype.
        num_shards: more than one writes ``model-0000i-of-0000n.safetensors`` plus
            ``model.safetensors.index.json``.
        prefix: keep the ``model.``/``transformer.`` prefix (a ``*ForCausalLM`` checkpoint);
            False writes base-model names.
        **config_overrides: ``config.json`` entries to set (None removes one).

    Returns:
        The config dict written.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     write_random_checkpoint(folder, "llama", tie_word_embeddings=True)["vocab_size"]
        101
    """
    config = tiny_config(model_type, **config_overrides)
    kind = config["model_type"]
    if kind == "gpt2":
        shapes = _gpt2_shapes(config)
    elif kind == "t5":
        shapes = _t5_shapes(config)
    elif kind in ("bart", "mbart", "marian"):
        shapes = _bart_shapes(config)
    else:
        shapes = _llama_shapes(config, model_type)
    rng = np.random.default_rng(seed)
    stored_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[
        dtype
    ]
    encoder_decoder = kind in ("t5", "bart", "mbart", "marian")  # names carry their prefix
    base_prefix = "transformer." if kind == "gpt2" else "" if encoder_decoder else "model."
    tensors = {}
    for name, shape in shapes.items():
        full = name if name.startswith("lm_head") or not prefix else base_prefix + name
        tensors[full] = _random(rng, name, shape).astype(stored_dtype)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _save(tensors, os.fspath(path), num_shards)
    return config


def _random(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    leaf = name.rsplit(".", 1)[-1]
    is_norm = "norm" in name or name.split(".")[-2:][0].startswith("ln_")
    if is_norm and leaf == "weight":
        return 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    if leaf == "bias":
        return 0.1 * rng.standard_normal(shape, dtype=np.float32)
    if name.endswith(("embed_tokens.weight", "wte.weight", "wpe.weight", "shared.weight")):
        return rng.standard_normal(shape, dtype=np.float32)
    fan_in = shape[0] if name.startswith("h.") else shape[-1]  # GPT-2 Conv1D is [in, out]
    return rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)


_SANDWICH_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def _llama_shapes(config: dict[str, Any], model_type: str) -> dict[str, tuple[int, ...]]:
    width, vocab = config["hidden_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or width // heads
    mlp = config["intermediate_size"]
    biased = ("llama", "qwen3", "olmo2", "gemma2", "gemma3_text")
    o_bias = model_type in biased and config.get("attention_bias", False)
    qkv_bias = model_type == "qwen2" or o_bias
    mlp_bias = model_type == "llama" and config.get("mlp_bias", False)
    norms = {
        "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm"),
        "gemma2": _SANDWICH_NORMS,
        "gemma3_text": _SANDWICH_NORMS,
    }.get(model_type, ("input_layernorm", "post_attention_layernorm"))
    qk_norms = {
        "qwen3": (head_dim, head_dim),
        "gemma3_text": (head_dim, head_dim),
        "olmo2": (heads * head_dim, kv_heads * head_dim),
    }.get(model_type)
    shapes = {"embed_tokens.weight": (vocab, width)}
    for i in range(config["num_hidden_layers"]):
        layer = f"layers.{i}."
        if model_type == "phi3":
            projections = {
                "self_attn.qkv_proj": ((heads + 2 * kv_heads) * head_dim, width, False),
                "self_attn.o_proj": (width, heads * head_dim, False),
                "mlp.gate_up_proj": (2 * mlp, width, False),
                "mlp.down_proj": (width, mlp, False),
            }
        else:
            projections = {
                "self_attn.q_proj": (heads * head_dim, width, qkv_bias),
                "self_attn.k_proj": (kv_heads * head_dim, width, qkv_bias),
                "self_attn.v_proj": (kv_heads * head_dim, width, qkv_bias),
                "self_attn.o_proj": (width, heads * head_dim, o_bias),
                "mlp.gate_proj": (mlp, width, mlp_bias),
                "mlp.up_proj": (mlp, width, mlp_bias),
                "mlp.down_proj": (width, mlp, mlp_bias),
            }
        for norm in norms:
            shapes[f"{layer}{norm}.weight"] = (width,)
        if qk_norms:
            shapes[layer + "self_attn.q_norm.weight"] = (qk_norms[0],)
            shapes[layer + "self_attn.k_norm.weight"] = (qk_norms[1],)
        for proj, (out, inp, bias) in projections.items():
            shapes[f"{layer}{proj}.weight"] = (out, inp)
            if bias:
                shapes[f"{layer}{proj}.bias"] = (out,)
    shapes["norm.weight"] = (width,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, width)
    return shapes


def _gpt2_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    width, vocab = config["n_embd"], config["vocab_size"]
    inner = config.get("n_inner") or 4 * width
    shapes = {"wte.weight": (vocab, width), "wpe.weight": (config["n_positions"], width)}
    for i in range(config["n_layer"]):
        block = f"h.{i}."
        for norm in ("ln_1", "ln_2"):
            shapes[f"{block}{norm}.weight"] = shapes[f"{block}{norm}.bias"] = (width,)
        for conv, (inp, out) in {
            "attn.c_attn": (width, 3 * width),
            "attn.c_proj": (width, width),
            "mlp.c_fc": (width, inner),
            "mlp.c_proj": (inner, width),
        }.items():
            shapes[f"{block}{conv}.weight"] = (inp, out)
            shapes[f"{block}{conv}.bias"] = (out,)
    shapes["ln_f.weight"] = shapes["ln_f.bias"] = (width,)
    if not config.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (vocab, width)
    return shapes


def _t5_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    width, inner = config["d_model"], config["num_heads"] * config["d_kv"]
    mlp, gated = config["d_ff"], config["feed_forward_proj"].startswith("gated")
    shapes = {"shared.weight": (config["vocab_size"], width)}
    layers = {"encoder": config["num_layers"], "decoder": config["num_decoder_layers"]}
    for stack, count in layers.items():
        for i in range(count):
            block = f"{stack}.block.{i}.layer."
            attentions = ["0.SelfAttention"] + (["1.EncDecAttention"] if stack == "decoder" else [])
            for attn in attentions:
                for proj in "qkv":
                    shapes[f"{block}{attn}.{proj}.weight"] = (inner, width)
                shapes[f"{block}{attn}.o.weight"] = (width, inner)
                shapes[f"{block}{attn[0]}.layer_norm.weight"] = (width,)
            if i == 0:
                buckets = config["relative_attention_num_buckets"]
                shapes[f"{block}0.SelfAttention.relative_attention_bias.weight"] = (
                    buckets,
                    config["num_heads"],
                )
            ff = f"{block}{len(attentions)}."
            for wi in ("wi_0", "wi_1") if gated else ("wi",):
                shapes[f"{ff}DenseReluDense.{wi}.weight"] = (mlp, width)
            shapes[f"{ff}DenseReluDense.wo.weight"] = (width, mlp)
            shapes[f"{ff}layer_norm.weight"] = (width,)
        shapes[f"{stack}.final_layer_norm.weight"] = (width,)
    if config.get("tie_word_embeddings") is False:
        shapes["lm_head.weight"] = (config["vocab_size"], width)
    return shapes


def _bart_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    width, vocab, kind = config["d_model"], config["vocab_size"], config["model_type"]
    shapes = {"model.shared.weight": (vocab, width)}
    for stack in ("encoder", "decoder"):
        root = f"model.{stack}."
        if kind != "marian":  # learned positions, with BART's offset of 2 rows
            shapes[root + "embed_positions.weight"] = (config["max_position_embeddings"] + 2, width)
            shapes[root + "layernorm_embedding.weight"] = (width,)
            shapes[root + "layernorm_embedding.bias"] = (width,)
        mlp = config[f"{stack}_ffn_dim"]
        for i in range(config[f"{stack}_layers"]):
            layer = f"{root}layers.{i}."
            for attn in ["self_attn"] + (["encoder_attn"] if stack == "decoder" else []):
                for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                    shapes[f"{layer}{attn}.{proj}.weight"] = (width, width)
                    shapes[f"{layer}{attn}.{proj}.bias"] = (width,)
                shapes[f"{layer}{attn}_layer_norm.weight"] = (width,)
                shapes[f"{layer}{attn}_layer_norm.bias"] = (width,)
            for fc, (out, inp) in {"fc1": (mlp, width), "fc2": (width, mlp)}.items():
                shapes[f"{layer}{fc}.weight"] = (out, inp)
                shapes[f"{layer}{fc}.bias"] = (out,)
            for leaf in ("weight", "bias"):
                shapes[f"{layer}final_layer_norm.{leaf}"] = (width,)
        if kind == "mbart":
            shapes[root + "layer_norm.weight"] = shapes[root + "layer_norm.bias"] = (width,)
    if config.get("tie_word_embeddings") is False:
        shapes["lm_head.weight"] = (vocab, width)
    shapes["final_logits_bias"] = (1, vocab)
    return shapes


def _save(tensors: dict[str, np.ndarray], path: str, num_shards: int) -> None:
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata=metadata)
        return
    names = list(tensors)
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::num_shards]}
        save_file(part, os.path.join(path, file), metadata=metadata)
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({**index, "weight_map": weight_map}, f, indent=2)


# ---------------------------------------------------------------------------- GGUF files
