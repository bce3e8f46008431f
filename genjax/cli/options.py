"""The ``genjax`` command's shared pieces: generation-config flags, value types, model folders.

Floor 6 (the command line): imports anything below it. Nothing here is public API.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import numpy as np

from genjax.errors import CheckpointError

DTYPES = ("float32", "bfloat16", "float16")
LOAD_DTYPES = (*DTYPES, "auto")  # what generate and serve load (convert stores a real dtype)
DTYPE_HELP = (
    "parameter dtype (default float32); auto: the fastest measured format for this backend and "
    "batch size (on a CPU: int8 weights for a few rows, up to 16 with genjax's kernel; more: "
    "bfloat16 where the CPU has bfloat16 dot products, else float32; genjax.models.precision)"
)
QUANTIZE = ("int8", "int4")
QUANTIZE_HELP = (
    "weight-only quantized linear layers: int8 (per output channel) or int4 (blocks of 32; a "
    "GGUF file's Q4_0/Q4_1 tensors are kept as stored); default: float weights"
)
CONFIG_FILES = ["config.json", "generation_config.json"]

# GenerationConfig fields set by a flag of the same name (--max-new-tokens...): type, metavar, help.
CONFIG_FLAGS = (
    ("max_new_tokens", int, "N", "the number of tokens to generate"),
    ("temperature", float, "T", "the sampling temperature"),
    ("top_k", int, "K", "sample from the K likeliest tokens (0: all)"),
    ("top_p", float, "P", "sample from the likeliest tokens whose probabilities sum to P"),
    ("min_p", float, "P", "drop tokens less likely than P times the likeliest one"),
    ("repetition_penalty", float, "R", "penalize tokens already in the text (1.0: off)"),
    ("num_beams", int, "N", "beam search with N beams (1: off)"),
)


# Fields that only sampling reads: --greedy sets them to None unless a flag sets them too, so that
# a model's sampling defaults (temperature, top_p...) do not warn that they will be ignored.
SAMPLING_ONLY = (
    "temperature",
    "top_p",
    "min_p",
    "top_h",
    "typical_p",
    "top_k",
    "epsilon_cutoff",
    "eta_cutoff",
)


def _unescape(text: str) -> str:
    """``\\n``, ``\\t`` and ``\\\\`` typed in a shell become a newline, a tab, a backslash."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t"}.get(m[1], "\\"), text)


def seed(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2**64 - 1, got {value}")
    return value


def seed_key(value: int):
    """The PRNG key of a 64-bit seed: ``jax.random.key(seed)`` below 2**32; above, both 32-bit
    halves are kept (``jax.random.key`` keeps only the low 32 bits unless x64 is enabled)."""
    import jax

    if value < 2**32:
        return jax.random.key(value)
    data = np.array([value >> 32, value & 0xFFFFFFFF], np.uint32)
    return jax.random.wrap_key_data(data, impl="threefry2x32")


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that set GenerationConfig fields (``CONFIG_FLAGS``, sampling, stop strings)."""
    group = parser.add_argument_group("generation config (a flag given overrides the file)")
    for field, kind, metavar, text in CONFIG_FLAGS:
        group.add_argument("--" + field.replace("_", "-"), type=kind, metavar=metavar, help=text)
    sampling = group.add_mutually_exclusive_group()
    sampling.add_argument(
        "--do-sample", dest="do_sample", action="store_true", default=None, help="sample"
    )
    sampling.add_argument(
        "--greedy", dest="do_sample", action="store_false", help="pick the likeliest token"
    )
    group.add_argument(
        "--stop",
        action="append",
        type=_unescape,
        metavar="STRING",
        help=r"stop at STRING (repeatable; \n, \t and \\ are unescaped)",
    )


def generation_config(folder: str, args):
    """The folder's generation config (``generation_config.json``, else derived from
    ``config.json`` as transformers does; for a GGUF file, its BOS/EOS/pad ids) with the flags
    given set on top. ``--greedy`` also unsets the file's sampling-only fields
    (``SAMPLING_ONLY``) that no flag sets."""
    from genjax.config import GenerationConfig
    from genjax.models import gguf

    if gguf.is_gguf(folder):  # everything in one file
        ids = gguf.generation_defaults(gguf.read_metadata(gguf.open_file(folder)))
        config = GenerationConfig.from_model_config(ids)
    elif os.path.isfile(os.path.join(folder, "generation_config.json")):
        config = GenerationConfig.from_pretrained(folder)
    elif os.path.isfile(os.path.join(folder, "config.json")):
        config = GenerationConfig.from_model_config(os.path.join(folder, "config.json"))
    else:
        raise CheckpointError(f"{folder!r} has neither generation_config.json nor config.json.")
    overrides = {field: getattr(args, field) for field, *_ in CONFIG_FLAGS}
    overrides["do_sample"] = args.do_sample
    overrides["stop_strings"] = None if args.stop is None else tuple(args.stop)
    overrides = {field: value for field, value in overrides.items() if value is not None}
    if args.do_sample is False:  # --greedy: the file's sampling values are not used, so unset
        for field in SAMPLING_ONLY:
            if getattr(config, field) is not None and getattr(args, field, None) is None:
                overrides[field] = None
    return config.replace(**overrides) if overrides else config


def check_json(path: str) -> None:
    """A clear error, naming the file, for a JSON file that does not parse (e.g. truncated)."""
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(
            f"{path} is not valid JSON ({error}); it may be truncated. Download or copy it again."
        ) from None


def config_folder(name: str) -> str:
    """A local folder, or the snapshot of a hub repo's config files."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return path
    if os.path.isfile(path) or path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise CheckpointError(f"no checkpoint folder at {path!r}.")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id=path, allow_patterns=CONFIG_FILES)
    except Exception as error:  # noqa: BLE001 - any hub failure becomes one clear error
        raise CheckpointError(
            f"{path!r} is not a local folder and could not be fetched from the Hugging Face Hub "
            f"({type(error).__name__}: {error})."
        ) from error


def add_compile_cache_flag(parser: argparse.ArgumentParser) -> None:
    """``--no-compile-cache`` (``args.compile_cache``, default True)."""
    parser.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_false",
        help="do not keep compiled programs on disk (also: GENJAX_COMPILE_CACHE=0)",
    )


def use_compile_cache(args) -> None:
    """Turns JAX's persistent compilation cache on in :func:`compile_cache_dir`, unless
    ``--no-compile-cache`` or ``GENJAX_COMPILE_CACHE=0`` turns it off."""
    if args.compile_cache and os.environ.get("GENJAX_COMPILE_CACHE", "1").strip() != "0":
        from genjax.generation import enable_compile_cache

        enable_compile_cache(compile_cache_dir())


def compile_cache_dir() -> str:
    """``$XDG_CACHE_HOME/genjax/xla``, else ``~/.cache/genjax/xla``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "genjax", "xla")
