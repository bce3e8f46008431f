"""Loading Hugging Face checkpoints (``config.json`` + safetensors) into a model and params.

Only safetensors are read, through ``safetensors``' numpy backend (never torch, never pickle);
bfloat16 and float8 tensors come through ``ml_dtypes``, with a raw-bytes reader as a fallback for
safetensors versions that cannot hand them to numpy.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from genjax.config import GenerationConfig, checkpoint_default
from genjax.errors import CheckpointError, UnsupportedError
from genjax.models import gguf, precision
from genjax.models import quantize as quantization
from genjax.models.bart import BartModel
from genjax.models.gemma import GemmaModel
from genjax.models.gpt2 import GPT2Model
from genjax.models.llama import LlamaModel
from genjax.models.olmo2 import Olmo2Model
from genjax.models.phi3 import Phi3Model
from genjax.models.t5 import T5Model
from genjax.typing import PyTree

ARCHITECTURES = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
    "olmo2": Olmo2Model,
    "phi3": Phi3Model,
    "gemma2": GemmaModel,
    "gemma3_text": GemmaModel,
    "gpt2": GPT2Model,
    "t5": T5Model,
    "mt5": T5Model,
    "bart": BartModel,
    "mbart": BartModel,
    "marian": BartModel,
}
HUB_PATTERNS = [
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "generation_config.json",
    "tokenizer*",
]
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_MAX_NAMES = 20
_CONVERT_HINT = (
    "genjax reads safetensors only (never pickle). Convert once with transformers: "
    "AutoModelForCausalLM.from_pretrained(path).save_pretrained(out, safe_serialization=True)."
)
_ML_DTYPES = ("BF16", "F8_E4M3", "F8_E5M2")  # numpy dtypes only through ml_dtypes
_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def from_pretrained(
    name_or_path: str | os.PathLike,
    dtype: Any = None,
    revision: str | None = None,
    local_files_only: bool = False,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    *,
    ignore_config_keys: Iterable[str] = (),
    quantize: str | None = None,
    gguf_file: str | os.PathLike | None = None,
    batch_size: int | None = None,
) -> tuple[Any, PyTree]:
    """Loads a model and its params from a local folder, a Hugging Face Hub id or a GGUF file.

    The folder (or the downloaded snapshot) must hold ``config.json`` and either
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``. Every parameter the
    architecture expects must be present with the right shape; buffers (``rotary_emb.inv_freq``,
    GPT-2's ``attn.bias``/``attn.masked_bias``) and a tied ``lm_head.weight`` are skipped.
    A local folder of another registered format (:func:`register_folder_format`; genjax
    registers its orbax checkpoints, :mod:`genjax.checkpoints`) is read by that format's reader.
    A llama.cpp GGUF file (``gguf_file=``, or a path ending in ``.gguf``) is read by
    :mod:`genjax.models.gguf`: config from its metadata, tensors dequantized to ``dtype``.

    Args:
        name_or_path: a folder, a Hub id like ``"HuggingFaceTB/SmolLM2-135M"``, or a ``.gguf``
            file.
        dtype: the parameter and activation dtype: None means float32 (regardless of the
            checkpoint's ``torch_dtype``, so that results are reproducible), or ``"bfloat16"``,
            ``"float16"``, ``"float32"``, or a jnp/numpy floating dtype; or ``"auto"``: the
            fastest measured format for this backend and ``batch_size``, whose logits move by
            a measured amount (:mod:`genjax.models.precision`; on a CPU int8 weights for a
            few rows, bfloat16 or float32 for many).
        revision: a Hub branch, tag or commit.
        local_files_only: do not touch the network; use the Hub cache only.
        cache_dir: the Hub cache folder.
        token: a Hub token, for gated or private repos.
        ignore_config_keys: config.json keys you vouch do not change the forward pass, for
            checkpoints whose config carries keys genjax does not know.
        quantize: None for float weights, ``"int8"``: weight-only int8 linear layers with
            per-output-channel scales, or ``"int4"``: 4-bit linear layers in blocks of 32, the
            output head int8 (:func:`genjax.quantize.quantize_params`, applied after loading in
            ``dtype``; activations stay ``dtype``). From a GGUF file, ``"int4"`` keeps its Q4_0
            and Q4_1 kernels exactly as stored, and quantizes the others.
        gguf_file: a GGUF file inside the folder or Hub repo ``name_or_path`` (transformers'
            keyword), or a path to one.
        batch_size: with ``dtype="auto"``, the rows you will decode together (None: a few).

    Returns:
        ``(model, params)``: a hashable model (see ``genjax.models.Model``) and a nested dict of
        jax arrays of ``dtype`` (int8 kernels and float32 scales with ``quantize``). The model
        carries the folder's generation config as ``model.generation_config``
        (``generation_config.json``, else derived from ``config.json``, as transformers loads it;
        ``genjax.generate`` starts from it).

    Raises:
        CheckpointError: missing files, missing/unexpected/misshapen tensors, pickle-only
            checkpoints, or a failed download.
        UnsupportedError: an architecture, rope type, config key or ``quantize`` mode genjax
            does not implement.
        TypeError: a dtype that is not floating, or 64-bit without ``jax_enable_x64``.

    Example:
        >>> model, params = from_pretrained("HuggingFaceTB/SmolLM2-135M")  # doctest: +SKIP
        >>> model.vocab_size  # doctest: +SKIP
        49152
        >>> model, params = from_pretrained("dir", gguf_file="m.Q4_1.gguf")  # doctest: +SKIP
    """
    dtype, quantize = precision.resolve(dtype, quantize, batch_size)
    dtype = _canonical_dtype(dtype)
    if quantize is not None:
        quantization.check_mode(quantize, "quantize")  # before any download or read
    gguf_path = gguf_location(name_or_path, gguf_file, revision, local_files_only, cache_dir, token)
    if gguf_path is not None:
        keep_int4 = quantize == "int4"
        model, params = gguf.load(gguf_path, dtype, tuple(ignore_config_keys), keep_int4)
        if quantize is not None:
            params = quantization.quantize_params(model, params, quantize)
        return model.with_generation_config(_gguf_generation_config(gguf_path)), params
    folder = _resolve(name_or_path, revision, local_files_only, cache_dir, token)
    reader = next((read for _, is_format, read in _FOLDER_FORMATS if is_format(folder)), None)
    if reader is not None:
        model, params = reader(folder, dtype, tuple(ignore_config_keys))
    else:
        model = from_config(os.path.join(folder, "config.json"), dtype, ignore_config_keys)
        params = load_params(model, folder)
    if quantize is not None:
        params = quantization.quantize_params(model, params, quantize)
    if hasattr(model, "with_generation_config"):  # generation_config.json, as transformers
        model = model.with_generation_config(checkpoint_default(folder))
    return model, params


def _gguf_generation_config(path) -> GenerationConfig:
    """A GGUF file's generation config: its BOS/EOS/pad ids, as transformers derives it."""
    reader = gguf.open_file(path)
    keys = [f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos", "padding")]
    found = {key: reader.fields[key].contents() for key in keys if key in reader.fields}
    return GenerationConfig.from_model_config(gguf.generation_defaults(found))


FolderReader = Callable[[str, np.dtype, tuple[str, ...]], tuple[Any, PyTree]]
"""``read(folder, dtype, ignore_config_keys) -> (model, params)`` for one folder format."""

_FOLDER_FORMATS: list[tuple[str, Callable[[str], bool], FolderReader]] = []


def register_folder_format(name: str, is_format: Callable[[str], bool], read: FolderReader):
    """Teaches :func:`from_pretrained` a folder format besides Hugging Face safetensors.

    Formats live in layers above the models (orbax checkpoints in :mod:`genjax.io`), so they
    register themselves here instead of this module importing them. The first registered format
    whose ``is_format(folder)`` is true reads the folder; otherwise it is read as safetensors.

    Args:
        name: the format's name (a second registration under the same name replaces the first).
        is_format: whether a local folder holds this format.
        read: ``read(folder, dtype, ignore_config_keys) -> (model, params)``.
    """
    _FOLDER_FORMATS[:] = [entry for entry in _FOLDER_FORMATS if entry[0] != name]
    _FOLDER_FORMATS.append((name, is_format, read))


def resolve(
    name_or_path: str | os.PathLike,
    revision: str | None = None,
    local_files_only: bool = False,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
) -> str:
    """The local folder of a checkpoint: ``name_or_path`` itself, or the Hub snapshot of
    ``HUB_PATTERNS`` (config, weights, generation config, tokenizer) for a hub id.

    Raises:
        CheckpointError: a path that is not a folder, or a failed download.

    Example:
        >>> resolve("HuggingFaceTB/SmolLM2-135M")  # doctest: +SKIP
        '/home/me/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M/snapshots/...'
    """
    return _resolve(name_or_path, revision, local_files_only, cache_dir, token)


def gguf_location(
    name_or_path: str | os.PathLike,
    gguf_file: str | os.PathLike | None = None,
    revision: str | None = None,
    local_files_only: bool = False,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
) -> str | None:
    """The local path of the GGUF file meant by ``(name_or_path, gguf_file)``, or None.

    ``name_or_path`` ending in ``.gguf`` is the file itself; with ``gguf_file``, that file inside
    the folder ``name_or_path``, else ``gguf_file`` itself if it exists, else downloaded from the
    Hub repo ``name_or_path``.

    Raises:
        CheckpointError: the file is in none of these places, or its download failed.

    Example:
        >>> gguf_location("models", gguf_file="m.gguf")  # doctest: +SKIP
        'models/m.gguf'
    """
    path = os.path.expanduser(os.fspath(name_or_path))
    if gguf_file is None:
        return path if gguf.is_gguf(path) and not os.path.isdir(path) else None
    gguf_file = os.path.expanduser(os.fspath(gguf_file))
    if os.path.isdir(path):
        inside = os.path.join(path, gguf_file)
        if os.path.isfile(inside) or not os.path.isfile(gguf_file):
            return inside  # gguf.load names it when missing
    if os.path.isfile(gguf_file):
        return gguf_file
    if path.startswith((".", "/", "~")) or os.path.isabs(path) or path.count("/") != 1:
        raise CheckpointError(f"no GGUF file {gguf_file!r} in or at {path!r}.")
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(
            path, gguf_file, revision=revision, cache_dir=cache_dir, token=token,
            local_files_only=local_files_only,
        )  # fmt: skip
    except Exception as e:
        raise CheckpointError(
            f"could not fetch {gguf_file!r} from the Hugging Face Hub repo {path!r} "
            f"({type(e).__name__}: {e})."
        ) from e


def from_config(
    config: str | os.PathLike | Mapping[str, Any],
    dtype: Any = None,
    ignore_config_keys: Iterable[str] = (),
) -> Any:
    """Builds a model (no weights) from a ``config.json`` path or its parsed dict.

    Args:
        config: the path of a ``config.json``, or its contents.
        dtype: as in :func:`from_pretrained`.
        ignore_config_keys: as in :func:`from_pretrained`.

    Example:
        >>> model = from_config({"model_type": "gpt2", "n_layer": 2})
        >>> model.num_layers
        2
    """
    if not isinstance(config, Mapping):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise CheckpointError(f"no config.json at {path!r}; a checkpoint folder needs one.")
        with open(path) as f:
            config = json.load(f)
    model_type = config.get("model_type")
    if model_type is None:
        raise CheckpointError(
            f"config.json has no model_type; supported model types: {', '.join(ARCHITECTURES)}."
        )
    if model_type not in ARCHITECTURES:
        raise UnsupportedError(
            f"model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(ARCHITECTURES)}."
        )
    return ARCHITECTURES[model_type].from_hf_config(
        config, _canonical_dtype(dtype).name, tuple(ignore_config_keys)
    )


def load_params(model: Any, folder: str | os.PathLike) -> PyTree:
    """Reads the safetensors of ``folder`` into ``model``'s parameter tree, checking every tensor.

    Args:
        model: a built-in model (it names its tensors through ``hf_tensor_name``).
        folder: a checkpoint folder.

    Returns:
        The nested dict of jax arrays, of ``model.dtype``.

    Example:
        >>> folder = genjax.io.bundled.path()
        >>> params = load_params(from_config(os.path.join(folder, "config.json")), folder)
        >>> params["embed_tokens"]["embedding"].shape
        (4096, 256)
    """
    folder = os.fspath(folder)
    stored = _stored_tensors(model, folder)  # name -> (file, stored name)
    expected = {}  # name -> (path, shape, transpose)
    for path, leaf in _flatten(model.param_shapes()):
        name, transpose = model.hf_tensor_name(path)
        expected[name] = (path, leaf.shape, transpose)
    skipped = {n for n in stored if model.is_hf_buffer(n)}
    if getattr(model.config, "tie_word_embeddings", False):
        skipped.add("lm_head.weight")
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected) - skipped)
    if missing or unexpected:
        raise CheckpointError(
            f"the checkpoint in {folder!r} does not match a {_describe(model)}: "
            f"missing tensors {_names([_hf_name(n, model.hf_prefix) for n in missing])}, "
            f"unexpected tensors {_names([stored[n][1] for n in unexpected])}. Check that "
            "config.json belongs to these weights."
        )
    by_file: dict[str, list[str]] = {}
    for name in expected:
        by_file.setdefault(stored[name][0], []).append(name)
    headers = {file: _read_header(file) for file in by_file}
    _check_shapes(expected, stored, headers, model)
    params: dict = {}
    for file, names in by_file.items():
        for name, array in _read_tensors(file, [stored[n][1] for n in names], headers[file]):
            path, _, transpose = expected[_strip(name, model.hf_prefix)]
            if transpose:
                array = array.T
            _insert(params, path, jnp.asarray(array.astype(model.dtype, copy=False)))
    return params


def save_params(model: Any, params: PyTree, folder: str | os.PathLike, dtype: Any = None) -> str:
    """Writes ``params`` as ``folder/model.safetensors`` with HF tensor names (``load_params``'s
    inverse), atomically: a temporary file in ``folder`` renamed into place.

    Args:
        model: a built-in model (it names its tensors through ``hf_tensor_name``).
        params: its parameter tree.
        folder: an existing folder; ``config.json`` is the caller's to write.
        dtype: the stored dtype (e.g. ``"bfloat16"``); None keeps each array's dtype.

    Returns:
        The path written.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     os.path.basename(save_params(model, params, folder, dtype="bfloat16"))
        'model.safetensors'
    """
    from safetensors.numpy import save_file

    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CheckpointError(f"folder must be an existing directory, got {folder!r}.")

    if quantization.is_quantized(params):
        raise UnsupportedError(
            "save_params writes float Hugging Face tensors; these params are quantized (int8 or "
            "int4, genjax.quantize). Save the float params and quantize after loading "
            "(from_pretrained(..., quantize='int8' or 'int4'))."
        )
    stored = None if dtype is None else _canonical_dtype(dtype, in_jax=False)
    tensors = {}
    for path, leaf in _flatten(params):
        name, transpose = model.hf_tensor_name(path)
        array = np.asarray(jax.device_get(leaf))
        array = array.T if transpose else array
        if stored is not None:
            array = array.astype(stored)
        tensors[_hf_name(name, model.hf_prefix)] = np.ascontiguousarray(array)
    target = os.path.join(folder, _SINGLE)
    partial = target + ".partial"
    try:
        save_file(tensors, partial, metadata={"format": "pt"})
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


def _canonical_dtype(dtype: Any, in_jax: bool = True) -> np.dtype:
    """The numpy dtype of ``dtype`` (None: float32); ``in_jax`` refuses 64-bit floats when JAX
    would silently make them float32."""
    if dtype is None:
        return jnp.dtype(jnp.float32)
    try:
        canonical = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(
            f"dtype must be None, 'auto', 'float32', 'bfloat16', 'float16' or a floating dtype; "
            f"got {dtype!r}."
        ) from e
    if not jnp.issubdtype(canonical, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {canonical.name}.")
    if in_jax and canonical.itemsize > 4 and not jax.config.jax_enable_x64:
        raise TypeError(
            f"dtype {canonical.name} needs 64-bit JAX, which is off: arrays would silently be "
            "float32. Call jax.config.update('jax_enable_x64', True) before loading, or pass "
            "dtype='float32'."
        )
    return canonical


def _resolve(name_or_path, revision, local_files_only, cache_dir, token) -> str:
    path = os.path.expanduser(os.fspath(name_or_path))
    if os.path.isdir(path):
        return path
    if path.startswith((".", "/", "~")) or os.path.isabs(path) or path.count("/") > 1:
        raise CheckpointError(f"no checkpoint folder at {path!r}.")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            repo_id=path,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            token=token,
            allow_patterns=HUB_PATTERNS,
        )
    except Exception as e:
        raise CheckpointError(
            f"could not fetch {path!r} from the Hugging Face Hub ({type(e).__name__}: {e}). "
            "If it is meant to be a local folder, check the path; if the repo is gated or "
            "private, pass token=...; offline, pass local_files_only=True with a filled cache."
        ) from e


def _strip(name: str, prefix: str) -> str:
    return name[len(prefix) :] if name.startswith(prefix) else name


def _stored_tensors(model: Any, folder: str) -> dict[str, tuple[str, str]]:
    """Maps each stored tensor name (base-model prefix stripped) to (file, stored name)."""
    index_path, single_path = os.path.join(folder, _INDEX), os.path.join(folder, _SINGLE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path} has no 'weight_map' dict.")
        files = {os.path.join(folder, file) for file in weight_map.values()}
        absent = sorted(os.path.basename(file) for file in files if not os.path.isfile(file))
        if absent:
            raise CheckpointError(f"{index_path} names shard(s) {absent} that are not in {folder}.")
        stored = {name: os.path.join(folder, file) for name, file in weight_map.items()}
    elif os.path.isfile(single_path):
        stored = {name: single_path for name in _read_header(single_path)}
    else:
        present = sorted(os.listdir(folder))
        pickles = [f for f in present if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        found = f"it holds {pickles}. " if pickles else ""
        raise CheckpointError(f"no {_SINGLE} or {_INDEX} in {folder!r}; {found}{_CONVERT_HINT}")
    return {_strip(name, model.hf_prefix): (file, name) for name, file in stored.items()}


def _read_header(file: str) -> dict[str, dict]:
    """Returns the safetensors header of ``file``: name -> {dtype, shape, data_offsets}."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (struct.error, ValueError) as e:
        raise CheckpointError(f"{file} is not a valid safetensors file ({e}).") from e
    header.pop("__metadata__", None)
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    have = os.path.getsize(file) - 8 - size
    if have < end:
        raise CheckpointError(
            f"{file} is truncated: its header describes {end} bytes of tensor data but the file "
            f"holds {max(have, 0)}. The download or save was cut short; fetch or write it again."
        )
    return {name: {**info, "start": 8 + size} for name, info in header.items()}


def _check_shapes(expected, stored, headers, model) -> None:
    wrong = []
    for name, (_, shape, transpose) in expected.items():
        file, stored_name = stored[name]
        info = headers[file].get(stored_name)
        if info is None:
            raise CheckpointError(f"{stored_name} is listed in the index but not in {file}.")
        got = tuple(info["shape"])
        want = tuple(reversed(shape)) if transpose else tuple(shape)
        if got != want:
            wrong.append(f"{stored_name}: expected {want}, got {got}")
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{stored_name} has unsupported dtype {info['dtype']}.")
    if wrong:
        raise CheckpointError(
            f"tensor shapes do not match a {_describe(model)}: {'; '.join(wrong[:_MAX_NAMES])}."
        )


def _read_tensors(file: str, names: list[str], header: dict[str, dict]):
    """Yields (stored name, numpy array) for ``names`` of one safetensors file."""
    from safetensors import safe_open

    with safe_open(file, framework="np") as f:
        for name in names:
            try:
                array = f.get_tensor(name)
            except Exception:
                if header[name]["dtype"] not in _ML_DTYPES:
                    raise
                array = _read_raw(file, header[name])
            yield name, array


def _read_raw(file: str, info: Mapping[str, Any]) -> np.ndarray:
    """Reads one tensor from its header entry, for dtypes a safetensors build can't give numpy."""
    begin, end = info["data_offsets"]
    dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
    with open(file, "rb") as f:
        f.seek(info["start"] + begin)
        data = f.read(end - begin)
    return np.frombuffer(data, dtype=dtype).reshape(info["shape"])


def _flatten(tree: Mapping, prefix: tuple[str, ...] = ()):
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _insert(tree: dict, path: tuple[str, ...], value: jax.Array) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _hf_name(name: str, prefix: str) -> str:
    return name if name.startswith("lm_head.") else prefix + name


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else ""
    return f"{names[:_MAX_NAMES]}{more}" if names else "none"


def _describe(model: Any) -> str:
    config = model.config
    kind = getattr(config, "model_type", "gpt2")
    return f"{kind} model with {config.num_layers} layers and width {config.hidden_size}"
