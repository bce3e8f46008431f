"""Reading llama.cpp GGUF files: the config from the metadata, params dequantized to a float dtype.

A GGUF file holds the model's shape as metadata (``llama.block_count``, ``llama.embedding_length``
...), the tokenizer (read by :mod:`genjax.io.gguf_tokenizer`) and every tensor, each in its own
ggml type. Files are read with the ``gguf`` package (``GGUFReader`` memory-maps the file;
``gguf.quants.dequantize`` expands each block type), one tensor at a time, so host memory stays
near the size of the float params.

The conversion follows transformers v5 (``modeling_gguf_pytorch_utils.py``,
``integrations/ggml.py``), so a file loads to the same model in both:

* ``general.architecture`` picks the model: ``llama``, ``qwen2``, ``gpt2``. llama.cpp writes
  Mistral checkpoints as ``llama`` files (no sliding window: llama.cpp attends over everything),
  so they load as Llama models. (transformers 5.24 would read a file whose ``general.name`` is
  exactly ``"mistral"`` as a Mistral, but cannot map its tensors with gguf 0.19; genjax refuses
  that name rather than guess.)
* Metadata keys become ``config.json`` keys (``_CONFIG_KEYS``); the vocabulary size is
  ``<arch>.vocab_size``, else the number of tokens; ``tie_word_embeddings`` is true when the file
  has no ``output.weight``. ``attention.key_length``/``value_length`` must equal the head size.
  A key under ``<arch>.`` that genjax does not read is refused by name.
* Tensor names map through gguf's own ``TensorNameMap`` (``blk.0.attn_q.weight`` is
  ``model.layers.0.self_attn.q_proj.weight``). llama.cpp permutes the rows of Llama's q and k
  projections (for its rotary layout); that permutation is undone here. GPT-2's ``Conv1D``
  weights are stored [out, in], which is genjax's kernel layout already.

Supported tensor types: ``SUPPORTED_TYPES`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
Q5_K, Q6_K). The params are float (dequantized), so a Q4 file takes the memory of its float
weights once loaded, unless ``from_pretrained(..., quantize="int4")`` asks to keep its Q4_0 and
Q4_1 kernels packed (:mod:`genjax.kernels.q4` uses their block layout).

Static or traced: nothing here is traced; it runs on the host before ``jit``.

Example:
    >>> model, params = genjax.models.from_pretrained("SmolLM2-135M-Instruct.Q4_1.gguf")
    ...  # doctest: +SKIP
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from genjax.errors import CheckpointError, UnsupportedError
from genjax.models.gpt2 import GPT2Model
from genjax.models.llama import LlamaModel
from genjax.typing import PyTree

SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
_LLAMA_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# <arch>.<key> -> config.json key (None: read but not used, as transformers does).
_CONFIG_KEYS = {
    "llama": _LLAMA_KEYS,
    "qwen2": {**_LLAMA_KEYS, "rope.dimension_count": None},
    "gpt2": {
        "block_count": "n_layer",
        "context_length": "n_positions",  # transformers sets n_ctx and keeps n_positions 1024
        "embedding_length": "n_embd",
        "feed_forward_length": "n_inner",
        "attention.head_count": "n_head",
        "attention.layer_norm_epsilon": "layer_norm_epsilon",
        "vocab_size": "vocab_size",
    },
}
_HEAD_DIM_KEYS = ("attention.key_length", "attention.value_length")  # checked, not used
_MODELS = {"llama": LlamaModel, "qwen2": LlamaModel, "gpt2": GPT2Model}
_IGNORED_PREFIXES = ("GGUF.", "general.", "tokenizer.", "split.")
_MAX_NAMES = 20
_CHUNK_BYTES = 8 << 20  # float32 bytes dequantized at once
_Q4 = {"Q4_0": 2, "Q4_1": 4}  # bytes before a block's 16 bytes of nibbles: d, or d and m


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file (by its ``.gguf`` suffix)."""
    return os.fspath(path).lower().endswith(".gguf")


def open_file(path: str | os.PathLike):
    """Opens ``path`` with ``gguf.GGUFReader`` (memory-mapped), turning failures into one error.

    Raises:
        CheckpointError: the file is missing, not GGUF, or cut short.
    """
    from gguf import GGUFReader

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"no GGUF file at {path!r}.")
    try:
        return GGUFReader(path)
    except Exception as error:  # noqa: BLE001 - gguf raises ValueError, IndexError, struct.error
        raise CheckpointError(
            f"{path} is not a readable GGUF file ({type(error).__name__}: {error}). It may be "
            "truncated or not GGUF at all; fetch it again, or check that it is a llama.cpp .gguf."
        ) from None


def read_metadata(reader) -> dict[str, Any]:
    """The file's metadata as plain Python values (strings, numbers, lists)."""
    metadata = {}
    for name, field in reader.fields.items():
        value = field.contents()
        metadata[name] = value.tolist() if isinstance(value, np.ndarray) else value
    return metadata


def hf_config(
    metadata: Mapping[str, Any], tensor_names: Iterable[str], ignore_config_keys=()
) -> dict[str, Any]:
    """The ``config.json`` dict transformers builds from a GGUF file's metadata.

    Args:
        metadata: :func:`read_metadata`'s dict.
        tensor_names: the names of the file's tensors (for ``tie_word_embeddings``).
        ignore_config_keys: metadata keys (``"llama.expert_count"``) the caller vouches for.

    Raises:
        UnsupportedError: an architecture or a metadata key genjax does not implement.

    Example:
        >>> hf_config({"general.architecture": "llama", "llama.block_count": 2,
        ...            "llama.vocab_size": 8}, ["output.weight"])["num_hidden_layers"]
        2
    """
    arch = metadata.get("general.architecture")
    if arch not in _CONFIG_KEYS:
        raise UnsupportedError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(_CONFIG_KEYS)}."
        )
    split_count = metadata.get("split.count", 1)
    if split_count != 1:
        raise UnsupportedError(
            f"this GGUF file is one of {split_count} parts; merge them first with "
            "`llama-gguf-split --merge first-part.gguf merged.gguf`."
        )
    keys = _CONFIG_KEYS[arch]
    if arch == "llama" and metadata.get("general.name") == "mistral":
        raise UnsupportedError(
            "this llama GGUF file is named exactly 'mistral', which transformers reads as a "
            "Mistral with a 4096-token sliding window the file does not state; genjax does not "
            "guess. Rename it (gguf's gguf_set_metadata.py general.name) to load it as a Llama."
        )
    config: dict[str, Any] = {"model_type": arch}
    unknown, head_dims = [], {}
    for name, value in metadata.items():
        if name.startswith(_IGNORED_PREFIXES) or name in ignore_config_keys:
            continue
        key = name[len(arch) + 1 :] if name.startswith(arch + ".") else None
        if arch != "gpt2" and key in _HEAD_DIM_KEYS:
            head_dims[name] = value
        elif key not in keys:
            unknown.append(name)
        elif keys[key] is not None:
            config[keys[key]] = value
    if unknown:
        raise UnsupportedError(
            f"the GGUF metadata has key(s) {sorted(unknown)} that genjax does not read; they may "
            "change the forward pass. If you are sure they do not, pass "
            f"from_pretrained(..., ignore_config_keys={sorted(unknown)})."
        )
    if head_dims:  # newer llama.cpp states the head size; genjax derives it
        heads = config.get("num_attention_heads")
        derived = config.get("head_dim") or (heads and config.get("hidden_size", 0) // heads)
        if any(value != derived for value in head_dims.values()):
            raise UnsupportedError(
                f"the GGUF metadata states head sizes {head_dims}, but the model's head size is "
                f"{derived}; separate key/value head sizes are not supported."
            )
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in metadata:
        config["vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    config["tie_word_embeddings"] = "output.weight" not in set(tensor_names)
    return config


def generation_defaults(metadata: Mapping[str, Any]) -> dict[str, int]:
    """The special token ids the file states: ``bos_token_id``, ``eos_token_id``,
    ``pad_token_id`` (for a ``GenerationConfig``; absent ids are left out)."""
    names = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
    found = {key: metadata.get(f"tokenizer.ggml.{name}_token_id") for key, name in names.items()}
    return {key: int(value) for key, value in found.items() if value is not None}


def load(
    path: str | os.PathLike,
    dtype: Any,
    ignore_config_keys: Iterable[str] = (),
    keep_int4: bool = False,
):
    """Reads a GGUF file into ``(model, params)``.

    Args:
        path: the ``.gguf`` file.
        dtype: the params' numpy dtype (already canonical, e.g. ``np.dtype("float32")``).
        ignore_config_keys: metadata keys the caller vouches for.
        keep_int4: keep Q4_0 and Q4_1 linear kernels as genjax 4-bit leaves (``kernel_q4``,
            ``kernel_q4_scale``, ``kernel_q4_min``; the same values, exactly) instead of
            dequantizing them.

    Returns:
        ``(model, params)`` as :func:`genjax.models.from_pretrained` returns them.

    Raises:
        CheckpointError: an unreadable file, missing, unexpected or misshapen tensors.
        UnsupportedError: an architecture, metadata key or tensor type genjax does not read.
    """
    path = os.fspath(path)
    reader = open_file(path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    metadata = read_metadata(reader)
    reader.fields.clear()  # one numpy view per token string: ~1 KB each, 100 MB for 100k tokens
    config = hf_config(metadata, tensors, tuple(ignore_config_keys))
    model = _MODELS[config["model_type"]].from_hf_config(config, np.dtype(dtype).name)
    expected = _expected(model, metadata["general.architecture"])
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"the tensors of {path} do not match a {config['model_type']} model with "
            f"{model.num_layers} layers: missing {_names(missing)}, unexpected "
            f"{_names(unexpected)}. genjax reads plain llama, mistral, qwen2 and gpt2 files."
        )
    unsupported = [f"{n} ({t.tensor_type.name})" for n, t in tensors.items() if not _supported(t)]
    if unsupported:
        raise UnsupportedError(
            f"{path} stores {_names(unsupported)} in ggml types genjax does not dequantize; "
            f"supported: {', '.join(SUPPORTED_TYPES)}. Requantize the file (llama-quantize) to "
            "one of these."
        )
    permute = _permutation(metadata["general.architecture"], model)
    params: dict = {}
    for name, (param_path, shape) in expected.items():
        if keep_int4 and param_path[-1] == "kernel" and tensors[name].tensor_type.name in _Q4:
            packed = _four_bit(tensors[name], shape)
            if name in permute:
                packed = tuple(_unpermute_rows(part, permute[name]) for part in packed)
            for suffix, part in zip(("", "_scale", "_min"), packed, strict=True):
                _insert(params, (*param_path[:-1], f"kernel_q4{suffix}"), jnp.asarray(part))
            _drop_pages(reader)
            continue
        array = _dequantize(tensors[name], path, dtype)
        if name in permute:
            array = _unpermute_rows(array, permute[name])
        if array.shape != shape:
            raise CheckpointError(
                f"{path}: tensor {name} has shape {array.shape}, expected {shape} for this "
                "model's metadata."
            )
        _insert(params, param_path, jnp.asarray(array))
        del array
        _drop_pages(reader)
    return model, params


def _drop_pages(reader) -> None:
    """Lets the OS drop the file pages read so far (they are re-read if touched again), so the
    mapped file does not add its size to the process's resident memory while params build up."""
    mapped = getattr(reader.data, "base", None)
    if isinstance(mapped, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        mapped.madvise(mmap.MADV_DONTNEED)


def _four_bit(tensor, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 tensor [O, I] as ``(packed uint8[O, I/2], scale, minimum float16[O, I/32])``
    (:mod:`genjax.kernels.q4`): the blocks' nibbles as stored; Q4_1's ``d`` and ``m`` as they
    are, Q4_0's ``d`` with minimum ``-8 d`` (exact in float16)."""
    header = _Q4[tensor.tensor_type.name]
    blocks = np.asarray(tensor.data).reshape(shape[0], shape[1] // 32, header + 16)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if header == 4:
        minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    else:
        minimum = (scale * np.float16(-8)).astype(np.float16)
    packed = np.ascontiguousarray(blocks[..., header:]).reshape(shape[0], shape[1] // 2)
    return packed, scale, minimum


def _supported(tensor) -> bool:
    return tensor.tensor_type.name in SUPPORTED_TYPES


def _dequantize(tensor, path: str, dtype: Any) -> np.ndarray:
    """The tensor as a ``dtype`` array, dequantized a few MB of rows at a time (gguf's dequantizer
    makes float32 temporaries several times the size of what it is given)."""
    from gguf import quants

    data = tensor.data
    try:
        if data.ndim < 2:
            return quants.dequantize(data, tensor.tensor_type).astype(dtype, copy=False)
        first = quants.dequantize(data[:1], tensor.tensor_type)
        out = np.empty((data.shape[0], *first.shape[1:]), dtype)
        step = max(1, _CHUNK_BYTES // max(first.nbytes, 1))
        for start in range(0, data.shape[0], step):
            out[start : start + step] = quants.dequantize(
                data[start : start + step], tensor.tensor_type
            )
        return out
    except Exception as error:  # noqa: BLE001 - a damaged block is one clear error
        raise CheckpointError(
            f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}) could not be dequantized "
            f"({type(error).__name__}: {error}); the file may be damaged."
        ) from None


def _expected(model: Any, arch: str) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """GGUF tensor name -> (param path, shape), through gguf's own name map."""
    from gguf import MODEL_ARCH, get_tensor_name_map

    name_map = get_tensor_name_map(MODEL_ARCH[arch.upper()], model.num_layers)
    expected = {}
    for path, leaf in _flatten(model.param_shapes()):
        name, _ = model.hf_tensor_name(path)
        full = name if name.startswith("lm_head.") else model.hf_prefix + name
        base, suffix = full.rsplit(".", 1)
        gguf_base = name_map.get_name(base)
        if gguf_base is None:
            raise CheckpointError(f"gguf has no {arch} tensor name for {full}.")
        expected[f"{gguf_base}.{suffix}"] = (path, tuple(leaf.shape))
    return expected


def _permutation(arch: str, model: Any) -> dict[str, int]:
    """The llama-permuted tensors and their head counts (q: N heads, k: K heads)."""
    if arch != "llama":
        return {}
    heads = {"attn_q": model.config.num_heads, "attn_k": model.config.num_kv_heads}
    return {
        f"blk.{layer}.{kind}.{leaf}": count
        for layer in range(model.num_layers)
        for kind, count in heads.items()
        for leaf in ("weight", "bias")
    }


def _unpermute_rows(array: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation.

    llama.cpp stores each head's rows as (pairs, half) -> (half, pairs): row ``h*H + 2*i + j``
    of the stored tensor is row ``h*H + j*H/2 + i`` of the HF one (``H`` the head dim)::

        HF rows of one head  [x0 x1 x2 x3 | y0 y1 y2 y3]   (rotate_half pairs x_i with y_i)
        GGUF rows            [x0 y0 x1 y1 x2 y2 x3 y3]      (interleaved pairs)
    """
    half = array.shape[0] // heads // 2
    return array.reshape(heads, half, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def _flatten(tree: Mapping, prefix: tuple[str, ...] = ()):
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _insert(tree: dict, path: tuple[str, ...], value: Any) -> PyTree:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else ""
    return f"{names[:_MAX_NAMES]}{more}" if names else "none"
