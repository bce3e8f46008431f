"""Orbax checkpoints of a model: the parameter tree plus the files that describe it.

A genjax checkpoint is a folder that needs nothing else to run::

    out/
      config.json               the Hugging Face model config (architecture, sizes)
      generation_config.json    when the source had one
      tokenizer.json, ...       the tokenizer files, when the source had them
      genjax_checkpoint.json    the layout of the stored params (``LAYOUT``)
      params/                   an orbax-checkpoint (``StandardCheckpointer``) of the params

``restore`` reads ``params/`` straight into device buffers, split across a mesh when given
shardings, so every host of a pod reads only its own shards. ``genjax.models.from_pretrained``,
``genjax.tokenizer.from_pretrained``, ``GenerationConfig.from_pretrained`` and the ``genjax``
command accept such a folder as they accept a Hugging Face one (transformers does not: it reads
safetensors).

Writes are atomic: everything goes to a hidden folder beside the target (``.NAME.genjax-tmp``),
which is renamed into place only once complete; a failure, Ctrl-C or SIGTERM removes it and leaves
the target as it was (SIGINT and SIGTERM handlers are installed while writing, in the main thread,
and the previous ones restored after). One left by a killed process (``kill -9``) is removed by the
next write of the same target. An existing non-empty folder is never replaced unless
``overwrite=True``, and then only when it is a genjax checkpoint itself. In a multi-host run,
call ``save`` on every process (orbax writes each host's shards); process 0 writes the other files
and renames the folder.

Static or traced: nothing here is traced; these functions run on the host, outside ``jit``.

Example:
    >>> genjax.checkpoints.convert("HuggingFaceTB/SmolLM2-135M", "smollm-orbax")  # doctest: +SKIP
    >>> mesh = genjax.sharding.make_mesh((1, 8))
    >>> model, params = genjax.checkpoints.restore("smollm-orbax", mesh=mesh)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import signal
import threading
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from genjax.config import GenerationConfig
from genjax.errors import CheckpointError
from genjax.io.abandoned_reads import quiet_abandoned_reads
from genjax.models.loading import from_config, from_pretrained, register_folder_format, resolve
from genjax.sharding import DEFAULT_RULES, Rules, param_shardings
from genjax.typing import PyTree

PARAMS_DIR = "params"
"""The subfolder holding the orbax checkpoint of the parameter tree."""

LAYOUT_FILE = "genjax_checkpoint.json"
LAYOUT = {"kernel_layout": "out_in"}
"""How the stored params are laid out: every dense ``kernel`` is [out, in] (``layers.Dense``).
Checkpoints written before this file existed hold kernels [in, out] and are refused: a square
kernel would otherwise load transposed without any shape error."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
"""The tokenizer files copied by ``save(..., tokenizer_folder=...)`` when present."""

_TMP_SUFFIX = ".genjax-tmp"
_OLD_SUFFIX = ".genjax-old"
_MAX_NAMES = 10


def is_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` is a genjax orbax checkpoint (``config.json`` beside ``params/``).

    Example:
        >>> is_checkpoint("out")  # doctest: +SKIP
        True
    """
    directory = os.fspath(directory)
    return os.path.isdir(os.path.join(directory, PARAMS_DIR)) and os.path.isfile(
        os.path.join(directory, "config.json")
    )


def save(
    directory: str | os.PathLike,
    params: PyTree,
    *,
    model_config: Mapping[str, Any] | str | os.PathLike,
    generation_config: GenerationConfig | str | os.PathLike | None = None,
    tokenizer_folder: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> str:
    """Writes ``params`` and the files describing them as a checkpoint folder, atomically.

    The params are stored as they are (dtype and values); ``config.json`` must describe them:
    the tree is checked against the model it builds before anything is written.

    Args:
        directory: the checkpoint folder to create. It may exist only if empty, unless
            ``overwrite``.
        params: the parameter tree of a built-in model (arrays, possibly sharded).
        model_config: the Hugging Face ``config.json``: its parsed dict, its path, or a folder
            holding it.
        generation_config: a :class:`GenerationConfig` (written with ``save_pretrained``), or the
            path of a ``generation_config.json`` or of a folder holding one (copied verbatim;
            a folder without one is skipped). None writes none.
        tokenizer_folder: a folder whose tokenizer files (``TOKENIZER_FILES``) are copied.
        overwrite: replace an existing non-empty ``directory``, which must be a checkpoint.

    Returns:
        The absolute path of the checkpoint folder.

    Raises:
        CheckpointError: ``directory`` exists and is not empty (without ``overwrite``), is not a
            checkpoint (with ``overwrite``) or is a file; ``model_config`` is missing or does not
            match ``params``.

    Example:
        >>> model, params = genjax.models.from_pretrained("ckpt")  # doctest: +SKIP
        >>> save("out", params, model_config="ckpt", tokenizer_folder="ckpt")  # doctest: +SKIP
        '/abs/path/out'
    """
    directory = os.path.abspath(os.fspath(directory))
    _check_target(directory, overwrite)
    config = _read_model_config(model_config)
    _check_tree(from_config(config).param_shapes(), _shapes(params), f"params for {directory!r}")
    tmp = _sibling(directory, _TMP_SUFFIX)
    primary = jax.process_index() == 0
    if primary:
        _remove_stale(directory)
    with _signals_raise():
        try:
            if primary:
                os.makedirs(tmp)
                _write_files(tmp, config, generation_config, tokenizer_folder)
            _sync("genjax.checkpoints.save:files")
            _save_params(os.path.join(tmp, PARAMS_DIR), params)
            if primary:
                _move_into_place(tmp, directory, overwrite)
        finally:
            if primary and os.path.lexists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    _sync("genjax.checkpoints.save:done")
    return directory


def restore(
    directory: str | os.PathLike,
    *,
    dtype: Any = None,
    shardings: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
    ignore_config_keys: Iterable[str] = (),
) -> tuple[Any, PyTree]:
    """Reads a checkpoint folder into a model and its params, optionally straight into shards.

    Args:
        directory: a folder written by :func:`save` or :func:`convert`.
        dtype: the parameter and activation dtype, as in ``genjax.models.from_pretrained``:
            None means float32 whatever the stored dtype; ``"bfloat16"`` etc. Arrays are cast
            while they are read.
        shardings: where each array goes: one ``jax.sharding.Sharding`` for every leaf, or a
            pytree of them shaped like the params. Each host reads only its shards.
        mesh: instead of ``shardings``, a mesh on which ``genjax.sharding.param_shardings``
            places the params by ``rules`` (Megatron-style by default).
        rules: the logical-axis rules used with ``mesh``.
        ignore_config_keys: as in ``genjax.models.from_pretrained``.

    Returns:
        ``(model, params)``, as ``genjax.models.from_pretrained`` returns them. Without
        ``shardings`` or ``mesh``, params live on the first local device.

    Raises:
        CheckpointError: the folder, its ``config.json`` or its ``params/`` is missing, or the
            stored tree does not match the model ``config.json`` describes (names, shapes).
        UnsupportedError: an architecture genjax does not implement.

    Example:
        >>> model, params = restore("out", mesh=make_mesh((2, 4)))  # doctest: +SKIP
    """
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.fspath(directory))
    params_dir = _check_checkpoint(directory)
    model = from_config(os.path.join(directory, "config.json"), dtype, ignore_config_keys)
    expected = model.param_shapes()  # ShapeDtypeStruct leaves, of the model dtype
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            stored = getattr(checkpointer.metadata(params_dir).item_metadata, "tree", None)
        except Exception as error:  # noqa: BLE001 - orbax raises many kinds; name the folder
            raise _unreadable(params_dir, error) from None
        if stored is None:
            raise _unreadable(params_dir, "its metadata could not be read")
        _check_tree(expected, _shapes(stored), f"the checkpoint in {directory!r}")
        targets = _target_shardings(expected, shardings, mesh, rules)
        target = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            expected,
            targets,
        )
        params = _read_params(checkpointer, params_dir, target)
    return model, params


def _read_params(checkpointer, params_dir: str, target: PyTree) -> PyTree:
    """``checkpointer.restore``, with a read failure (a missing or corrupt data file) turned into
    one CheckpointError. Orbax then drops reads it had started: the "coroutine was never awaited"
    warnings they raise when collected, and the failures they report on other threads, are
    silenced (see :mod:`genjax.io.abandoned_reads`), as they only repeat the failure."""
    failure = None
    with quiet_abandoned_reads(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
        try:
            return checkpointer.restore(params_dir, target)
        except Exception as error:  # noqa: BLE001 - tensorstore errors carry no file name
            failure = error
        failure = _unreadable(params_dir, failure)  # frees the traceback and its coroutines
        gc.collect()
        raise failure


def _unreadable(params_dir: str, cause) -> CheckpointError:
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return CheckpointError(
        f"cannot read the params in {params_dir!r}: {first[:300]}. A data file is missing or "
        "corrupt (an interrupted copy?). Copy the folder again, or write it again with "
        "`genjax convert` (genjax.checkpoints.convert)."
    )


def convert(
    name_or_path: str | os.PathLike,
    directory: str | os.PathLike,
    *,
    dtype: Any = None,
    overwrite: bool = False,
    **from_pretrained_kwargs: Any,
) -> str:
    """Converts a Hugging Face checkpoint (folder or hub id) into a checkpoint folder.

    Copies ``config.json``, ``generation_config.json`` and the tokenizer files, and stores the
    params in ``dtype``.

    Args:
        name_or_path: a Hugging Face folder or hub id, as for ``genjax.models.from_pretrained``.
        directory: the checkpoint folder to write (see :func:`save`).
        dtype: the stored dtype (``"bfloat16"``...); None means float32.
        overwrite: replace an existing non-empty ``directory``, which must be a checkpoint.
        **from_pretrained_kwargs: ``revision``, ``local_files_only``, ``cache_dir``, ``token``.

    Returns:
        The path of the checkpoint folder.

    Example:
        >>> convert("HuggingFaceTB/SmolLM2-135M", "out", dtype="bfloat16")  # doctest: +SKIP
        '/abs/path/out'
    """
    target = os.path.abspath(os.fspath(directory))
    _check_target(target, overwrite)  # fail before loading
    if jax.process_index() == 0:
        _remove_stale(target)
    folder = resolve(name_or_path, **from_pretrained_kwargs)
    _read_model_config(folder)  # a clear error for a missing or malformed config.json
    _, params = from_pretrained(folder, dtype)
    return save(
        directory,
        params,
        model_config=folder,
        generation_config=folder,
        tokenizer_folder=folder,
        overwrite=overwrite,
    )


# ---------------------------------------------------------------------------- checks


def _check_target(directory: str, overwrite: bool) -> None:
    if os.path.isfile(directory):
        raise CheckpointError(f"{directory!r} is a file; a checkpoint is written as a folder.")
    if os.path.isdir(directory) and os.listdir(directory) and not overwrite:
        raise CheckpointError(
            f"{directory!r} already exists and is not empty; refusing to overwrite it. Choose "
            f"another folder, remove it, or pass overwrite=True (--overwrite on the command line)."
        )
    if os.path.isdir(directory) and os.listdir(directory) and not is_checkpoint(directory):
        raise CheckpointError(
            f"{directory!r} is not empty and is not a genjax checkpoint (no config.json beside "
            f"{PARAMS_DIR}/); overwrite replaces only a checkpoint folder, so it is left as it is. "
            "Choose another folder, or empty it yourself."
        )
    parent = os.path.dirname(directory)
    if not os.path.isdir(parent):
        raise CheckpointError(f"cannot write {directory!r}: its parent folder does not exist.")


def _check_checkpoint(directory: str) -> str:
    """Returns the params folder of a checkpoint, or raises naming what is missing."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"no checkpoint folder at {directory!r}.")
    missing = [
        name
        for name, present in (
            ("config.json", os.path.isfile(os.path.join(directory, "config.json"))),
            (f"{PARAMS_DIR}/", os.path.isdir(os.path.join(directory, PARAMS_DIR))),
        )
        if not present
    ]
    if missing:
        hint = (
            " It holds safetensors: load it with genjax.models.from_pretrained instead."
            if any(name.endswith(".safetensors") for name in os.listdir(directory))
            else " Write one with genjax.checkpoints.save or `genjax convert`."
        )
        raise CheckpointError(
            f"{directory!r} is not a genjax checkpoint: it has no {' and no '.join(missing)}.{hint}"
        )
    found = None
    if os.path.isfile(os.path.join(directory, LAYOUT_FILE)):
        with open(os.path.join(directory, LAYOUT_FILE), encoding="utf-8") as f:
            found = json.load(f)
    if found != LAYOUT:
        raise CheckpointError(
            f"{directory!r} was written by an older genjax (its {LAYOUT_FILE} is "
            f"{'missing' if found is None else found}, expected {LAYOUT}): it stores dense kernels "
            "[in, out], and genjax now stores them [out, in]. Convert the Hugging Face checkpoint "
            "again with genjax.checkpoints.convert or `genjax convert`."
        )
    params_dir = os.path.join(directory, PARAMS_DIR)
    if not os.path.isfile(os.path.join(params_dir, "_CHECKPOINT_METADATA")):
        raise CheckpointError(
            f"{params_dir!r} is not a complete orbax checkpoint (no _CHECKPOINT_METADATA). "
            "Write it again with genjax.checkpoints.save or `genjax convert`."
        )
    return params_dir


def _shapes(tree: PyTree) -> dict[str, tuple[int, ...]]:
    """ "/"-joined path -> shape, for arrays, ShapeDtypeStructs and orbax metadata alike."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))
    return {_path_name(path): tuple(np.shape(leaf)) for path, leaf in leaves}


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _check_tree(expected: PyTree, got: dict[str, tuple[int, ...]], what: str) -> None:
    """Raises a CheckpointError naming missing, unexpected and misshapen arrays."""
    want = _shapes(expected)
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    wrong = [
        f"{name}: expected {want[name]}, got {got[name]}"
        for name in sorted(set(want) & set(got))
        if got[name] != want[name]
    ]
    if missing or unexpected or wrong:
        problems = [
            f"missing arrays {_names(missing)}" if missing else "",
            f"unexpected arrays {_names(unexpected)}" if unexpected else "",
            f"wrong shapes {_names(wrong)}" if wrong else "",
        ]
        raise CheckpointError(
            f"{what} do not match the model config.json describes: "
            f"{'; '.join(p for p in problems if p)}. Check that config.json belongs to these "
            "weights."
        )


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else ""
    return f"{names[:_MAX_NAMES]}{more}"


def _target_shardings(expected: PyTree, shardings: Any, mesh, rules: Rules) -> PyTree:
    """One Sharding per leaf of ``expected``, from ``shardings``, ``mesh`` or the default."""
    if shardings is not None and mesh is not None:
        raise ValueError("pass shardings= or mesh=, not both.")
    if mesh is not None:
        return param_shardings(expected, mesh, rules)
    if shardings is None:
        shardings = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda _: shardings, expected)
    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)
    if jax.tree.structure(shardings, is_leaf=is_sharding) != jax.tree.structure(expected):
        raise ValueError(
            "shardings= must be one jax.sharding.Sharding or a pytree of them shaped like the "
            "params (e.g. genjax.sharding.param_shardings(model.param_shapes(), mesh)); got a "
            "tree of another structure."
        )
    return shardings


# ---------------------------------------------------------------------------- writing


def _read_model_config(model_config) -> dict[str, Any]:
    if isinstance(model_config, Mapping):
        return dict(model_config)
    path = os.fspath(model_config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"no config.json at {path!r}; save needs the model's config.json.")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(
            f"{path} is not valid JSON ({error}); it may be truncated. Download or copy it again."
        ) from None


def _write_files(folder: str, config: dict, generation_config, tokenizer_folder) -> None:
    # LAYOUT_FILE first: it marks the folder as ours for _remove_stale.
    for name, content in ((LAYOUT_FILE, LAYOUT), ("config.json", config)):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2, sort_keys=True)
            f.write("\n")
    if isinstance(generation_config, GenerationConfig):
        generation_config.save_pretrained(folder)
    elif generation_config is not None:
        source = os.fspath(generation_config)
        if os.path.isdir(source):
            source = os.path.join(source, "generation_config.json")
            if not os.path.isfile(source):
                source = None
        elif not os.path.isfile(source):
            raise CheckpointError(f"no generation config file at {source!r}.")
        if source is not None:
            shutil.copyfile(source, os.path.join(folder, "generation_config.json"))
    if tokenizer_folder is not None:
        tokenizer_folder = os.fspath(tokenizer_folder)
        if not os.path.isdir(tokenizer_folder):
            raise CheckpointError(f"tokenizer_folder {tokenizer_folder!r} is not a folder.")
        for name in TOKENIZER_FILES:
            source = os.path.join(tokenizer_folder, name)
            if os.path.isfile(source):
                shutil.copyfile(source, os.path.join(folder, name))


def _save_params(path: str, params: PyTree) -> None:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, params)
        checkpointer.wait_until_finished()


def _move_into_place(tmp: str, directory: str, overwrite: bool) -> None:
    """Renames the finished ``tmp`` folder to ``directory``, replacing it when ``overwrite``."""
    if not (os.path.isdir(directory) and os.listdir(directory)):
        os.replace(tmp, directory)  # also replaces an empty folder
        return
    _check_target(directory, overwrite)  # appeared, or changed, while we were writing
    old = _sibling(directory, _OLD_SUFFIX)
    if os.path.lexists(old):
        shutil.rmtree(old)
    os.rename(directory, old)
    try:
        os.rename(tmp, directory)
    except BaseException:
        os.rename(old, directory)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _remove_stale(directory: str) -> None:
    """Removes the temporary folder a killed write of ``directory`` left behind.

    It is ours when it is empty (killed right after ``makedirs``) or holds ``LAYOUT_FILE``
    (written first); any other folder of that name is refused, not deleted.
    """
    tmp = _sibling(directory, _TMP_SUFFIX)
    if not os.path.lexists(tmp):
        return
    if os.path.isdir(tmp) and not os.path.islink(tmp):
        entries = os.listdir(tmp)
        if not entries or LAYOUT_FILE in entries:
            shutil.rmtree(tmp)
            return
    raise CheckpointError(
        f"{tmp!r} is in the way: genjax writes {directory!r} there first, but it does not look "
        "like a folder genjax left behind. Move or remove it yourself, then write again."
    )


@contextlib.contextmanager
def _signals_raise():
    """While writing, SIGINT raises KeyboardInterrupt and SIGTERM raises SystemExit(143), so that
    the ``finally`` clauses remove the temporary folder; the previous handlers come back after.
    Signal handlers can only be set in the main thread: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _sibling(directory: str, suffix: str) -> str:
    parent, name = os.path.split(directory)
    return os.path.join(parent, f".{name}{suffix}")


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        import orbax.checkpoint as ocp

        ocp.multihost.sync_global_processes(name)


register_folder_format(
    "orbax",
    is_checkpoint,
    lambda folder, dtype, ignore_config_keys: restore(
        folder, dtype=dtype, ignore_config_keys=ignore_config_keys
    ),
)
