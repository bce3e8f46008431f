"""``genjax serve``: the flags of the OpenAI-compatible server (:mod:`genjax.serving.runner`).

Usage::

    genjax serve [--model PATH_OR_HUB_ID] [--host H] [--port P] [--api-key KEY]
                 [--served-model-name NAME] [--dtype D] [--quantize M] [--max-batch-size N]
                 [--max-waiting N] [--max-prefill-requests N]
                 [--max-length N] [--max-constraint-states N] [--max-constraint-edges N]
                 [--kv-cache-dtype {auto,int8}] [--kv-cache-memory-bytes N]
                 [--shutdown-timeout S] [--log-level L] [--no-compile-cache]

The server and its web dependencies are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from genjax.cli import options
from genjax.serving.config import KV_CACHE_DTYPES


def add_parser(commands) -> None:
    """Adds ``serve`` to the ``genjax`` subcommands."""
    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (continuous batching). "
        "Prints `genjax serve: ready at URL` when ready; SIGTERM or Ctrl-C drains and exits.",
    )
    serve.add_argument("--model", metavar="PATH_OR_HUB_ID", help="default: the bundled model")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("GENJAX_API_KEY"),
        help="require `Authorization: Bearer KEY` (default: $GENJAX_API_KEY; none: open)",
    )
    serve.add_argument("--served-model-name", metavar="NAME", help="the name in `model`")
    serve.add_argument("--dtype", choices=options.LOAD_DTYPES, help=options.DTYPE_HELP)
    serve.add_argument("--quantize", choices=options.QUANTIZE, help=options.QUANTIZE_HELP)
    serve.add_argument(
        "--max-batch-size", type=options.positive, default=8, metavar="N", help="default 8"
    )
    serve.add_argument(
        "--max-waiting",
        type=_at_least_zero,
        default=64,
        metavar="N",
        help="requests queued beyond the batch before new ones get 429 (default 64)",
    )
    serve.add_argument(
        "--max-prefill-requests",
        type=options.positive,
        metavar="N",
        help="prompts prefilled together in one step, at most --max-batch-size (default 4, "
        "or --max-batch-size if smaller)",
    )
    serve.add_argument("--max-length", type=options.positive, metavar="N", help="tokens/request")
    serve.add_argument(
        "--max-constraint-states",
        type=_at_least_zero,
        metavar="N",
        help="states of the structured-output automata pool (default 4096; 0: no response_format)",
    )
    serve.add_argument(
        "--max-constraint-edges",
        type=options.positive,
        metavar="N",
        help="transitions of that pool, 4 bytes each (default 2**20)",
    )
    serve.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the KV pool's storage: auto (the model's dtype, default) or int8 (int8 codes "
        "with one scale per head vector: about 2x the tokens per byte of bfloat16, 4x float32)",
    )
    serve.add_argument(
        "--kv-cache-memory-bytes",
        type=options.positive,
        metavar="N",
        help="the KV pool's size in bytes (default: one --max-length request per slot)",
    )
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))
    options.add_compile_cache_flag(serve)
    serve.set_defaults(run=run)


def _at_least_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def run(args) -> int:
    """Serves until SIGTERM or Ctrl-C (exit code 0). The engine's programs are compiled before
    the server reports ready, and kept on disk as ``genjax generate``'s are
    (:func:`~genjax.cli.options.use_compile_cache`): a server started again with the same model
    and sizes loads them instead of compiling."""
    from genjax.serving.runner import ServeOptions, serve

    options.use_compile_cache(args)

    fields = {f.name for f in dataclasses.fields(ServeOptions)}
    return serve(ServeOptions(**{k: v for k, v in vars(args).items() if k in fields}))
