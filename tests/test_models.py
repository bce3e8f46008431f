"""Models: loading HF-format checkpoints, cached decoding, config handling, and HF parity.

The default tests write tiny random checkpoints with ``genjax.testing`` (no torch, no network).
The ``parity`` tests build tiny random transformers models and compare logits.
"""

import dataclasses
import json
import os

import flax
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from genjax.cache import KVCache
from genjax.errors import CheckpointError, InputError, UnsupportedError
from genjax.kernels import rows as rows_kernel
from genjax.models import (
    GPT2Model,
    LlamaModel,
    Model,
    from_config,
    from_pretrained,
    layers,
)
from genjax.models import attention as attention_layer
from genjax.models import loading as loading_module
from genjax.models.rope import RopeConfig, inverse_frequencies
from genjax.testing import tiny_config, write_random_checkpoint

pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py

# (model_type, config overrides) of the architectures the numeric tests cover.
CASES = {
    "llama": ("llama", {}),
    "llama_bias_tied_llama3": (
        "llama",
        {
            "attention_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        },
    ),
    "llama_yarn": (
        "llama",
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
    ),
    "mistral_window4": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen2_window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1},
    ),
    "qwen3": ("qwen3", {}),
    "qwen3_window_bias": (
        "qwen3",
        {
            "use_sliding_window": True,
            "sliding_window": 3,
            "max_window_layers": 1,
            "attention_bias": True,
        },
    ),
    "olmo2": ("olmo2", {}),
    "olmo2_bias": ("olmo2", {"attention_bias": True}),
    # longrope factors are chosen per call: these never cross original_max_position_embeddings
    # between the prefill and the decode steps (long throughout, short throughout)
    "phi3_longrope_long": ("phi3", {"original_max_position_embeddings": 2}),
    "phi3_longrope_short": ("phi3", {"original_max_position_embeddings": 32}),
    "phi3_window": ("phi3", {"rope_parameters": None, "sliding_window": 3}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3_text", {}),
    "gpt2": ("gpt2", {}),
    "gpt2_untied": (
        "gpt2",
        {
            "tie_word_embeddings": False,
            "scale_attn_by_inverse_layer_idx": True,
            "reorder_and_upcast_attn": True,
            "activation_function": "gelu",
        },
    ),
}


def _load(tmp_path, model_type, **overrides):
    write_random_checkpoint(tmp_path, model_type, **overrides)
    return from_pretrained(tmp_path)


def _hf_positions(mask):
    """Position ids as transformers' generate makes them: cumsum(mask) - 1, padding -> 1."""
    mask = np.asarray(mask)
    return np.where(mask == 0, 1, np.cumsum(mask, -1) - 1).astype(np.int32)


def _batch(vocab, seed=0, lengths=(12, 9, 5), size=12):
    """A left-padded batch: int32 tokens [B, S] and mask [B, S] (row b has lengths[b] tokens)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (len(lengths), size)).astype(np.int32)
    mask = (np.arange(size)[None] >= size - np.asarray(lengths)[:, None]).astype(np.int32)
    return tokens, mask


def _full_forward(model, params, tokens, mask):
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    cache = model.init_cache(tokens.shape[0], tokens.shape[1])
    logits, cache = jax.jit(model.apply)(
        params, tokens, jnp.asarray(_hf_positions(mask)), cache, mask
    )
    return np.asarray(logits), cache


def _stepwise(model, params, tokens, mask, prefill):
    """Prefills ``prefill`` tokens, then decodes one at a time; returns float32[B, S, V]."""
    positions = jnp.asarray(_hf_positions(mask))
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    cache = model.init_cache(tokens.shape[0], tokens.shape[1])
    apply = jax.jit(model.apply)  # one program per width: eager runs op by op, 3-5x slower
    logits, cache = apply(params, tokens[:, :prefill], positions[:, :prefill], cache, mask)
    outputs = [logits]
    for t in range(prefill, tokens.shape[1]):
        logits, cache = apply(params, tokens[:, t : t + 1], positions[:, t : t + 1], cache, mask)
        outputs.append(logits)
    assert int(cache.index) == tokens.shape[1]
    return np.concatenate([np.asarray(o) for o in outputs], axis=1)


# ---------------------------------------------------------------------------------------------
# Loading


@pytest.mark.parametrize(
    "model_type",
    ["llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3", "gemma2", "gemma3_text", "gpt2"],
)
def test_loading_round_trip(tmp_path, model_type):
    write_random_checkpoint(tmp_path, model_type)
    model, params = from_pretrained(tmp_path)
    stored = load_file(os.path.join(tmp_path, "model.safetensors"))
    leaves = jax.tree_util.tree_leaves(params)
    assert len(leaves) == len(stored)
    assert all(leaf.dtype == jnp.float32 for leaf in leaves)
    assert isinstance(model, Model)
    if model_type == "gpt2":
        layer = params["h"]["1"]
        np.testing.assert_array_equal(
            layer["attn"]["c_attn"]["kernel"], stored["transformer.h.1.attn.c_attn.weight"].T
        )  # GPT-2's Conv1D stores [in, out]; genjax kernels are [out, in]
        np.testing.assert_array_equal(layer["ln_2"]["scale"], stored["transformer.h.1.ln_2.weight"])
        np.testing.assert_array_equal(params["wpe"]["embedding"], stored["transformer.wpe.weight"])
    else:
        layer = params["layers"]["1"]
        k_proj = "qkv_proj" if model_type == "phi3" else "k_proj"  # Phi-3's is fused
        np.testing.assert_array_equal(
            layer["self_attn"][k_proj]["kernel"],
            stored[f"model.layers.1.self_attn.{k_proj}.weight"],
        )
        np.testing.assert_array_equal(
            layer["mlp"]["down_proj"]["kernel"], stored["model.layers.1.mlp.down_proj.weight"]
        )
        np.testing.assert_array_equal(
            params["embed_tokens"]["embedding"], stored["model.embed_tokens.weight"]
        )
        if "lm_head.weight" in stored:  # Gemma ties its head to the embedding
            np.testing.assert_array_equal(params["lm_head"]["kernel"], stored["lm_head.weight"])
        if model_type == "qwen2":
            np.testing.assert_array_equal(
                layer["self_attn"]["q_proj"]["bias"], stored["model.layers.1.self_attn.q_proj.bias"]
            )
            assert "bias" not in layer["self_attn"]["o_proj"]


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_sharded_and_unprefixed_checkpoints_load_the_same(tmp_path, model_type):
    _, reference = _load(tmp_path / "single", model_type)
    _, sharded = _load(tmp_path / "sharded", model_type, num_shards=3)
    _, bare = _load(tmp_path / "bare", model_type, prefix=False)
    for other in (sharded, bare):
        jax.tree_util.tree_map(np.testing.assert_array_equal, reference, other)


def test_bfloat16_checkpoint_and_dtypes(tmp_path):
    write_random_checkpoint(tmp_path, "llama", dtype="bfloat16")
    stored = load_file(os.path.join(tmp_path, "model.safetensors"))
    model, params = from_pretrained(tmp_path)
    assert model.dtype == jnp.float32
    np.testing.assert_array_equal(
        params["norm"]["scale"], stored["model.norm.weight"].astype(np.float32)
    )
    model16, params16 = from_pretrained(tmp_path, dtype="bfloat16")
    assert model16.dtype == jnp.bfloat16
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(params16))
    assert model16.init_cache(1, 4).keys[0].dtype == jnp.bfloat16
    assert model16.init_cache(1, 4, dtype=jnp.float32).keys[0].dtype == jnp.float32
    tokens, mask = _batch(model.vocab_size)
    full32, _ = _full_forward(model, params, tokens, mask)
    full16, _ = _full_forward(model16, params16, tokens, mask)
    assert full16.dtype == np.float32
    real = mask.astype(bool)
    np.testing.assert_allclose(full16[real], full32[real], atol=0.25)


def test_raw_reader_matches_safetensors(tmp_path):
    write_random_checkpoint(tmp_path, "llama", dtype="bfloat16")
    file = os.path.join(tmp_path, "model.safetensors")
    header = loading_module._read_header(file)
    stored = load_file(file)
    for name in ("model.norm.weight", "lm_head.weight"):
        raw = loading_module._read_raw(file, header[name])
        assert raw.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(raw, stored[name])


def test_buffers_and_tied_head_in_checkpoint_are_skipped(tmp_path):
    write_random_checkpoint(tmp_path / "llama", "llama", tie_word_embeddings=True)
    write_random_checkpoint(tmp_path / "gpt2", "gpt2")
    extras = {
        "llama": {
            "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32),
            "lm_head.weight": np.ones((101, 32), np.float32),
        },
        "gpt2": {
            "transformer.h.0.attn.bias": np.ones((1, 1, 64, 64), np.float32),
            "transformer.h.0.attn.masked_bias": np.ones((), np.float32),
        },
    }
    for name, extra in extras.items():
        file = os.path.join(tmp_path / name, "model.safetensors")
        save_file({**load_file(file), **extra}, file)
        model, params = from_pretrained(tmp_path / name)
        assert "lm_head" not in params


def test_hub_ids_go_through_snapshot_download(tmp_path, monkeypatch):
    import huggingface_hub

    write_random_checkpoint(tmp_path, "gpt2")
    calls = []

    def fake_snapshot_download(**kwargs):
        calls.append(kwargs)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    model, _ = from_pretrained("org/tiny-gpt2", revision="v1", local_files_only=True, token="t")
    assert isinstance(model, GPT2Model)
    (call,) = calls
    assert call["repo_id"] == "org/tiny-gpt2" and call["revision"] == "v1"
    assert call["local_files_only"] is True and call["token"] == "t"
    assert "*.safetensors" in call["allow_patterns"] and "config.json" in call["allow_patterns"]
    assert not any(".bin" in pattern for pattern in call["allow_patterns"])


def test_hub_failure_is_a_checkpoint_error(monkeypatch):
    import huggingface_hub

    def failing(**kwargs):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(CheckpointError, match="org/missing.*offline"):
        from_pretrained("org/missing")


# ---------------------------------------------------------------------------------------------
# Checkpoint and config errors


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    write_random_checkpoint(tmp_path, "llama")
    file = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(8, np.float32)
    save_file(tensors, file)
    with pytest.raises(CheckpointError) as error:
        from_pretrained(tmp_path)
    assert "model.layers.1.mlp.up_proj.weight" in str(error.value)
    assert "model.layers.0.self_attn.q_norm.weight" in str(error.value)


def test_wrong_shape_is_named(tmp_path):
    write_random_checkpoint(tmp_path, "gpt2")
    file = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(file)
    tensors["transformer.h.0.mlp.c_fc.weight"] = np.ones((128, 32), np.float32)
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"h\.0\.mlp\.c_fc\.weight: expected \(32, 128\)"):
        from_pretrained(tmp_path)


def test_pickle_only_checkpoint_is_rejected(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump(tiny_config("llama"), f)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*safetensors"):
        from_pretrained(tmp_path)


def test_missing_or_corrupt_files_are_named(tmp_path):
    write_random_checkpoint(tmp_path / "sharded", "llama", num_shards=2)
    os.remove(tmp_path / "sharded" / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        from_pretrained(tmp_path / "sharded")
    (tmp_path / "corrupt").mkdir()
    write_random_checkpoint(tmp_path / "corrupt", "gpt2")
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        from_pretrained(tmp_path / "corrupt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        from_pretrained(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no checkpoint folder"):
        from_pretrained("./does/not/exist")


@pytest.mark.parametrize(
    "model_type, overrides, names",
    [
        ("bert", {}, ["'bert'", "llama, mistral, qwen2, qwen3", "gpt2"]),
        (
            "llama",
            {"rope_parameters": {"rope_type": "made_up", "rope_theta": 1.0}},
            ["'made_up'", "llama3", "longrope"],
        ),
        ("llama", {"rope_scaling": {"type": "su", "factor": 2.0}}, ["'su'"]),
        (
            "llama",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "beta": 1}},
            ["'beta'"],
        ),
        ("llama", {"hidden_act": "xielu"}, ["hidden_act='xielu'"]),
        ("llama", {"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping"]),
        ("llama", {"partial_rotary_factor": 0.5}, ["partial_rotary_factor"]),
        ("llama", {"quantization_config": {"quant_method": "awq"}}, ["quantization_config"]),
        ("llama", {"sliding_window": 4}, ["'sliding_window'"]),
        ("qwen2", {"use_mrope": True}, ["use_mrope"]),
        ("gpt2", {"add_cross_attention": True}, ["add_cross_attention"]),
        ("gpt2", {"activation_function": "mish"}, ["activation_function='mish'"]),
        ("mistral", {"some_new_key": 1}, ["'some_new_key'", "ignore_config_keys"]),
        ("qwen3", {"mlp_bias": True}, ["'mlp_bias'"]),
        ("olmo2", {"partial_rotary_factor": 0.5}, ["partial_rotary_factor"]),
        ("olmo2", {"attn_logit_softcapping": 5.0}, ["attn_logit_softcapping"]),
        ("gemma3_text", {"use_bidirectional_attention": True}, ["use_bidirectional_attention"]),
        ("gemma3_text", {"rope_parameters": {"rope_theta": 1.0}}, ["sliding_attention"]),
    ],
)
def test_unsupported_configs_are_named(model_type, overrides, names):
    config = tiny_config("llama" if model_type == "bert" else model_type, **overrides)
    config["model_type"] = model_type
    with pytest.raises(UnsupportedError) as error:
        from_config(config)
    for name in names:
        assert name in str(error.value)


def test_ignore_config_keys_vouches_for_unknown_keys():
    config = tiny_config("llama", some_new_key=1)
    with pytest.raises(UnsupportedError):
        from_config(config)
    assert from_config(config, ignore_config_keys=["some_new_key"]).num_layers == 2
    stale = {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 8}
    config = tiny_config("llama", rope_parameters=stale)
    with pytest.raises(UnsupportedError, match="original_max_position_embeddings"):
        from_config(config)
    model = from_config(config, ignore_config_keys=["original_max_position_embeddings"])
    assert model.config.rope.factor == 2.0


def test_bad_dtype_is_rejected(tmp_path):
    with pytest.raises(TypeError, match="floating"):
        from_config(tiny_config("llama"), dtype="int32")


# Real config.json files as transformers v4 wrote them (weights not needed).
LLAMA32_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
QWEN25_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MISTRAL01_CONFIG = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}
GPT2_CONFIG = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1,
    "bos_token_id": 50256,
    "embd_pdrop": 0.1,
    "eos_token_id": 50256,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2",
    "n_ctx": 1024,
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "resid_pdrop": 0.1,
    "summary_activation": None,
    "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True,
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257,
}


def test_real_configs_parse():
    assert from_config(LLAMA32_CONFIG).max_position_embeddings == 131072
    llama = from_config(LLAMA32_CONFIG).config
    assert (llama.head_dim, llama.num_kv_heads, llama.tie_word_embeddings) == (64, 8, True)
    assert llama.rope == RopeConfig(
        rope_type="llama3",
        theta=500000.0,
        dim=64,
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
        max_position_embeddings=131072,
    )
    qwen = from_config(QWEN25_CONFIG).config
    assert qwen.sliding_windows == (None,) * 24 and qwen.qkv_bias and not qwen.o_bias
    assert qwen.rope.theta == 1e6 and qwen.head_dim == 64
    mistral = from_config(MISTRAL01_CONFIG).config
    assert mistral.sliding_windows == (4096,) * 32 and mistral.head_dim == 128
    gpt2 = from_config(GPT2_CONFIG)
    assert gpt2.config.intermediate_size == 3072 and gpt2.max_position_embeddings == 1024
    assert from_config({**LLAMA32_CONFIG, "rope_scaling": None}).config.rope.rope_type == "default"


def test_qwen2_sliding_layers_follow_transformers():
    def windows(**overrides):
        return from_config(tiny_config("qwen2", num_hidden_layers=3, **overrides)).config

    assert windows(sliding_window=4).sliding_windows == (None, None, None)
    on = {"use_sliding_window": True, "sliding_window": 4}
    assert windows(**on, max_window_layers=1).sliding_windows == (None, 4, 4)
    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    assert windows(**on, layer_types=layer_types).sliding_windows == (4, None, 4)
    with pytest.raises(CheckpointError, match="layer_types"):
        windows(**on, layer_types=["local", "full_attention", "full_attention"])


def test_gemma_reads_its_layer_patterns_and_ropes():
    gemma2 = from_config(tiny_config("gemma2", num_hidden_layers=4)).config
    assert gemma2.sliding_windows == (4, None, 4, None) and gemma2.local_rope is None
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.norm_offset) == (2.0, 3.0, 1.0)
    gemma3 = from_config(
        tiny_config(
            "gemma3_text",
            num_hidden_layers=6,
            layer_types=None,
            sliding_window_pattern=3,
            rope_parameters=None,
            rope_theta=5e5,
            rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            attn_logit_softcapping=50.0,  # Gemma 3's attention ignores it, as in transformers
        )
    ).config
    assert gemma3.sliding_windows == (4, 4, None, 4, 4, None) and gemma3.attn_softcap is None
    assert (gemma3.rope.theta, gemma3.rope.rope_type, gemma3.rope.factor) == (5e5, "linear", 8.0)
    assert (gemma3.local_rope.theta, gemma3.local_rope.rope_type) == (100.0, "default")
    assert gemma3.qk_norm == "head" and gemma3.attention_scale == 12**-0.5


def test_phi3_reads_legacy_longrope_and_partial_rotary():
    phi3 = from_config(
        tiny_config("phi3", rope_parameters=None, rope_scaling={"type": "su", **_FACTORS})
    ).config
    assert phi3.rope.rope_type == "longrope" and phi3.rope.dim == 4 and phi3.fused_projections
    assert phi3.rope.attention_scaling == pytest.approx(2**0.5)  # sqrt(1 + ln 8 / ln 8)
    with pytest.raises(CheckpointError, match="short_factor"):
        from_config(tiny_config("phi3", partial_rotary_factor=1.0))  # 2 factors for 4 pairs
    phi4_mini_keys = {"full_attn_mod": 1, "interpolate_factor": 1, "lm_head_bias": False}
    assert from_config(tiny_config("phi3", mlp_bias=False, **phi4_mini_keys)).num_layers == 2


_FACTORS = {"short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]}


def test_legacy_rope_scaling_is_read():
    config = tiny_config(
        "llama",
        rope_parameters=None,
        rope_theta=500.0,
        rope_scaling={"type": "linear", "factor": 4},
    )
    rope = from_config(config).config.rope
    assert (rope.rope_type, rope.theta, rope.factor) == ("linear", 500.0, 4.0)
    base = inverse_frequencies(dataclasses.replace(rope, rope_type="default", factor=None))
    np.testing.assert_allclose(inverse_frequencies(rope), base / 4, rtol=1e-7)
    np.testing.assert_allclose(base, 1 / 500.0 ** (np.arange(0, 8, 2) / 8), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Numerics


# gemma2's eager pass is the slowest (13 s alone, near 30 s beside other tests); test_generate's
# recorded gemma2 cases check its cached decoding against transformers in the default run
@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c == "gemma2" else c for c in sorted(CASES)],
)
def test_cached_decoding_equals_full_forward(tmp_path, case):
    model_type, overrides = CASES[case]
    model, params = _load(tmp_path, model_type, **overrides)
    tokens, mask = _batch(model.vocab_size)
    full, cache = _full_forward(model, params, tokens, mask)
    assert full.shape == (3, 12, model.vocab_size) and full.dtype == np.float32
    assert int(cache.index) == 12
    real = mask.astype(bool)
    assert np.isfinite(full).all()
    # Ring layers (a window under 12 slots, genjax.cache.ring) read the same keys from W (+ T)
    # slots where the full layout reads 12: float32 sums in another order, a few ulps of logits
    # up to ~25 apart (gemma3: 1.3e-5).
    ring = model.init_cache(3, 12)
    rings = any(getattr(ring, "ring_slots", lambda _: None)(i) for i in range(len(ring.keys)))
    atol = 3e-5 if rings else 1e-5
    for prefill in (5,):
        steps = _stepwise(model, params, tokens, mask, prefill)
        np.testing.assert_allclose(steps[real], full[real], atol=atol, rtol=1e-5)
    positions = _hf_positions(mask)
    last, last_cache = jax.jit(model.apply, static_argnames="logits_to_keep")(
        params, tokens, positions, model.init_cache(3, 12), mask, logits_to_keep=1
    )
    assert last.shape == (3, 1, model.vocab_size)
    np.testing.assert_allclose(last[:, 0], full[:, -1], atol=1e-5, rtol=1e-5)
    # transformers' tensor form: the logits of the positions given, in their order.
    picked, _ = model.apply(
        params, tokens, positions, model.init_cache(3, 12), mask, jnp.asarray([7, 2], jnp.int32)
    )
    np.testing.assert_allclose(picked, full[:, [7, 2]], atol=1e-5, rtol=1e-5)
    for got, want in zip(last_cache.keys, cache.keys, strict=True):  # the cache is the same
        np.testing.assert_array_equal(got, want)  # (per layer: ring layers hold fewer slots)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_jit_equals_eager_and_compiles_once(tmp_path, model_type):
    model, params = _load(tmp_path, model_type)
    same_model = from_config(os.path.join(tmp_path, "config.json"))
    assert same_model == model and hash(same_model) == hash(model)

    def apply(model, params, tokens, positions, cache, mask):
        return model.apply(params, tokens, positions, cache, mask)

    jitted = jax.jit(apply, static_argnums=0)
    tokens, mask = _batch(model.vocab_size)
    positions = _hf_positions(mask)
    cache = model.init_cache(3, 12)
    eager, _ = apply(model, params, tokens, positions, cache, mask)
    compiled, new_cache = jitted(model, params, tokens, positions, cache, mask)
    np.testing.assert_allclose(compiled, eager, atol=1e-5, rtol=1e-5)
    assert isinstance(new_cache, KVCache)
    other_tokens, other_mask = _batch(model.vocab_size, seed=1, lengths=(3, 12, 7))
    jitted(same_model, params, other_tokens, _hf_positions(other_mask), cache, other_mask)
    assert jitted._cache_size() == 1


def test_sliding_window_changes_only_positions_beyond_it(tmp_path):
    model, params = _load(tmp_path, "mistral", sliding_window=4)
    full_model = LlamaModel(dataclasses.replace(model.config, sliding_windows=(None, None)))
    tokens, mask = _batch(model.vocab_size, lengths=(10,), size=10)
    windowed, _ = _full_forward(model, params, tokens, mask)
    unwindowed, _ = _full_forward(full_model, params, tokens, mask)
    np.testing.assert_allclose(windowed[0, :4], unwindowed[0, :4], atol=1e-6)
    for position in range(4, 10):
        assert np.abs(windowed[0, position] - unwindowed[0, position]).max() > 1e-3


def test_dynamic_rope_scales_only_past_the_trained_length(tmp_path):
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    model, params = _load(tmp_path, "llama", rope_parameters=dynamic, max_position_embeddings=8)
    plain = LlamaModel(dataclasses.replace(model.config, rope=RopeConfig(dim=8)))
    short_tokens, short_mask = _batch(model.vocab_size, lengths=(8,), size=8)
    np.testing.assert_allclose(
        _full_forward(model, params, short_tokens, short_mask)[0],
        _full_forward(plain, params, short_tokens, short_mask)[0],
        atol=1e-6,
    )
    long_tokens, long_mask = _batch(model.vocab_size, lengths=(12,), size=12)
    scaled = _full_forward(model, params, long_tokens, long_mask)[0]
    unscaled = _full_forward(plain, params, long_tokens, long_mask)[0]
    assert np.abs(scaled[0, 1:] - unscaled[0, 1:]).max() > 1e-3


def test_apply_validates_shapes(tmp_path):
    model, params = _load(tmp_path, "gpt2")
    cache = model.init_cache(2, 8)
    tokens = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(InputError, match="attention_mask"):
        model.apply(params, tokens, tokens, cache, jnp.ones((2, 3), jnp.int32))
    with pytest.raises(InputError, match="positions"):
        model.apply(params, tokens, tokens[:, :1], cache, jnp.ones((2, 8), jnp.int32))
    for bad in (-1, 1.5, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.float32)):
        with pytest.raises(InputError, match="logits_to_keep"):
            model.apply(params, tokens, tokens, cache, jnp.ones((2, 8), jnp.int32), bad)


def test_apply_names_a_param_of_the_wrong_shape(tmp_path):
    """The layers check stored shapes themselves (no initializer trace): a kernel from another
    width is named with both shapes, for a Dense kernel, a norm scale and the embedding."""
    model, params = _load(tmp_path, "llama")
    cache = model.init_cache(1, 4)
    tokens, mask = jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 4), jnp.int32)
    for path in (
        ("layers", "0", "mlp", "up_proj", "kernel"),
        ("layers", "1", "input_layernorm", "scale"),
        ("embed_tokens", "embedding"),
    ):
        broken = jax.tree_util.tree_map(lambda x: x, params)
        parent = broken
        for name in path[:-1]:
            parent = parent[name]
        good = parent[path[-1]]
        parent[path[-1]] = jnp.zeros(good.shape[:-1] + (good.shape[-1] + 1,), good.dtype)
        wrong = parent[path[-1]].shape
        with pytest.raises(flax.errors.ScopeParamShapeError, match=path[-2]) as error:
            model.apply(broken, tokens, tokens, cache, mask)
        assert str(good.shape) in str(error.value) and str(wrong) in str(error.value)


@pytest.mark.parametrize("kv_heads, groups", [(3, 3), (4, 1)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_attention_equals_the_prompt_path(kv_heads, groups, dtype):
    """One query token takes the multiply-and-sum path; it must match the matrix-product path
    (taken for T > 1) on the same token, with padding slots masked out."""
    rng = np.random.default_rng(0)
    batch, slots, head_dim = 2, 40, 16
    queries = jnp.asarray(rng.standard_normal((batch, 1, kv_heads * groups, head_dim)), dtype)
    keys, values = (
        jnp.asarray(rng.standard_normal((batch, kv_heads, slots, head_dim)), dtype)
        for _ in range(2)
    )
    keys = jnp.swapaxes(keys, 2, 3)  # the cache's [B, K, H, S]
    bias = jnp.asarray(np.where(rng.random((batch, 1, 1, slots)) < 0.3, -1e9, 0.0), jnp.float32)
    one = attention_layer.attention(queries, keys, values, bias, 0.25)
    two = attention_layer.attention(
        jnp.concatenate([queries, queries], 1), keys, values, jnp.concatenate([bias, bias], 2), 0.25
    )
    assert one.shape == (batch, 1, kv_heads * groups * head_dim) and one.dtype == dtype
    tolerance = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(
        np.asarray(one, np.float32), np.asarray(two[:, :1], np.float32), atol=tolerance
    )
    assert float(jnp.max(jnp.abs(one.astype(jnp.float32)))) > 0.1  # not all zeros


@pytest.mark.parametrize("kv_heads, groups", [(3, 3), (4, 1)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("upcast", [False, True])
@pytest.mark.parametrize("length", [1, 6])
def test_attention_matches_a_float64_reference(kv_heads, groups, dtype, upcast, length):
    """T > 1 query tokens take the [G*T, H] x [H, S] layout, one token the multiply-and-sum
    path; both must compute grouped-query attention with a causal, padded bias, in float32 and
    in bfloat16 (rounded as transformers rounds: scores, weights and output in the input
    dtype), jitted or not."""
    rng = np.random.default_rng(2)
    batch, slots, head_dim, scale = 2, 9, 16, 0.25
    queries = jnp.asarray(rng.standard_normal((batch, length, kv_heads * groups, head_dim)), dtype)
    keys, values = (
        jnp.asarray(rng.standard_normal((batch, kv_heads, slots, head_dim)), dtype)
        for _ in range(2)
    )
    visible = np.arange(slots)[None, :] <= np.arange(length)[:, None] + 2  # 2 earlier slots
    visible = visible[None] & (np.arange(slots) != 1)[None, None]  # slot 1 is padding
    bias = jnp.asarray(np.where(visible, 0.0, -1e9)[:, None], jnp.float32)  # [1, 1, T, S]
    bias = jnp.broadcast_to(bias, (batch, 1, length, slots))
    q, k, v = (np.asarray(a, np.float64) for a in (queries, keys, values))
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)  # [B, N, S, H]
    keys = jnp.swapaxes(keys, 2, 3)  # the cache's [B, K, H, S]
    scores = np.einsum("btnh,bnsh->bnts", q, k) * scale + np.asarray(bias)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = np.einsum("bnts,bnsh->btnh", weights, v).reshape(batch, length, -1)
    tolerance = 1e-5 if dtype == jnp.float32 else 3e-2
    for call in (
        attention_layer.attention,
        jax.jit(attention_layer.attention, static_argnums=(4, 5)),
    ):
        out = call(queries, keys, values, bias, scale, upcast)
        assert out.shape == (batch, length, kv_heads * groups * head_dim) and out.dtype == dtype
        np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=tolerance)
    assert np.abs(expected).max() > 0.5  # not a trivially small output


@pytest.mark.parametrize("lead", [(1, 1), (3, 1), (8, 1), (2, 8), (17, 1), (4, 9)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_equals_the_plain_product_at_every_row_count(lead, dtype):
    """2-16 rows take the swapped product on CPU (weight @ x.T, then a transpose); one row and
    more than 16 the plain one. All must equal x @ w.T, jitted or not."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((*lead, 48)), dtype)
    weight = jnp.asarray(rng.standard_normal((40, 48)), dtype)
    expected = np.asarray(x, np.float64) @ np.asarray(weight, np.float64).T
    tolerance = 1e-4 if dtype == jnp.float32 else 0.1
    for call in (layers.linear, jax.jit(layers.linear, static_argnums=(2, 3))):
        y = call(x, weight, None, dtype)
        assert y.shape == (*lead, 40) and y.dtype == dtype
        np.testing.assert_allclose(np.asarray(y, np.float64), expected, atol=tolerance)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the swapped product is CPU-only")
def test_linear_with_a_few_rows_multiplies_weight_by_rows_on_cpu():
    """Where genjax's CPU kernel does not run (here: traced under ``rows.disabled()``; also
    widths not a multiple of 16, a compiler missing), the compiled CPU program of an 8-row
    product holds a [out, 8] product, not [8, out]."""
    x, weight = jnp.ones((8, 1, 48)), jnp.ones((40, 48))
    with rows_kernel.disabled():  # a new function: jit's cache holds linear's kernel traces
        hlo = jax.jit(lambda x, w: layers.linear(x, w, None, jnp.float32)).lower(x, weight)
        one_row = jax.jit(lambda x, w: layers.linear(x, w, None, jnp.float32)).lower(x[:1], weight)
    text = hlo.compile().as_text()
    assert "f32[40,8]" in text and "dot(" in text
    assert "f32[40,1]" not in one_row.compile().as_text()


def test_init_params_matches_the_loaded_tree(tmp_path):
    model, params = _load(tmp_path, "qwen2")
    fresh = model.init_params(jax.random.key(0))
    assert jax.tree_util.tree_structure(fresh) == jax.tree_util.tree_structure(params)
    shapes = jax.tree_util.tree_map(lambda x: x.shape, fresh)
    assert shapes == jax.tree_util.tree_map(lambda x: x.shape, params)


# ---------------------------------------------------------------------------------------------
# Parity with transformers (needs torch + transformers: `pytest -m parity`)


def _hf_cases():
    import transformers as tf

    small = {
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    }
    gpt2 = {
        "vocab_size": 100,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 64,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }

    gemma = {**small, "head_dim": 16, "query_pre_attn_scalar": 12, "sliding_window": 4}  # tied

    def phi3_longrope(partial, count):
        return {
            "pad_token_id": None,  # Phi-3's default 32000 is outside the tiny vocabulary
            "partial_rotary_factor": partial,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.5 * i for i in range(count)],
                "long_factor": [2.0 + i for i in range(count)],
            },
        }

    return {
        "llama_gqa_bias": (tf.LlamaConfig, {**small, "attention_bias": True, "mlp_bias": True}),
        "llama3_tied": (
            tf.LlamaConfig,
            {**small, "rope_parameters": llama3, "tie_word_embeddings": True},
        ),
        "llama_linear": (
            tf.LlamaConfig,
            {**small, "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
        ),
        "llama_dynamic": (
            tf.LlamaConfig,
            {
                **small,
                "max_position_embeddings": 8,
                "rope_parameters": {"rope_type": "dynamic", "factor": 2.0},
            },
        ),
        "llama_yarn": (
            tf.LlamaConfig,
            {
                **small,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            },
        ),
        "llama_head_dim": (tf.LlamaConfig, {**small, "head_dim": 16}),
        "qwen2": (tf.Qwen2Config, small),
        "qwen2_window": (
            tf.Qwen2Config,
            {**small, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        ),
        "mistral_window": (tf.MistralConfig, {**small, "sliding_window": 4, "head_dim": 16}),
        "qwen3": (tf.Qwen3Config, {**small, "head_dim": 16}),
        "qwen3_window_bias": (
            tf.Qwen3Config,
            {
                **small,
                "attention_bias": True,
                "use_sliding_window": True,
                "sliding_window": 4,
                "max_window_layers": 1,
            },
        ),
        "olmo2": (tf.Olmo2Config, small),
        "olmo2_bias": (tf.Olmo2Config, {**small, "attention_bias": True}),
        "phi3_long_partial": (
            tf.Phi3Config,
            {**small, "original_max_position_embeddings": 8, **phi3_longrope(0.5, 2)},
        ),
        "phi3_short_partial": (
            tf.Phi3Config,
            {**small, "original_max_position_embeddings": 32, **phi3_longrope(0.75, 3)},
        ),
        "phi3_window": (tf.Phi3Config, {**small, "sliding_window": 4, "pad_token_id": None}),
        "gemma2": (
            tf.Gemma2Config,
            {**gemma, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},
        ),
        "gemma3": (
            tf.Gemma3TextConfig,
            {
                **gemma,
                "num_hidden_layers": 3,
                "sliding_window_pattern": 3,
                "final_logit_softcapping": 5.0,
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                },
            },
        ),
        "gpt2": (tf.GPT2Config, gpt2),
        "gpt2_variants": (
            tf.GPT2Config,
            {
                **gpt2,
                "tie_word_embeddings": False,
                "scale_attn_by_inverse_layer_idx": True,
                "reorder_and_upcast_attn": True,
                "activation_function": "gelu",
            },
        ),
    }


PARITY_CASES = [
    "llama_gqa_bias",
    "llama3_tied",
    "llama_linear",
    "llama_dynamic",
    "llama_yarn",
    "llama_head_dim",
    "qwen2",
    "qwen2_window",
    "mistral_window",
    "qwen3",
    "qwen3_window_bias",
    "olmo2",
    "olmo2_bias",
    "phi3_long_partial",
    "phi3_short_partial",
    "phi3_window",
    "gemma2",
    "gemma3",
    "gpt2",
    "gpt2_variants",
]


@pytest.mark.parity
@pytest.mark.parametrize("case", PARITY_CASES)
def test_parity_with_transformers(tmp_path, case):
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    config_class, kwargs = _hf_cases()[case]
    torch.manual_seed(0)
    hf_model = tf.AutoModelForCausalLM.from_config(
        config_class(**kwargs), attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            noise = torch.randn_like(param)
            if param.ndim > 1:
                param.copy_(noise / param.shape[-1] ** 0.5 * 2)
            elif "ln_" in name or "norm" in name:
                param.copy_(1 + 0.1 * noise) if name.endswith("weight") else param.copy_(noise / 10)
            else:
                param.copy_(noise / 10)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)

    model, params = from_pretrained(tmp_path)
    tokens, mask = _batch(100, seed=3)
    positions = _hf_positions(mask)
    with torch.no_grad():
        expected = hf_model(
            input_ids=torch.from_numpy(tokens).long(),
            attention_mask=torch.from_numpy(mask).long(),
            position_ids=torch.from_numpy(positions).long(),
            use_cache=False,
        ).logits.numpy()
    got, _ = _full_forward(model, params, tokens, mask)
    real = mask.astype(bool)
    assert np.abs(expected[real]).max() > 1.0  # the comparison is not trivially small
    np.testing.assert_allclose(got[real], expected[real], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------- config.json fidelity


def test_common_pretrained_config_attributes_are_accepted():
    # Attributes every transformers v5 config may carry (PreTrainedConfig's fields and the
    # kwargs it pops): a checkpoint converted by transformers carries e.g. unk_token_id.
    common = {
        "unk_token_id": 0,
        "attn_implementation": "eager",
        "name_or_path": "x",
        "epsilon_cutoff": 0.0,
        "num_assistant_tokens": 20,
    }
    for model_type in ("llama", "qwen2", "gpt2"):
        assert from_config(tiny_config(model_type, **common)).num_layers == 2
    with pytest.raises(UnsupportedError, match="'my_arch_key'"):
        from_config(tiny_config("llama", unk_token_id=0, my_arch_key=3))


def test_float64_without_x64_is_refused(tmp_path):
    write_random_checkpoint(tmp_path, "llama")
    with pytest.raises(TypeError, match="jax_enable_x64"):
        from_pretrained(tmp_path, dtype="float64")
    with pytest.raises(TypeError, match="jax_enable_x64"):
        from_config(tiny_config("llama"), dtype=np.float64)


def test_truncated_safetensors_is_a_checkpoint_error(tmp_path):
    write_random_checkpoint(tmp_path, "llama")
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="model.safetensors is truncated") as error:
        from_pretrained(tmp_path)
    assert "again" in str(error.value)
