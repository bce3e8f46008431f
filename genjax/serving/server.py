"""``genjax serve``: an OpenAI-compatible HTTP server over the continuous-batching manager.

:func:`build_app` returns the FastAPI (ASGI) app for a running manager;
:func:`genjax.serving.runner.serve` loads a model, warms the engine up, and runs the app under
uvicorn until SIGTERM or Ctrl-C.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (the
tokenizer's chat template), ``GET /health``, ``GET /metrics`` (Prometheus text). The request
fields honoured or refused are listed in :mod:`genjax.serving.protocol`; structured output
(``response_format``, ``guided_*``) in :mod:`genjax.serving.guided`. Streams are server-sent
events: ``data: {json}`` chunks, one final chunk per choice with its ``finish_reason``, the usage
chunk (``choices: []``) when ``stream_options.include_usage``, then ``data: [DONE]``.

Design:
    * The manager's one result handler hands each output to the asyncio queue of the HTTP
      request that owns it (``loop.call_soon_threadsafe``); nothing blocks the event loop, and
      tokenizing, chat templates and building constraints run in a worker thread.
    * Admission: at most ``max_batch_size + max_waiting`` engine requests are outstanding; a
      request that would pass that gets 429 with ``Retry-After``. An engine request stays
      outstanding until its final output, so a cancelled one is counted until the engine drops it.
    * A client that goes away cancels its engine requests (a stream at once, a request not
      streamed within ``_WAIT`` seconds); so does a choice whose stop string was found before
      the engine saw it.
    * Draining (SIGTERM, Ctrl-C): new requests get 503 with ``Retry-After``; running ones finish
      (at most ``shutdown_timeout`` seconds), then the process exits 0. A second signal exits now.
    * Every wait has a timeout; an engine that stopped ends its requests with 503.

Errors have OpenAI's shape: 400 invalid values (``param`` names the field), 401 a missing or wrong
API key, 404 an unknown model or path, 413 a body over ``max_body_bytes``, 429 a full queue, 503
draining, 500 only for an internal fault (the server keeps serving).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from genjax.errors import GenerationConfigError, InputError, UnsupportedError
from genjax.serving.guided import ConstraintCache, constraint_eos, guided_spec
from genjax.serving.logprobs import ChoiceLogprobs, TokenTexts
from genjax.serving.prometheus import CONTENT_TYPE, ServerMetrics
from genjax.serving.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    bad_words_ids,
    derive_seed,
    engine_options,
    generation_options,
    invalid,
    messages_as_dicts,
    parse_request,
    truncated,
)
from genjax.serving.responses import (
    Choice,
    choice_delta,
    final_body,
    make_choices,
    stream_chunk,
    usage,
)

__all__ = ["build_app"]

_log = logging.getLogger(__name__)
_WAIT = 1.0  # seconds between checks that the engine still runs, while waiting for outputs
_REFUSED = (InputError, GenerationConfigError, UnsupportedError)


class _ClientGone(Exception):
    """The client of a non-streamed request disconnected."""


@dataclasses.dataclass
class _Subscription:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class _Dispatcher:
    """Routes the manager's outputs (loop thread) to the asyncio queue of their HTTP request,
    and counts outstanding engine requests (added, final output not yet published)."""

    def __init__(self, manager):
        self.manager = manager
        self._lock = threading.Lock()
        self._subs: dict[str, _Subscription] = {}
        self._outstanding: set[str] = set()
        manager.register_result_handler(self._on_output)

    @property
    def outstanding(self) -> int:
        return len(self._outstanding)

    def _on_output(self, output) -> None:
        with self._lock:
            if output.is_finished():
                self._outstanding.discard(output.request_id)
            sub = self._subs.get(output.request_id)
        if sub is not None:
            try:
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, output)
            except RuntimeError:  # the event loop has closed: nobody listens any more
                pass

    def reserve(self, ids: list[str], capacity: int, queue: asyncio.Queue) -> bool:
        """Subscribes ``ids`` to ``queue`` when they fit under ``capacity``; False otherwise."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if len(self._outstanding) + len(ids) > capacity:
                return False
            for request_id in ids:
                self._outstanding.add(request_id)
                self._subs[request_id] = _Subscription(loop, queue)
        return True

    def release(self, ids: list[str], never_added: set[str]) -> None:
        """Unsubscribes ``ids``; those in ``never_added`` (refused by the engine, so no final
        output will come) stop counting as outstanding."""
        with self._lock:
            for request_id in ids:
                self._subs.pop(request_id, None)
            self._outstanding.difference_update(never_added)


class _Server:
    """The state behind one app: the manager, tokenizer, admission and draining."""

    def __init__(self, manager, tokenizer, model_name, api_key, max_waiting, max_body_bytes):
        self.manager, self.tokenizer, self.model_name = manager, tokenizer, model_name
        self.api_key = None if api_key is None else api_key.encode()
        batch = manager.cb_config.max_batch_size
        self.capacity = batch + (max_waiting if max_waiting is not None else 1 << 30)
        self.max_n = min(self.capacity, 128)
        self.max_body_bytes = max_body_bytes
        self.context = manager.shape.max_length
        self.base_config = manager.generation_config
        self.vocab_size = manager.model.vocab_size
        self.token_texts = TokenTexts(tokenizer)
        self.dispatch = _Dispatcher(manager)
        self.guided = ConstraintCache(tokenizer, manager)
        self.metrics = ServerMetrics(manager)
        self.draining = False
        self.in_flight = 0
        self.created = int(time.time())

    # ---- checks -------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        if not hmac.compare_digest(given, self.api_key):
            raise APIError(
                401,
                "missing or incorrect API key: send `Authorization: Bearer <key>`.",
                "authentication_error",
                code="invalid_api_key",
            )

    def check_open(self) -> None:
        if self.draining or not self.manager.is_running():
            raise APIError(
                503,
                "the server is shutting down and takes no new requests.",
                "service_unavailable",
                code="shutting_down",
                headers={"Retry-After": "5"},
            )

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist on this server; it serves "
                f"{self.model_name!r} (see GET /v1/models).",
                param="model",
                code="model_not_found",
            )

    async def read_json(self, request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise self._too_large()
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > self.max_body_bytes:
                raise self._too_large()
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(400, f"the request body is not valid JSON: {error}.") from None

    def _too_large(self) -> APIError:
        message = f"the request body is larger than {self.max_body_bytes} bytes."
        return APIError(413, message, code="body_too_large")

    # ---- prompts ------------------------------------------------------------------------
    def prompts(self, body: CompletionRequest | ChatRequest) -> list[list[int]]:
        """The prompts' token ids, truncated as the request asks (runs in a worker thread)."""
        if isinstance(body, ChatRequest):
            if self.tokenizer.chat_template is None:
                raise invalid("messages", "this model has no chat template; use /v1/completions.")
            try:
                ids = self.tokenizer.apply_chat_template(
                    messages_as_dicts(body), add_generation_prompt=True
                )
            except InputError as error:
                raise invalid("messages", str(error)) from None
            except Exception as error:  # the template's raise_exception, a template bug
                raise invalid("messages", f"the chat template failed: {error}") from None
            return truncated([list(ids)], body.truncate_prompt_tokens, self.context)
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise invalid("prompt", "prompt must not be empty.")
        if all(isinstance(p, int) for p in prompt):
            prompt = [prompt]
        rows = []
        for p in prompt:
            ids = list(p) if isinstance(p, list) else self.tokenizer.encode(p)
            if not ids:
                raise invalid("prompt", "a prompt encodes to no tokens; send some text.")
            rows.append(ids)
        return truncated(rows, body.truncate_prompt_tokens, self.context)

    def budget(self, prompt_tokens: int, max_tokens: int | None, param: str) -> int:
        """New tokens for one prompt: ``max_tokens``, else the config's, within the context."""
        room = self.context - prompt_tokens
        if room < 1:
            raise invalid(
                param,
                f"the prompt has {prompt_tokens} tokens; this server's context holds "
                f"{self.context} tokens (prompt and completion). Shorten the prompt.",
                "context_length_exceeded",
            )
        if max_tokens is None:
            return min(self.base_config.max_new_tokens or room, room)
        if max_tokens > room:
            raise invalid(
                param,
                f"{param}={max_tokens} with a prompt of {prompt_tokens} tokens passes this "
                f"server's context of {self.context} tokens; ask for at most {room}.",
                "context_length_exceeded",
            )
        return max_tokens

    # ---- running a request --------------------------------------------------------------
    async def submit(self, body, queue: asyncio.Queue) -> list[Choice]:
        """Checks, tokenizes and adds every choice to the engine."""
        limits = self.manager.cb_config
        config, max_tokens, n, stops = generation_options(
            body,
            self.base_config,
            self.max_n,
            vocab_size=self.vocab_size,
            max_logit_bias=limits.max_logit_bias,
        )
        extras = engine_options(body, limits.max_top_logprobs)
        if body.bad_words:
            encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)
            banned = [*(config.bad_words_ids or ()), *bad_words_ids(body.bad_words, encode)]
            config = config.replace(bad_words_ids=banned)
        spec = guided_spec(body)
        if spec is not None:
            eos, config = constraint_eos(config, self.tokenizer)
            extras["constraint"] = await run_in_threadpool(self.guided.build, spec, eos)
        kind = "chat" if isinstance(body, ChatRequest) else "completion"
        rows = await run_in_threadpool(self.prompts, body)
        param = "messages" if isinstance(body, ChatRequest) else "prompt"
        if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
            limit = "max_completion_tokens"
        else:
            limit = "max_tokens"
        budgets = [self.budget(len(ids), max_tokens, param if max_tokens is None else limit)
                   for ids in rows]  # fmt: skip
        tag = uuid.uuid4().hex[:16]
        skip = body.skip_special_tokens is not False
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=skip)
        keep = bool(body.include_stop_str_in_output)
        lengths = [len(ids) for ids in rows]
        choices = make_choices(tag, lengths, n, decode, stops, config.eos_token_id, keep)
        if extras["logprobs"] is not None:
            for choice in choices:
                choice.scores = ChoiceLogprobs(kind, extras["logprobs"], self.token_texts)
        ids = [c.request_id for c in choices]
        if len(ids) > self.capacity:
            raise invalid(
                "n",
                f"{len(rows)} prompts x n={n} = {len(ids)} choices, more than this server holds "
                f"at once ({self.capacity}). Send fewer prompts or a smaller n.",
            )
        if not self.dispatch.reserve(ids, self.capacity, queue):
            raise APIError(
                429,
                f"the server's queue is full ({self.capacity} requests); retry shortly.",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        added: set[str] = set()
        try:
            for choice in choices:
                i = choice.prompt
                self.manager.add_request(
                    rows[i],
                    request_id=choice.request_id,
                    generation_config=config.replace(
                        max_new_tokens=budgets[i], stop_strings=list(stops) or None
                    ),
                    seed=derive_seed(body.seed, choice.index),
                    streaming=bool(body.stream),
                    **extras,
                )
                added.add(choice.request_id)
        except _REFUSED as error:
            self.cancel(choices)
            self.dispatch.release(ids, set(ids) - added)
            raise APIError(400, str(error), param=param) from None
        except BaseException:
            self.cancel(choices)
            self.dispatch.release(ids, set(ids) - added)
            raise
        return choices

    def cancel(self, choices: list[Choice]) -> None:
        for choice in choices:
            if not choice.done:
                self.manager.cancel_request(choice.request_id)

    async def outputs(
        self, choices: list[Choice], queue: asyncio.Queue, gone=None
    ) -> AsyncIterator:
        """Yields ``(choice, new_text)`` as outputs arrive, until every choice is done.

        ``gone``: for a request not streamed, an async ``() -> bool`` asked every ``_WAIT``
        seconds, True once the client has left (raises :class:`_ClientGone`); partial outputs
        are then only counted, not decoded."""
        by_id = {c.request_id: c for c in choices}
        next_check = time.monotonic() + _WAIT
        while not all(c.done for c in choices):
            try:
                output = await asyncio.wait_for(queue.get(), _WAIT)
            except asyncio.TimeoutError:
                if not self.manager.is_running():
                    raise APIError(
                        503, "the engine stopped.", "service_unavailable", code="engine_stopped"
                    ) from None
                output = None
            if gone is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + _WAIT
                if await gone():
                    raise _ClientGone()
            if output is None:
                continue
            choice = by_id.get(output.request_id)
            if choice is None or choice.done:
                continue
            final = output.is_finished()
            choice.tokens = len(output.generated_tokens)
            if choice.scores is not None:
                choice.scores.update(output)
            if gone is not None and not final:
                continue
            delta = choice.text.advance(choice.shown(output), final)
            if choice.text.stopped:
                choice.finish_reason = "stop"
                if not final:
                    self.manager.cancel_request(choice.request_id)
            elif final:
                if output.finish_reason in ("stop", "length"):
                    choice.finish_reason = output.finish_reason
                else:
                    choice.error = output.error or output.finish_reason or "failed"
            yield choice, delta


# ---------------------------------------------------------------------------- responses


def _failure(choices: list[Choice]) -> APIError | None:
    """The error of the first failed choice: 503 when the engine stopped, else 500."""
    for choice in choices:
        if choice.error == "cancelled":
            return APIError(
                503, "the engine stopped before the request finished.", "service_unavailable",
                code="engine_stopped", headers={"Retry-After": "5"},
            )  # fmt: skip
        if choice.error is not None:
            return APIError(500, f"generation failed: {choice.error}", "server_error")
    return None


class _EventStream(StreamingResponse):
    """A StreamingResponse that always closes its generator, so that a client going away
    cancels the engine requests at once (the generator's ``finally``)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _events(server: _Server, kind: str, body, choices, queue) -> AsyncIterator[str]:
    stream_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    created, model = int(time.time()), server.model_name
    chunk = lambda c: stream_chunk(kind, model, stream_id, created, c)
    try:
        if kind == "chat":
            for c in choices:
                role = {"index": c.index, "delta": {"role": "assistant", "content": ""}}
                yield chunk({**role, "logprobs": None, "finish_reason": None})
        async for choice, delta in server.outputs(choices, queue):
            logprobs = None if choice.scores is None else choice.scores.take()
            if delta or logprobs:
                yield chunk(choice_delta(kind, choice.index, delta or None, None, logprobs))
            if choice.error is not None:
                raise _failure([choice])
            if choice.finish_reason is not None:
                yield chunk(choice_delta(kind, choice.index, None, choice.finish_reason))
        if body.stream_options is not None and body.stream_options.include_usage:
            usage_chunk = {"id": stream_id, "created": created, "model": model, "choices": []}
            usage_chunk["object"] = "chat.completion.chunk" if kind == "chat" else "text_completion"
            usage_chunk["usage"] = usage(choices)
            yield f"data: {json.dumps(usage_chunk)}\n\n"
    except APIError as error:
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        server.cancel(choices)
        server.dispatch.release([c.request_id for c in choices], set())
    yield "data: [DONE]\n\n"


async def _generate(server: _Server, request: Request, kind: str):
    server.authorize(request)
    server.check_open()
    data = await server.read_json(request)
    body = parse_request(ChatRequest if kind == "chat" else CompletionRequest, data)
    server.check_model(body.model)
    queue: asyncio.Queue = asyncio.Queue()
    choices = await server.submit(body, queue)
    if body.stream:
        return _EventStream(
            _events(server, kind, body, choices, queue),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        async for _ in server.outputs(choices, queue, gone=request.is_disconnected):
            pass
    except _ClientGone:
        return Response(status_code=499)  # nobody reads it; the finally cancels the requests
    finally:
        server.cancel(choices)
        server.dispatch.release([c.request_id for c in choices], set())
    failure = _failure(choices)
    if failure is not None:
        raise failure
    return JSONResponse(final_body(kind, server.model_name, int(time.time()), choices))


# ---------------------------------------------------------------------------- the app

_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_PATHS = {*_GENERATION_PATHS, "/v1/models", "/health", "/metrics"}


class _Track:
    """ASGI middleware: counts requests by endpoint and status, and generation requests in
    flight (what draining waits for)."""

    def __init__(self, app, server: _Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        generating = path in _GENERATION_PATHS
        status = 500

        async def send_tracked(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        metrics = self.server.metrics
        metrics.in_flight.inc()
        self.server.in_flight += generating
        try:
            await self.app(scope, receive, send_tracked)
        finally:
            self.server.in_flight -= generating
            metrics.in_flight.dec()
            endpoint = path if path in _PATHS else "other"
            metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()


def build_app(
    manager,
    tokenizer,
    model_name: str,
    api_key: str | None = None,
    *,
    max_waiting: int | None = None,
    max_body_bytes: int = 8 << 20,
):
    """The OpenAI-compatible ASGI app over a started manager.

    Args:
        manager: a started :class:`~genjax.serving.ContinuousBatchingManager` (the app neither
            starts nor stops it); its ``generation_config`` gives the defaults of requests.
        tokenizer: a :class:`genjax.io.tokenizer.Tokenizer` (its chat template for chat).
        model_name: the name requests must give in ``model``.
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
        max_waiting: engine requests that may wait beyond ``max_batch_size`` running ones
            before new requests get 429; None: no bound.
        max_body_bytes: larger request bodies get 413.

    Returns:
        A FastAPI app; its ``state.genjax`` has ``draining`` (set it to refuse new requests
        with 503) and ``in_flight`` (generation requests being answered).

    Example:
        >>> app = build_app(manager, tokenizer, "genjax-tiny")  # doctest: +SKIP
        >>> uvicorn.run(app, host="127.0.0.1", port=8000)  # doctest: +SKIP
    """
    server = _Server(manager, tokenizer, model_name, api_key, max_waiting, max_body_bytes)
    app = FastAPI(title="genjax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.genjax = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        body = APIError(error.status_code, str(error.detail), code=code).body()
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, error: Exception):
        _log.exception("internal error answering %s", request.url.path)
        message = f"internal server error ({type(error).__name__}); the server keeps serving."
        return JSONResponse(APIError(500, message, "server_error").body(), status_code=500)

    @app.get("/v1/models")
    async def list_models(request: Request):
        server.authorize(request)
        card = {"id": model_name, "object": "model", "created": server.created}
        return {"object": "list", "data": [{**card, "owned_by": "genjax"}]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request):
        server.authorize(request)
        server.check_model(name)
        card = {"id": model_name, "object": "model", "created": server.created}
        return {**card, "owned_by": "genjax"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(server, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(server, request, "chat")

    @app.get("/health")
    async def health():
        if server.draining or not manager.is_running():
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(_Track, server=server)
    return app
