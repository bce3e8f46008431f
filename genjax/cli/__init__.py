"""The ``genjax`` command: generate text, show or check generation configs, convert checkpoints.

Usage::

    genjax generate [PROMPT ...] [--model PATH_OR_HUB_ID] [--input FILE] [--chat] [--json]
                    [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--min-p P]
                    [--repetition-penalty R] [--num-beams N] [--do-sample | --greedy]
                    [--stop STRING ...] [--seed S] [--dtype D] [--quantize M]
                    [--batch-size B] [--no-compile-cache]
    genjax config show [PATH_OR_HUB_ID] [generation flags]
    genjax config validate [PATH_OR_HUB_ID] [generation flags]
    genjax convert HF_PATH OUT_DIR [--dtype D] [--overwrite]
    genjax serve [--model PATH_OR_HUB_ID] [--host H] [--port P] [--api-key KEY] ...
                 [--no-compile-cache]
    genjax --version

Floor 6 (the command line, with the package's face): may import every layer.

``generate``:
    * The model defaults to the bundled one (:func:`genjax.io.bundled.path`); ``--model`` takes a
      Hugging Face folder or hub id, or a folder written by ``genjax convert``.
    * The generation config is the model folder's ``generation_config.json`` (else the one
      transformers derives from ``config.json``), with the flags given on the command line set
      on top; flags not given change nothing, except that ``--greedy`` unsets the file's
      sampling-only values (temperature, top_p...) that no flag sets. ``--stop`` is repeatable
      and turns ``\\n``, ``\\t`` and ``\\\\`` into a newline, a tab and a backslash.
    * ``--seed`` (0 to 2**64 - 1, default 0) makes the PRNG key; prompt ``i`` of the run samples
      with ``fold_in(key, i)``, so its tokens do not depend on ``--batch-size`` or its batch.
    * Prompts are the PROMPT arguments, then the lines of ``--input FILE`` (``-`` for stdin;
      blank lines skipped). ``--chat`` sends each prompt as one user message through the
      tokenizer's chat template, with the assistant cue added.
    * Text output starts with the prompt, then its continuation (a ``--chat`` reply alone).
      One prompt: the new text streams to stdout as it is generated (not with beam search, nor
      ``num_return_sequences > 1``, where it is printed at the end). Several prompts: they run in
      batches of ``--batch-size`` (the last batch is filled up with copies of its last prompt, so
      every batch reuses one compiled program); each result is printed after a ``==> PROMPT <==``
      header line, as ``head`` prints several files (a single result is printed alone). When
      stderr is a terminal, a one-line progress bar is drawn on it; otherwise nothing is.
    * ``--json``: one JSON object per line and per output sequence, nothing streamed:
      ``{"prompt", "completion", "token_ids", "num_new_tokens"}``. ``token_ids`` are the new
      tokens up to and including the EOS, or up to the end of the stop string, that ended the
      row (no padding after it); ``completion`` is their text without special tokens.
    * Compiled programs persist in ``$XDG_CACHE_HOME/genjax/xla`` (else ``~/.cache/genjax/xla``),
      so a second run skips most compilation; ``--no-compile-cache`` or
      ``GENJAX_COMPILE_CACHE=0`` turns that off.

``config show`` and ``config validate`` read the bundled model's config unless a folder or hub id
is given. ``validate`` also reports keys of ``generation_config.json`` that are no field, with
the closest field name (a typo such as ``top_kk``).

Exit codes: 0 on success; 1 when ``config validate`` finds problems; 2 on an error (a bad flag or
value, a missing file or folder, an invalid config value, an unsupported option), which is
printed as one line, ``genjax: error: ...``, on stderr, with no traceback. Warnings (such as a
config flag that will be ignored) are printed as ``genjax: warning: ...`` lines on stderr.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
import warnings
from collections.abc import Sequence

from genjax.cli import generate, options, serve
from genjax.errors import CheckpointError, GenerationConfigError, InputError, UnsupportedError

_USER_ERRORS = (CheckpointError, GenerationConfigError, InputError, UnsupportedError, OSError)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``genjax`` command and returns its exit code.

    Args:
        argv: the arguments after the program name; None reads ``sys.argv[1:]``.

    Returns:
        0 on success, 1 when ``config validate`` finds problems, 2 on an error.

    Example:
        >>> main(["config", "show", genjax.io.bundled.path(), "--temperature", "0.7"])
        {
          "bos_token_id": 0,
          ...
          "temperature": 0.7,
          ...
        }
        0
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, or a flag error already printed by _Parser.error
        return int(stop.code or 0)
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's warnings repeat our errors
    with warnings.catch_warnings():
        warnings.filterwarnings("default", category=UserWarning)
        warnings.showwarning = _show_warning
        try:
            return args.run(args)
        except _USER_ERRORS as error:
            _print_error(error)
            return 2
        except KeyboardInterrupt:
            print("genjax: interrupted", file=sys.stderr)
            return 130


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (and exit code 2)."""

    def error(self, message: str):
        print(f"genjax: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="genjax",
        description="Hugging Face-compatible text generation in JAX.",
        epilog="Run `genjax COMMAND --help` for a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"genjax {_version()}")
    commands = parser.add_subparsers(
        title="commands", metavar="COMMAND", required=True, parser_class=_Parser
    )
    _add_generate(commands)
    serve.add_parser(commands)
    config = commands.add_parser("config", help="show or validate a generation config")
    actions = config.add_subparsers(metavar="ACTION", required=True, parser_class=_Parser)
    for name, run, text in (
        ("show", _run_config_show, "print the effective generation config as JSON"),
        ("validate", _run_config_validate, "print 'ok' or the problems (exit code 1)"),
    ):
        action = actions.add_parser(name, help=text, description=text)
        action.add_argument(
            "model",
            nargs="?",
            metavar="PATH_OR_HUB_ID",
            help="model folder or hub id (default: bundled)",
        )
        options.add_config_flags(action)
        action.set_defaults(run=run)
    convert = commands.add_parser(
        "convert",
        help="write an orbax checkpoint of a Hugging Face checkpoint",
        description="Write a genjax orbax checkpoint (see genjax.checkpoints) of a checkpoint.",
    )
    convert.add_argument("source", metavar="HF_PATH", help="Hugging Face folder or hub id")
    convert.add_argument("out", metavar="OUT_DIR", help="the checkpoint folder to write")
    convert.add_argument("--dtype", choices=options.DTYPES, help="stored dtype (default float32)")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    convert.set_defaults(run=_run_convert)
    return parser


def _add_generate(commands) -> None:
    generate = commands.add_parser(
        "generate",
        help="generate text from prompts",
        description="Generate text; one prompt streams to stdout as it is generated.",
    )
    generate.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text")
    generate.add_argument(
        "--model", metavar="PATH_OR_HUB_ID", help="model folder or hub id (default: bundled)"
    )
    generate.add_argument("--input", metavar="FILE", help="prompts, one per line ('-': stdin)")
    generate.add_argument(
        "--chat", action="store_true", help="send each prompt as a user message (chat template)"
    )
    generate.add_argument(
        "--json", action="store_true", help="print one JSON object per result; no streaming"
    )
    generate.add_argument(
        "--seed", type=options.seed, default=0, help="PRNG seed, 0 to 2**64 - 1 (default 0)"
    )
    generate.add_argument("--dtype", choices=options.LOAD_DTYPES, help=options.DTYPE_HELP)
    generate.add_argument("--quantize", choices=options.QUANTIZE, help=options.QUANTIZE_HELP)
    generate.add_argument(
        "--batch-size",
        type=options.positive,
        default=8,
        metavar="N",
        help="prompts per batch (default 8)",
    )
    options.add_compile_cache_flag(generate)
    options.add_config_flags(generate)
    generate.set_defaults(run=_run_generate)


# ---------------------------------------------------------------------------- config commands


def _config_folder(name: str | None) -> str:
    from genjax.io import bundled

    return bundled.path() if name is None else options.config_folder(name)


def _run_config_show(args) -> int:
    config = options.generation_config(_config_folder(args.model), args)
    print(config.to_json_string(), end="")
    return 0


def _run_config_validate(args) -> int:
    folder = _config_folder(args.model)
    unknown = _unknown_keys(os.path.join(folder, "generation_config.json"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # validate(strict=True) reports the same issues
            config = options.generation_config(folder, args)
        config.validate(strict=True)
    except GenerationConfigError as error:
        print("\n".join([*unknown, str(error)]))
        return 1
    if unknown:
        print("\n".join(unknown))
        return 1
    print("ok")
    return 0


def _unknown_keys(path: str) -> list[str]:
    """One line per key of a ``generation_config.json`` that is no GenerationConfig field (nor
    transformers' metadata), naming the closest field. transformers keeps such keys as custom
    attributes, so a typo (``top_kk``) would otherwise pass silently."""
    from genjax.config import GenerationConfig

    if not os.path.isfile(path):
        return []
    options.check_json(path)
    with open(path, encoding="utf-8") as f:
        keys = json.load(f)
    fields = set(GenerationConfig().to_dict()) | {"_from_model_config"}
    lines = []
    for key in keys if isinstance(keys, dict) else ():
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; remove it if it is a typo."
            lines.append(
                f"{path}: unknown key {key!r}, which no GenerationConfig field reads{hint}"
            )
    return lines


# ---------------------------------------------------------------------------- convert


def _run_convert(args) -> int:
    from genjax.io import checkpoints

    path = checkpoints.convert(args.source, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------------------- generate


def _run_generate(args) -> int:
    options.use_compile_cache(args)
    return generate.run(args)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("genjax")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        from genjax import __version__

        return __version__


# ---------------------------------------------------------------------------- messages


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _print_error(error: BaseException) -> None:
    print(f"genjax: error: {_one_line(error)}", file=sys.stderr)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"genjax: warning: {_one_line(message)}", file=sys.stderr)
