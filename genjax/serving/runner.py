"""Runs ``genjax serve``: load a model, warm the engine up, serve the OpenAI-compatible app under
uvicorn, drain on SIGTERM or Ctrl-C, exit 0.

The ready line ``genjax serve: ready at http://HOST:PORT/v1`` goes to stdout (flushed) once the
engine is warm and the socket listens; ``port=0`` lets the system pick a free port and the line
shows it. Nothing else goes to stdout; uvicorn logs to stderr.

Draining: the first SIGTERM or SIGINT sets the app's ``draining`` flag (new requests get 503),
waits for generation requests in flight (at most ``shutdown_timeout`` seconds), then stops
uvicorn and the engine; a second signal stops at once.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

__all__ = ["ServeOptions", "serve"]


DEFAULT_PREFILL_REQUESTS = 4
"""``genjax serve``'s prompts prefilled together: clients arriving together (a burst, or the
closed loop of ``bench/serve_load.py``) start together rather than one per step, at the cost of
up to 4 chunks of compute per prefill step and 3 more compiled prefill programs per span."""


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """What ``genjax serve`` runs.

    Attributes:
        model: a Hugging Face folder or hub id; None: the bundled model.
        host: the address to bind (loopback unless told otherwise).
        port: the TCP port; 0 picks a free one.
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
        served_model_name: the name clients give in ``model``; None: the bundled model's name
            or ``model`` as given.
        dtype: the parameter dtype ("float32", "bfloat16", "float16", or "auto" for the
            fastest measured format at ``max_batch_size`` rows); None: float32.
        quantize: None, "int8" or "int4": weight-only quantized linear layers
            (``from_pretrained``'s ``quantize``).
        max_batch_size: requests decoded together (the engine's slots).
        max_waiting: requests that may wait for a slot before new ones get 429.
        max_prefill_requests: prompts prefilled together in one step
            (``ContinuousBatchingConfig.max_prefill_requests``); None:
            :data:`DEFAULT_PREFILL_REQUESTS` or ``max_batch_size`` if fewer (a larger value
            given raises ``InputError``).
        max_length: tokens (prompt plus completion) of one request; None: the model's
            ``max_position_embeddings``, at most 4096.
        max_constraint_states, max_constraint_edges: the structured-output pool's sizes
            (``ContinuousBatchingConfig``); None: its defaults.
        kv_cache_dtype: the KV pool's storage: "auto" (the model's dtype) or "int8" (int8
            codes with one scale per head vector, about half the bytes of bfloat16 and a
            quarter of float32; ``ContinuousBatchingConfig.kv_cache_dtype``).
        kv_cache_memory_bytes: the KV pool's size in bytes (as many blocks as fit); None: one
            ``max_length`` request per slot (``ContinuousBatchingConfig``).
        shutdown_timeout: seconds draining waits for requests in flight.
        log_level: uvicorn's log level.
    """

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    dtype: str | None = None
    quantize: str | None = None
    max_batch_size: int = 8
    max_waiting: int = 64
    max_prefill_requests: int | None = None
    max_length: int | None = None
    max_constraint_states: int | None = None
    max_constraint_edges: int | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    shutdown_timeout: float = 30.0
    log_level: str = "info"


def _load(options: ServeOptions):
    """The model, params, tokenizer, generation config and served name."""
    from genjax import models
    from genjax.config import GenerationConfig
    from genjax.io import bundled
    from genjax.io import tokenizer as tokenizers

    folder = bundled.path() if options.model is None else models.loading.resolve(options.model)
    tokenizer = tokenizers.from_pretrained(folder)
    auto = options.dtype == "auto"
    model, params = models.from_pretrained(
        folder,
        dtype=options.dtype,
        quantize=options.quantize,
        batch_size=options.max_batch_size if auto else None,
    )
    if os.path.isfile(os.path.join(folder, "generation_config.json")):
        config = GenerationConfig.from_pretrained(folder)
    else:
        config = GenerationConfig.from_model_config(os.path.join(folder, "config.json"))
    name = options.served_model_name or options.model or bundled.DEFAULT_MODEL
    return model, params, tokenizer, config, name


def engine_sizes(options: ServeOptions, model):
    """The engine's :class:`~genjax.serving.ContinuousBatchingConfig` for the server's options."""
    from genjax.serving.config import ContinuousBatchingConfig

    max_length = options.max_length or min(model.max_position_embeddings or 4096, 4096)
    pool = {
        name: getattr(options, name)
        for name in ("max_constraint_states", "max_constraint_edges")
        if getattr(options, name) is not None
    }
    return ContinuousBatchingConfig(
        max_batch_size=options.max_batch_size,
        max_prefill_requests=(
            options.max_prefill_requests or min(DEFAULT_PREFILL_REQUESTS, options.max_batch_size)
        ),
        max_length=max_length,
        kv_cache_dtype=options.kv_cache_dtype,
        kv_cache_memory_bytes=options.kv_cache_memory_bytes,
        **pool,
    )


def _start_engine(options: ServeOptions, model, params, tokenizer, config):
    """A started and warmed-up manager (one short request run through it)."""
    from genjax.serving.manager import init_continuous_batching

    sizes = engine_sizes(options, model)
    manager = init_continuous_batching(model, params, config, sizes, tokenizer=tokenizer)
    manager.start()
    probe = manager.add_request([tokenizer.bos_token_id or 0], max_new_tokens=2)
    if manager.get_result(probe, timeout=600) is None:
        manager.stop(timeout=10)
        raise RuntimeError("the engine did not answer its warm-up request within 600 s.")
    return manager


def _uvicorn_server(config, state, shutdown_timeout: float):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn with draining (see the module docstring) and the ready line."""

        deadline = None

        def handle_exit(self, sig, frame) -> None:
            if state.draining:
                self.should_exit = self.force_exit = True
                return
            state.draining = True
            self.deadline = time.monotonic() + shutdown_timeout
            print("genjax serve: draining (a second signal stops now)", file=sys.stderr)

        async def on_tick(self, counter: int) -> bool:
            if self.deadline is not None and not self.should_exit:
                if state.in_flight <= 0 or time.monotonic() > self.deadline:
                    self.should_exit = True
            return await super().on_tick(counter)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                host = f"[{host}]" if ":" in host else host
                print(f"genjax serve: ready at http://{host}:{port}/v1", flush=True)

    return Server(config)


def serve(options: ServeOptions) -> int:
    """Serves until SIGTERM or Ctrl-C; returns the exit code (0).

    Example:
        >>> serve(ServeOptions(port=0))  # doctest: +SKIP
    """
    import uvicorn

    from genjax.serving.server import build_app

    model, params, tokenizer, config, name = _load(options)
    manager = _start_engine(options, model, params, tokenizer, config)
    try:
        app = build_app(manager, tokenizer, name, options.api_key, max_waiting=options.max_waiting)
        uv_config = uvicorn.Config(
            app,
            host=options.host,
            port=options.port,
            log_level=options.log_level,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        _uvicorn_server(uv_config, app.state.genjax, options.shutdown_timeout).run()
    finally:
        manager.stop(block=True, timeout=30)
    return 0
