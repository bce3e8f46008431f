"""The ``genjax`` command: generate text, show or check generation configs, convert checkpoints.

Usage::

    genjax generate [PROMPT ...] [--model PATH_OR_HUB_ID] [--input FILE] [--chat] [--json]
                    [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--min-p P]
                    [--repetition-penalty R] [--num-beams N] [--do-sample | --greedy]
                    [--stop STRING ...] [--seed S] [--dtype D] [--batch-size B]
    genjax config show PATH_OR_HUB_ID [generation flags]
    genjax config validate PATH_OR_HUB_ID [generation flags]
    genjax convert HF_PATH OUT_DIR [--dtype D] [--overwrite]

``generate``:
    * The model defaults to the bundled one (:func:`genjax.io.bundled.path`); ``--model`` takes a
      Hugging Face folder or hub id, or a folder written by ``genjax convert``.
    * The generation config is the model folder's ``generation_config.json`` (else the one
      transformers derives from ``config.json``), with the flags given on the command line set
      on top; flags not given change nothing. ``--stop`` is repeatable and turns ``\\n``,
      ``\\t`` and ``\\\\`` into a newline, a tab and a backslash. ``--seed`` (default 0) makes
      the PRNG key.
    * Prompts are the PROMPT arguments, then the lines of ``--input FILE`` (``-`` for stdin;
      blank lines skipped). ``--chat`` sends each prompt as one user message through the
      tokenizer's chat template, with the assistant cue added.
    * One prompt: the new text streams to stdout as it is generated (not with beam search, nor
      ``num_return_sequences > 1``, where it is printed at the end). Several prompts: they run in
      batches of ``--batch-size`` (the last batch is filled up with copies of its last prompt, so
      every batch reuses one compiled program); each result is printed after a ``==> PROMPT <==``
      header line, as ``head`` prints several files (a single result is printed alone). When
      stderr is a terminal, a one-line progress bar is drawn on it; otherwise nothing is.
    * ``--json``: one JSON object per line and per output sequence, nothing streamed:
      ``{"prompt", "completion", "token_ids", "num_new_tokens"}``. ``token_ids`` are the new
      tokens up to and including the EOS that ended the row (no padding after it);
      ``completion`` is their text without special tokens.

Exit codes: 0 on success; 1 when ``config validate`` finds problems; 2 on an error (a bad flag or
value, a missing file or folder, an invalid config value, an unsupported option), which is
printed as one line, ``genjax: error: ...``, on stderr, with no traceback. Warnings (such as a
config flag that will be ignored) are printed as ``genjax: warning: ...`` lines on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from genjax.errors import CheckpointError, GenerationConfigError, InputError, UnsupportedError

_USER_ERRORS = (CheckpointError, GenerationConfigError, InputError, UnsupportedError, OSError)
_DTYPES = ("float32", "bfloat16", "float16")
_CONFIG_FILES = ["config.json", "generation_config.json"]

# GenerationConfig fields set by a flag of the same name (--max-new-tokens...): type, metavar, help.
_CONFIG_FLAGS = (
    ("max_new_tokens", int, "N", "the number of tokens to generate"),
    ("temperature", float, "T", "the sampling temperature"),
    ("top_k", int, "K", "sample from the K likeliest tokens (0: all)"),
    ("top_p", float, "P", "sample from the likeliest tokens whose probabilities sum to P"),
    ("min_p", float, "P", "drop tokens less likely than P times the likeliest one"),
    ("repetition_penalty", float, "R", "penalize tokens already in the text (1.0: off)"),
    ("num_beams", int, "N", "beam search with N beams (1: off)"),
)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``genjax`` command and returns its exit code.

    Args:
        argv: the arguments after the program name; None reads ``sys.argv[1:]``.

    Returns:
        0 on success, 1 when ``config validate`` finds problems, 2 on an error.

    Example:
        >>> main(["config", "show", "path/to/checkpoint", "--temperature", "0.7"])  # doctest: +SKIP
        0
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, or a flag error already printed by _Parser.error
        return int(stop.code or 0)
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


# ---------------------------------------------------------------------------- argument parsing


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (and exit code 2)."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="genjax",
        description="Hugging Face-compatible text generation in JAX.",
        epilog="Run `genjax COMMAND --help` for a command's flags.",
    )
    commands = parser.add_subparsers(
        title="commands", metavar="COMMAND", required=True, parser_class=_Parser
    )
    _add_generate(commands)
    config = commands.add_parser("config", help="show or validate a generation config")
    actions = config.add_subparsers(metavar="ACTION", required=True, parser_class=_Parser)
    for name, run, text in (
        ("show", _run_config_show, "print the effective generation config as JSON"),
        ("validate", _run_config_validate, "print 'ok' or the problems (exit code 1)"),
    ):
        action = actions.add_parser(name, help=text, description=text)
        action.add_argument("model", metavar="PATH_OR_HUB_ID", help="model folder or hub id")
        _add_config_flags(action)
        action.set_defaults(run=run)
    convert = commands.add_parser(
        "convert",
        help="write an orbax checkpoint of a Hugging Face checkpoint",
        description="Write a genjax orbax checkpoint (see genjax.checkpoints) of a checkpoint.",
    )
    convert.add_argument("source", metavar="HF_PATH", help="Hugging Face folder or hub id")
    convert.add_argument("out", metavar="OUT_DIR", help="the checkpoint folder to write")
    convert.add_argument("--dtype", choices=_DTYPES, help="stored dtype (default float32)")
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
    generate.add_argument("--seed", type=int, default=0, help="PRNG seed (default 0)")
    generate.add_argument("--dtype", choices=_DTYPES, help="parameter dtype (default float32)")
    generate.add_argument(
        "--batch-size", type=_positive, default=8, metavar="N", help="prompts per batch (default 8)"
    )
    _add_config_flags(generate)
    generate.set_defaults(run=_run_generate)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that set GenerationConfig fields (``_CONFIG_FLAGS``, sampling, stop strings)."""
    group = parser.add_argument_group("generation config (a flag given overrides the file)")
    for field, kind, metavar, text in _CONFIG_FLAGS:
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


def _unescape(text: str) -> str:
    """``\\n``, ``\\t`` and ``\\\\`` typed in a shell become a newline, a tab, a backslash."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t"}.get(m[1], "\\"), text)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# ---------------------------------------------------------------------------- config commands


def _run_config_show(args) -> int:
    config = _generation_config(_config_folder(args.model), args)
    print(config.to_json_string(), end="")
    return 0


def _run_config_validate(args) -> int:
    folder = _config_folder(args.model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # validate(strict=True) reports the same issues
            config = _generation_config(folder, args)
        config.validate(strict=True)
    except GenerationConfigError as error:
        print(error)
        return 1
    print("ok")
    return 0


def _generation_config(folder: str, args, base=None):
    """The folder's generation config (``generation_config.json``, else derived from
    ``config.json`` as transformers does; ``base`` when given) with the flags given set on top."""
    from genjax.config import GenerationConfig

    if base is not None:
        config = base
    elif os.path.isfile(os.path.join(folder, "generation_config.json")):
        config = GenerationConfig.from_pretrained(folder)
    elif os.path.isfile(os.path.join(folder, "config.json")):
        config = GenerationConfig.from_model_config(os.path.join(folder, "config.json"))
    else:
        raise CheckpointError(f"{folder!r} has neither generation_config.json nor config.json.")
    overrides = {field: getattr(args, field) for field, *_ in _CONFIG_FLAGS}
    overrides["do_sample"] = args.do_sample
    overrides["stop_strings"] = None if args.stop is None else tuple(args.stop)
    overrides = {field: value for field, value in overrides.items() if value is not None}
    return config.replace(**overrides) if overrides else config


def _gguf_generation_config(path: str):
    """A GGUF file's generation config: its BOS/EOS/pad ids, as from a config.json."""
    from genjax.config import GenerationConfig
    from genjax.models import gguf

    ids = gguf.generation_defaults(gguf.read_metadata(gguf.open_file(path)))
    return GenerationConfig.from_model_config(ids)


def _config_folder(name: str) -> str:
    """A local folder, or the snapshot of a hub repo's config files."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return path
    if os.path.isfile(path) or path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise CheckpointError(f"no checkpoint folder at {path!r}.")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id=path, allow_patterns=_CONFIG_FILES)
    except Exception as error:  # noqa: BLE001 - any hub failure becomes one clear error
        raise CheckpointError(
            f"{path!r} is not a local folder and could not be fetched from the Hugging Face Hub "
            f"({type(error).__name__}: {error})."
        ) from error


# ---------------------------------------------------------------------------- convert


def _run_convert(args) -> int:
    from genjax.io import checkpoints

    path = checkpoints.convert(args.source, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------------------- generate


def _run_generate(args) -> int:
    import jax

    from genjax import models
    from genjax.io import bundled
    from genjax.io import tokenizer as tokenizers
    from genjax.streaming import TextStreamer

    prompts = _read_prompts(args.prompts, args.input)
    base = None
    if args.model is not None and models.gguf.is_gguf(args.model):
        folder, base = args.model, _gguf_generation_config(args.model)  # all in one file
    else:
        folder = bundled.path() if args.model is None else models.loading.resolve(args.model)
    config = _generation_config(folder, args, base)
    tokenizer = tokenizers.from_pretrained(folder)
    model, params = models.from_pretrained(folder, dtype=args.dtype)
    resolved = config.with_defaults()
    copies = resolved.num_return_sequences
    run = _Run(model, params, config, tokenizer, jax.random.key(args.seed), args.chat)

    if len(prompts) == 1 and not args.json and resolved.num_beams == 1 and copies == 1:
        # The prompt, then its continuation as it streams; a chat shows the reply alone.
        if not args.chat:
            sys.stdout.write(prompts[0])
            sys.stdout.flush()
        run(prompts, streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
        return 0
    style = "json" if args.json else "headed" if len(prompts) * copies > 1 else "plain"
    progress = _Progress(len(prompts), sys.stderr, enabled=len(prompts) > 1)
    done = 0
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        filled = batch
        if len(prompts) > args.batch_size:  # same shape as the other batches: no new program
            filled = batch + [batch[-1]] * (args.batch_size - len(batch))
        results = run(filled)[: len(batch) * copies]
        progress.clear()
        for row, (ids, text) in enumerate(results):
            _print_result(batch[row // copies], ids, text, style, first=done + row == 0)
        done += len(batch) * copies
        progress.update(start + len(batch))
    progress.close()
    return 0


class _Run:
    """Tokenizes a batch of prompts, generates, and returns each row's new ids and text."""

    def __init__(self, model, params, config, tokenizer, key, chat: bool):
        self.model, self.params, self.config = model, params, config
        self.tokenizer, self.key, self.chat = tokenizer, key, chat
        eos, pad = config.eos_token_id, config.pad_token_id
        eos_ids = [] if eos is None else np.atleast_1d(eos).tolist()
        self.eos_ids = set(eos_ids)
        # generate's pad id: pad_token_id, else the first EOS id, else 0.
        self.pad_id = pad if pad is not None else eos_ids[0] if eos_ids else 0

    def __call__(self, prompts: list[str], streamer=None) -> list[tuple[list[int], str]]:
        from genjax.generation.entry import generate

        batch = self._encode(prompts)
        stop_vocab = self.tokenizer.backend if self.config.stop_strings is not None else None
        out = generate(
            self.model,
            self.params,
            batch["input_ids"],
            self.config,
            attention_mask=batch["attention_mask"],
            key=self.key,
            tokenizer=stop_vocab,
            streamer=streamer,
        )
        new = np.asarray(out.sequences)[:, batch["input_ids"].shape[1] :]
        rows = [self._trim(row.tolist()) for row in new]
        return [(ids, self.tokenizer.decode(ids, skip_special_tokens=True)) for ids in rows]

    def _encode(self, prompts: list[str]) -> dict:
        if not self.chat:
            return self.tokenizer(prompts)
        if self.tokenizer.chat_template is None:
            raise InputError(
                "--chat needs a chat template, but this model's tokenizer has none (no "
                "chat_template in tokenizer_config.json and no chat_template.jinja). Drop --chat."
            )
        rows = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True
            )
            for prompt in prompts
        ]
        return self.tokenizer.pad(rows)

    def _trim(self, ids: list[int]) -> list[int]:
        """The new tokens up to and including the first EOS; else without trailing padding."""
        for index, token in enumerate(ids):
            if token in self.eos_ids:
                return ids[: index + 1]
        while ids and ids[-1] == self.pad_id:
            ids = ids[:-1]
        return ids


def _read_prompts(prompts: list[str], input_file: str | None) -> list[str]:
    prompts = list(prompts)
    if input_file is not None:
        if input_file == "-":
            lines = sys.stdin.read().splitlines()
        else:
            if not os.path.isfile(input_file):
                raise InputError(f"--input file {input_file!r} does not exist.")
            with open(input_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise InputError(
            "no prompt: give one or more PROMPT arguments, or --input FILE with one per line."
        )
    return prompts


def _print_result(prompt: str, ids: list[int], text: str, style: str, first: bool) -> None:
    """Prints one output sequence; ``style`` is "json", "headed" (``==> PROMPT <==`` first,
    blank lines between results) or "plain" (the text alone, for a single result)."""
    if style == "json":
        record = {"prompt": prompt, "completion": text, "token_ids": ids}
        record["num_new_tokens"] = len(ids)
        print(json.dumps(record, ensure_ascii=False), flush=True)
        return
    if style == "headed":
        print(("" if first else "\n") + f"==> {prompt} <==")
    print(text, flush=True)


class _Progress:
    """A one-line progress bar on a terminal stream; silent when the stream is not a TTY."""

    WIDTH = 30

    def __init__(self, total: int, stream: Any, enabled: bool = True):
        self.total, self.stream = total, stream
        self.enabled = enabled and bool(getattr(stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.update(0)

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        filled = self.WIDTH * done // max(self.total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        elapsed = time.monotonic() - self.start
        self.stream.write(f"\r[{bar}] {done}/{self.total} prompts {elapsed:.1f}s")
        self.stream.flush()

    def clear(self) -> None:
        """Erases the bar, so that text printed next starts on a clean line."""
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------------------- messages


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _print_error(error: BaseException) -> None:
    print(f"genjax: error: {_one_line(error)}", file=sys.stderr)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"genjax: warning: {_one_line(message)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
