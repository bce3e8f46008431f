"""Private helpers for ``genjax.config``: immutable containers, JSON files, atomic writes, the Hub.

Nothing here is public API. ``genjax.config.GenerationConfig`` uses these helpers to

* freeze user values into hashable, immutable forms (lists -> tuples, dicts -> ``FrozenDict``) and
  thaw them back into the plain JSON types that transformers writes;
* compare and hash values by content (arrays by value), refusing tracers;
* read ``generation_config.json`` files with errors that name the file, line and column;
* write files atomically (temporary file in the same directory, then ``os.replace``);
* resolve a local directory, a file path or a Hub repo id to a local file, and upload to the Hub
  (``huggingface_hub`` is imported lazily, only when the Hub is used).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from genjax.errors import GenerationConfigError


class FrozenDict(Mapping):
    """An immutable, hashable mapping used for dict-valued config fields and ``extra``.

    Example:
        >>> d = FrozenDict({"a": 1})
        >>> d["a"], hash(d) == hash(FrozenDict({"a": 1}))
        (1, True)
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | None = None):
        object.__setattr__(self, "_data", dict(data or {}))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FrozenDict is immutable; build a new one instead.")

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(canonical(self))

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"

    def __reduce__(self):
        return (FrozenDict, (self._data,))


def is_tracer(value: Any) -> bool:
    """True when ``value`` is an abstract JAX value (inside ``jit``, ``vmap``, ``grad``...)."""
    return isinstance(value, jax.core.Tracer)


def is_array(value: Any) -> bool:
    """True for NumPy arrays and JAX arrays (concrete or traced)."""
    return isinstance(value, np.ndarray | jax.Array)


def freeze(value: Any) -> Any:
    """Recursively converts lists to tuples, dicts to ``FrozenDict`` and NumPy scalars to Python.

    Arrays (NumPy or JAX, concrete or traced) and other objects are returned unchanged.
    """
    if isinstance(value, Mapping):
        return FrozenDict({key: freeze(item) for key, item in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze(item) for item in value)
    if isinstance(value, set | frozenset):
        return frozenset(freeze(item) for item in value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def thaw(value: Any) -> Any:
    """Recursively converts frozen values back to plain JSON types (lists, dicts, Python scalars).

    Raises:
        TypeError: if ``value`` holds a tracer (a traced config cannot be serialized).
    """
    if is_tracer(value):
        raise TypeError(
            "Cannot serialize a GenerationConfig that holds traced values (it is inside jit/vmap). "
            "Serialize the config outside the transformed function."
        )
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [thaw(item) for item in value]
    if isinstance(value, np.ndarray | jax.Array | np.generic):
        return np.asarray(value).tolist()
    return value


def canonical(value: Any) -> Any:
    """A hashable form of ``value`` compared by content; arrays become nested tuples of scalars.

    ``(1, 2)``, ``[1, 2]`` and ``np.array([1, 2], np.int32)`` share one canonical form, so they
    compare and hash equal.

    Raises:
        TypeError: if ``value`` holds a tracer (its content is unknown until run time).
    """
    if is_tracer(value):
        raise TypeError(
            "GenerationConfig holds a traced value (it is inside jit/vmap), so it has no concrete "
            "content to hash or compare. Hash or compare the config outside the transformed "
            "function, or compare only its static fields."
        )
    if isinstance(value, Mapping):
        return ("__mapping__", tuple(sorted((str(k), canonical(v)) for k, v in value.items())))
    if isinstance(value, list | tuple):
        return tuple(canonical(item) for item in value)
    if isinstance(value, np.ndarray | jax.Array | np.generic):
        return canonical(np.asarray(value).tolist())
    return value


def read_json_file(path: str | os.PathLike) -> dict[str, Any]:
    """Reads a JSON object from ``path``.

    Raises:
        GenerationConfigError: when the file is not valid UTF-8 JSON or not a JSON object; the
            message names the file, and the line and column of a syntax error.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as reader:
            text = reader.read()
    except UnicodeDecodeError as err:
        raise GenerationConfigError(
            f"{path} is not a UTF-8 text file ({err}). A generation config must be a JSON file; "
            "re-save it with GenerationConfig.save_pretrained."
        ) from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise GenerationConfigError(
            f"{path} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}. "
            "Fix the file by hand or re-save it with GenerationConfig.save_pretrained."
        ) from err
    if not isinstance(data, dict):
        raise GenerationConfigError(
            f"{path} must hold a JSON object (a mapping of field names to values), but it holds a "
            f"{type(data).__name__}. Re-save it with GenerationConfig.save_pretrained."
        )
    return data


def dumps(config_dict: dict[str, Any]) -> str:
    """Serializes like transformers: sorted keys, indent 2, ASCII escapes, a trailing newline.

    Raises:
        TypeError: naming the first top-level key whose value JSON cannot represent.
    """
    try:
        return json.dumps(config_dict, indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError) as err:
        for key in sorted(config_dict):
            try:
                json.dumps(config_dict[key])
            except (TypeError, ValueError):
                raise TypeError(
                    f"GenerationConfig key {key!r} holds {config_dict[key]!r} "
                    f"({type(config_dict[key]).__name__}), which JSON cannot represent ({err}). "
                    "Store only JSON types (numbers, strings, booleans, lists, dicts, None)."
                ) from err
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes ``text`` to ``path`` via a temporary file in the same directory and ``os.replace``.

    A failure at any point leaves ``path`` as it was and removes the temporary file.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(
        prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory
    )
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as writer:
            writer.write(text)
            writer.flush()
            os.fsync(writer.fileno())
        os.chmod(tmp_path, 0o644)  # mkstemp makes the file private; a config is shared
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


def resolve_config_file(
    name: str | os.PathLike,
    config_file_name: str,
    *,
    subfolder: str,
    cache_dir: str | os.PathLike | None,
    force_download: bool,
    local_files_only: bool,
    token: str | bool | None,
    revision: str,
) -> str:
    """Returns a local path to the config file named by ``name`` (file, directory or Hub repo id).

    Raises:
        OSError: when the file cannot be found locally or on the Hub; the message says where it
            looked.
    """
    name = os.fspath(name)
    if os.path.isfile(name):
        return name
    if os.path.isdir(name):
        candidate = os.path.join(name, subfolder, config_file_name)
        if not os.path.isfile(candidate):
            raise FileNotFoundError(
                f"The directory {name!r} has no {os.path.join(subfolder, config_file_name)!r}. "
                "Pass the directory that holds the generation config, or a path to the file itself."
            )
        return candidate
    import huggingface_hub

    try:
        return huggingface_hub.hf_hub_download(
            repo_id=name,
            filename=config_file_name,
            subfolder=subfolder or None,
            revision=revision,
            cache_dir=cache_dir,
            force_download=force_download,
            local_files_only=local_files_only,
            token=token,
        )
    except Exception as err:
        raise OSError(
            f"Could not load {config_file_name!r} for {name!r}: it is not a local file or "
            f"directory, and fetching it from the Hugging Face Hub failed ({type(err).__name__}: "
            f"{err}). Check the path or repo id, the revision, and your network or "
            "`local_files_only` setting."
        ) from err


def upload_to_hub(
    file_path: str,
    path_in_repo: str,
    save_directory: str | os.PathLike,
    options: dict[str, Any],
) -> str:
    """Uploads ``file_path`` to a Hub repo (created if missing) and returns the repo id.

    ``options`` may hold ``repo_id`` (default: the name of ``save_directory``), ``token``,
    ``private``, ``commit_message``, ``revision`` and ``create_pr``.
    """
    import huggingface_hub

    options = dict(options)
    token = options.pop("token", None)
    repo_id = options.pop("repo_id", os.path.basename(os.path.normpath(save_directory)))
    commit_message = options.pop("commit_message", None) or "Upload generation config"
    revision = options.pop("revision", None)
    create_pr = options.pop("create_pr", False)
    private = options.pop("private", None)
    if options:
        raise TypeError(
            f"save_pretrained(push_to_hub=True) got unknown options: {sorted(options)}."
        )
    api = huggingface_hub.HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    api.upload_file(
        path_or_fileobj=file_path,
        path_in_repo=path_in_repo,
        repo_id=repo_id,
        commit_message=commit_message,
        revision=revision,
        create_pr=create_pr,
    )
    return repo_id


# Bookkeeping keys of transformers that are dropped when reading.
DROPPED_KEYS = ("_commit_hash", "_original_object_hash", "_mask_length")


def split_config_dict(
    config_dict: Mapping[str, Any],
    overrides: Mapping[str, Any],
    field_names: frozenset[str],
    return_unused: bool,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Splits a config dict and its overrides into ``(fields, extra, unused)`` by v5's rules.

    Overrides win. An unknown override goes to ``extra``, or to ``unused`` when ``return_unused``.
    When ``_from_model_config`` is true, unknown keys are dropped (they belong to the model), and
    the legacy ``force_bos_token_to_be_generated`` flag sets ``forced_bos_token_id``.
    """
    merged = dict(config_dict)
    unused = {}
    for key, value in overrides.items():
        if return_unused and key not in field_names:
            unused[key] = value
        else:
            merged[key] = value
    for key in DROPPED_KEYS:
        merged.pop(key, None)
    fields = {key: merged.pop(key) for key in list(merged) if key in field_names}
    if fields.get("_from_model_config"):
        if merged.get("force_bos_token_to_be_generated", False):
            fields["forced_bos_token_id"] = fields.get("bos_token_id")
        merged = {}
    return fields, merged, unused


def read_model_config(model_config: Any) -> Mapping[str, Any]:
    """Reads a model config into a mapping.

    Accepts a mapping, a path to ``config.json`` or to its directory, or an object with
    ``to_dict()`` such as a transformers ``PreTrainedConfig``.
    """
    if isinstance(model_config, str | os.PathLike):
        path = os.fspath(model_config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        return read_json_file(path)
    if isinstance(model_config, Mapping):
        return model_config
    if hasattr(model_config, "to_dict"):
        return model_config.to_dict()
    raise TypeError(
        "from_model_config expects a dict, a path to config.json (or its directory), or an "
        f"object with to_dict(); got {type(model_config).__name__}."
    )


def decoder_config(model_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``decoder``, ``generator`` or ``text_config`` sub-config if any, else the input."""
    for name in ("decoder", "generator", "text_config"):
        sub = model_config.get(name)
        if isinstance(sub, Mapping) and sub:
            return sub
    return model_config
