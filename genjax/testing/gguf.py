"""Tiny GGUF files written with the ``gguf`` package, as llama.cpp's converter lays them out."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

_GGUF_KEYS = {  # config.json key -> <arch>.<key>, as llama.cpp's convert_hf_to_gguf.py writes
    "llama": {
        "max_position_embeddings": "context_length",
        "num_hidden_layers": "block_count",
        "intermediate_size": "feed_forward_length",
        "hidden_size": "embedding_length",
        "num_attention_heads": "attention.head_count",
        "num_key_value_heads": "attention.head_count_kv",
        "rms_norm_eps": "attention.layer_norm_rms_epsilon",
        "vocab_size": "vocab_size",
    },
    "gpt2": {
        "n_layer": "block_count",
        "n_positions": "context_length",
        "n_embd": "embedding_length",
        "n_head": "attention.head_count",
        "layer_norm_epsilon": "attention.layer_norm_epsilon",
    },
}
_GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Offsets and values of the float16 scales in a K-quant block (random blocks need sane ones).
_K_SCALES = {"Q4_K": ((0, 2e-4), (2, 2e-4)), "Q5_K": ((0, 1e-4), (2, 1e-4)), "Q6_K": ((208, 4e-5),)}


def write_gguf(
    path: str | os.PathLike,
    config: dict[str, Any],
    tensors: dict[str, np.ndarray],
    qtype: str = "F32",
    *,
    name: str | None = None,
    tokenizer: dict[str, Any] | None = None,
    seed: int = 0,
) -> str:
    """Writes an HF checkpoint (``config.json`` dict + state dict) as a llama.cpp GGUF file.

    It does what llama.cpp's ``convert_hf_to_gguf.py`` does for these architectures: names
    through gguf's ``TensorNameMap``, Llama's q/k rows permuted for llama.cpp's rotary layout
    (``llama`` and ``mistral``, both written as architecture ``llama``, as llama.cpp does),
    GPT-2's ``Conv1D`` weights transposed
    to [out, in], no ``output.weight`` when the embeddings are tied. 1-D tensors stay F32.

    Args:
        path: the ``.gguf`` file to write.
        config: the ``config.json`` dict (model_type llama, mistral, qwen2 or gpt2).
        tensors: the float32 state dict, HF names with their prefix.
        qtype: the ggml type of every matrix: ``F32``, ``F16``, ``BF16``, or a block type.
            Block types gguf can quantize (``Q8_0``, ``Q4_0``...) quantize the matrices; the
            K types it cannot (``Q4_K``, ``Q5_K``, ``Q6_K``) get random blocks with small scales
            instead (seeded), so such a file tests decoding, not the checkpoint's values.
        name: ``general.name`` (default ``"tiny-<model_type>"``).
        tokenizer: ``tokenizer.ggml.*`` entries (``model``, ``tokens``, ``merges``,
            ``token_type``, ``scores``, ``bos_token_id``...) and ``chat_template``; None writes
            placeholder tokens.
        seed: the seed of random K-quant blocks.

    Example:
        >>> write_gguf("m.gguf", config, load_file("ckpt/model.safetensors"), "Q8_0")
        ...  # doctest: +SKIP
    """
    import gguf

    model_type = config["model_type"]
    arch = "llama" if model_type == "mistral" else model_type
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    writer.add_name(name or f"tiny-{model_type}")
    for key, gguf_key in _GGUF_KEYS["gpt2" if arch == "gpt2" else "llama"].items():
        if config.get(key) is not None:
            value = config[key]
            writer.add_key_value(f"{arch}.{gguf_key}", value, _gguf_value_type(gguf, value))
    if arch == "gpt2":
        inner = config.get("n_inner") or 4 * config["n_embd"]
        writer.add_key_value("gpt2.feed_forward_length", inner, gguf.GGUFValueType.UINT32)
    else:
        rope = config.get("rope_parameters") or {}
        writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 1e4))))
        if arch == "llama" and config.get("head_dim"):
            writer.add_rope_dimension_count(config["head_dim"])
    _write_tokenizer(
        writer, tokenizer or {"tokens": [f"<t{i}>" for i in range(config["vocab_size"])]}
    )
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], _layers(config))
    rng = np.random.default_rng(seed)
    for hf_name, array in tensors.items():
        array = np.asarray(array, np.float32)
        base, suffix = hf_name.rsplit(".", 1)
        target = f"{names.get_name(base)}.{suffix}"
        if arch == "gpt2" and hf_name.endswith(_GPT2_CONV1D):
            array = array.T
        if arch == "llama" and ".attn_q." in target:
            array = _permute_rows(array, config["num_attention_heads"])
        elif arch == "llama" and ".attn_k." in target:
            heads = config.get("num_key_value_heads") or config["num_attention_heads"]
            array = _permute_rows(array, heads)
        _add_tensor(
            gguf,
            writer,
            target,
            np.ascontiguousarray(array),
            qtype if array.ndim == 2 else "F32",
            rng,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)


def _layers(config: dict[str, Any]) -> int:
    return config.get("num_hidden_layers") or config["n_layer"]


def _gguf_value_type(gguf, value: Any):
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    return gguf.GGUFValueType.UINT32 if isinstance(value, int) else gguf.GGUFValueType.FLOAT32


def _write_tokenizer(writer, tokenizer: dict[str, Any]) -> None:
    writer.add_tokenizer_model(tokenizer.get("model", "gpt2"))
    if "pre" in tokenizer:
        writer.add_tokenizer_pre(tokenizer["pre"])
    writer.add_token_list(tokenizer["tokens"])
    for key, add in (
        ("token_type", writer.add_token_types),
        ("scores", writer.add_token_scores),
        ("merges", writer.add_token_merges),
        ("bos_token_id", writer.add_bos_token_id),
        ("eos_token_id", writer.add_eos_token_id),
        ("unknown_token_id", writer.add_unk_token_id),
        ("padding_token_id", writer.add_pad_token_id),
        ("add_bos_token", writer.add_add_bos_token),
        ("add_eos_token", writer.add_add_eos_token),
        ("chat_template", writer.add_chat_template),
    ):
        if tokenizer.get(key) is not None:
            add(tokenizer[key])


def _permute_rows(array: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation: per head, rows (half, pairs) -> (pairs, half)."""
    shape = array.shape
    return array.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _add_tensor(gguf, writer, name: str, array: np.ndarray, qtype: str, rng) -> None:
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        writer.add_tensor(name, array)
    elif qtype == "F16":
        writer.add_tensor(name, array.astype(np.float16))
    elif qtype in _K_SCALES:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        rows, cols = array.shape
        blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        for offset, scale in _K_SCALES[qtype]:
            values = scale * rng.uniform(0.5, 1.5, (rows, cols // block))
            blocks[..., offset : offset + 2] = (
                values.astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)
            )
        writer.add_tensor(name, blocks.reshape(rows, -1), raw_dtype=kind)
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
