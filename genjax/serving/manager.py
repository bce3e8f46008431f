"""The continuous-batching manager: transformers v5's ``ContinuousBatchingManager`` API over the
engine's programs (:mod:`genjax.serving.step`) and the host scheduler (:mod:`.scheduler`).

One background thread runs the loop: take new requests and cancellations, plan a step, run the
step's programs, hand the tokens to their requests (a finished request's blocks are freed here),
take the metrics snapshot, publish outputs (result handlers run here, in the loop thread). So a
cancellation a handler asks for is handled before the next step, and when ``get_result``
returns, the request holds no block. Callers talk to the loop through one thread-safe queue and
wait on a condition that every publication signals; every wait is bounded, and every request
ends with one final :class:`GenerationOutput` (finished, cancelled or failed): ``stop()`` cancels
what is left, and an error in the loop fails every request, so ``get_result`` and
``request_id_iter`` never hang. :meth:`~ContinuousBatchingManager.pause` holds the loop between
steps (to replace ``params``).

Example:
    >>> sizes = ContinuousBatchingConfig(max_batch_size=2, max_length=64)
    >>> manager = init_continuous_batching(model, params, config, sizes)
    >>> manager.start()
    >>> rid = manager.add_request([483, 288, 860], max_new_tokens=4)  # "def f():"
    >>> manager.get_result(rid, timeout=60).generated_tokens
    [267, 342, 783, 328]
    >>> manager.stop()
"""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from genjax.cache.memory import check_pool_fits
from genjax.config import GenerationConfig
from genjax.errors import InputError, UnsupportedError
from genjax.generation.inputs import effective_config
from genjax.serving.config import ContinuousBatchingConfig
from genjax.serving.constraint_pool import ConstraintPool
from genjax.serving.engine import engine_layout, init_state
from genjax.serving.metrics import ITL_EDGES, TTFT_EDGES, Histogram
from genjax.serving.options import EngineOptions, build_request, request_config
from genjax.serving.output import GenerationOutput, output_of
from genjax.serving.programs import EnginePrograms
from genjax.serving.scheduler import RequestState, RequestStatus, Scheduler

__all__ = [
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "GenerationOutput",
    "init_continuous_batching",
]

_log = logging.getLogger(__name__)


class ContinuousBatchingManager:
    """Runs requests through the engine in a background thread; see the module docstring.

    Build it with :func:`init_continuous_batching`. ``params`` may be replaced between steps
    under :meth:`pause` (same structure and shapes: nothing recompiles).
    """

    def __init__(
        self, model, params, generation_config=None, cb_config=None, tokenizer=None, mesh=None
    ):
        self._layout = engine_layout(model, mesh)  # None: one device
        self.model, self.params, self.tokenizer = model, params, tokenizer
        default = getattr(model, "generation_config", None)  # fills what the manager's leaves unset
        self.generation_config = effective_config(generation_config, {}, default)
        self.cb_config = cb_config or ContinuousBatchingConfig()
        self.shape = self.cb_config.engine_shape(model)
        shape = self.shape
        # Raises CacheMemoryError before anything is allocated when the pool cannot fit.
        self._pool_bytes = check_pool_fits(
            model, shape.num_blocks, shape.block_size, shape.quantized, self._layout
        )
        self._programs = EnginePrograms(model, params, shape, self._layout)
        self._state = None
        self._constraints = None  # the constraint pool's host copy (none: no constraints)
        if self.shape.constraint_states:
            self._constraints = ConstraintPool(
                shape.constraint_states,
                shape.constraint_edges,
                model.vocab_size,
                None if self._layout is None else self._layout.sharding(),
            )
        self._scheduler = Scheduler(
            self.shape, tokenizer, self.cb_config.prefix_caching, self._constraints
        )
        self._inbox: queue.Queue = queue.Queue()  # ("add", request) or ("cancel", request_id)
        # Guards what callers read: outputs, finals, the metrics snapshot, `_ended`. Reentrant:
        # a result handler (loop thread) may call back into the manager.
        self._cond = threading.Condition(threading.RLock())
        self._streams: dict[str, collections.deque[GenerationOutput]] = {}
        self._finals: dict[str, GenerationOutput] = {}
        self._results: collections.deque[GenerationOutput] = collections.deque()
        self._ended = False  # the loop has ended and every request has its final output
        self._gate = threading.Condition()  # pause(): `_pauses` > 0 holds the loop between steps
        self._pauses = 0
        self._busy = False  # a step (plan, device call, publishing) is under way
        self._handlers: list[Callable[[GenerationOutput], Any]] = []
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ids = itertools.count()
        self._counters = {"steps": 0, "tokens": 0, "step_seconds": 0.0, "busy_seconds": 0.0}
        self._ttft = Histogram(TTFT_EDGES)
        self._itl = Histogram(ITL_EDGES)
        self._snapshot: dict[str, Any] = {}
        self._refresh()

    @property
    def params(self):
        """The model's parameters; on a mesh, a new value is placed as ``genjax.generate``
        places them (:meth:`~genjax.sharding.Layout.place_params`)."""
        return self._params

    @params.setter
    def params(self, value) -> None:
        self._params = value if self._layout is None else self._layout.place_params(value)

    # ---- lifecycle ----------------------------------------------------------------------
    def warmup(self) -> None:
        """Compiles the engine's programs (:class:`~genjax.serving.programs.EnginePrograms`)
        and allocates its state now, so that serving compiles nothing (programs another
        manager of the same model and sizes compiled are reused)."""
        if self._state is None:
            self._state = init_state(self.model, self.shape, layout=self._layout)
        self._programs.compile(self.params, self._state, self._pool())

    def _step(self, work):
        """Runs the step's programs on the current state (donated), with the constraint pool
        (uploaded again when an automaton was installed)."""
        return self._programs.step(self.params, self._state, work, self._pool())

    def _pool(self):
        """The constraint pool on the device, or None when the engine has none."""
        return None if self._constraints is None else self._constraints.device()

    def start(self) -> None:
        """Starts the background loop (warming up first if needed)."""
        if self.is_running():
            return
        self.warmup()
        with self._cond:
            self._stopping.clear()
            self._ended = False
        self._thread = threading.Thread(target=self._run, name="genjax-cb", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        """True while the loop thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stops the loop; requests not finished end CANCELLED. ``block`` waits for the thread
        (at most ``timeout`` seconds). On a manager never started, the queued requests end
        CANCELLED at once."""
        self._stopping.set()
        if self._thread is None:
            self._shutdown(self._scheduler, RequestStatus.CANCELLED, "cancelled", None)
            return
        self._inbox.put(("wake", None))
        with self._gate:
            self._gate.notify_all()
        if block:
            self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Waits for the loop thread to end (at most ``timeout`` seconds)."""
        if self._thread is not None:
            self._thread.join(timeout)

    @contextlib.contextmanager
    def pause(self, timeout: float | None = None) -> Iterator[None]:
        """Holds the loop between steps: on entry, waits for the running step to end (its
        outputs published); inside, no step runs, so ``manager.params`` may be replaced.
        Requests may still be added and cancelled. Works from a result handler too.

        Raises:
            TimeoutError: the running step did not end within ``timeout`` seconds.

        Example:
            >>> with manager.pause():  # doctest: +SKIP
            ...     manager.params = new_params
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._gate:
            self._pauses += 1
            in_loop = threading.current_thread() is self._thread
            while self._busy and not in_loop:
                wait = self.cb_config.poll_interval
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        self._pauses -= 1
                        self._gate.notify_all()
                        raise TimeoutError(f"the running step did not end within {timeout} s.")
                self._gate.wait(wait)
        try:
            yield
        finally:
            with self._gate:
                self._pauses -= 1
                self._gate.notify_all()

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self,
        input_ids: Sequence[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        generation_config: GenerationConfig | None = None,
        seed: int | None = None,
        constraint=None,
        **config_overrides,
    ) -> str:
        """Checks and queues one request; returns its id.

        Args:
            input_ids: int[P], the prompt.
            request_id: a unique id; None makes one (``req_<n>``).
            max_new_tokens: overrides the config's.
            streaming: publish a partial output after each step that gave it tokens.
            generation_config: this request's config; its unset fields come from the
                manager's.
            seed: the sampling seed (``jax.random.key(seed)``); None draws one.
            constraint: structured output: a :class:`genjax.constraints.Constraint` (from
                ``regex``, ``json_schema``, ``json_object`` or ``choice``) the new tokens follow,
                as ``genjax.generate(..., constraint=)`` applies it; its EOS id must be one of
                the request's. Requests with the same automaton share it on the device.
            **config_overrides: config fields for this request, and the
                :class:`~genjax.serving.options.EngineOptions` the config has no field for:
                ``presence_penalty``, ``frequency_penalty`` (OpenAI's) and ``logprobs`` (k:
                each new token's raw log-probability and the top k, in the outputs).
                ``num_return_sequences=n`` (with ``do_sample``; at most ``max_batch_size``)
                runs ``n`` sequences of the prompt, sequence ``j`` equal to row ``j`` of
                ``genjax.generate`` with ``key=jax.random.key(seed)``; they share the prompt's
                cached blocks, stream and end under the one id, and fill
                :attr:`GenerationOutput.sequences`.

        Raises:
            UnsupportedError, InputError, GenerationConfigError: see
            :func:`genjax.serving.options.build_request`; also InputError for a duplicate id
            and for a constraint the engine cannot run (naming the config field to raise).
        """
        if max_new_tokens is not None:
            config_overrides["max_new_tokens"] = max_new_tokens
        if constraint is not None:
            config_overrides["constraint"] = constraint
        extras, config_overrides = EngineOptions.split(config_overrides)
        config = request_config(self.generation_config, generation_config, config_overrides)
        if request_id is None:
            request_id = f"req_{next(self._ids)}"
        with self._cond:
            if request_id in self._streams:
                raise InputError(f"request_id {request_id!r} is already in use.")
            request = build_request(
                request_id,
                input_ids,
                config,
                self.shape,
                self.model.vocab_size,
                seed=seed,
                streaming=streaming,
                tokenizer=self.tokenizer,
                extras=extras,
            )
            records = request.fork()  # one per sequence (num_return_sequences)
            self._streams[request_id] = collections.deque()
            if self._stopping.is_set():  # the loop drains the inbox under this lock once
                for record in records:
                    record.status, record.finish_reason = RequestStatus.CANCELLED, "cancelled"
                self._publish(records[0], final=True)
            else:
                self._inbox.put(("add", records))
        return request_id

    def add_requests(self, inputs: Sequence[Sequence[int]], **kwargs) -> list[str]:
        """:meth:`add_request` for each prompt; returns their ids."""
        return [self.add_request(ids, **kwargs) for ids in inputs]

    def cancel_request(self, request_id: str) -> None:
        """Cancels a request; it ends with a CANCELLED output (unless already finished). Called
        from a result handler, the cancellation takes effect before the next step."""
        self._inbox.put(("cancel", request_id))

    def register_result_handler(self, handler: Callable[[GenerationOutput], Any]) -> None:
        """Calls ``handler(output)`` (in the loop thread, between steps) for every output
        published."""
        self._handlers.append(handler)

    def _wait_until(self, ready: Callable[[], bool], deadline: float | None) -> bool:
        """Waits (holding ``_cond``) until ``ready()`` or the loop has ended; False on timeout.
        Woken by every publication; the poll interval only bounds each wait."""
        while not ready() and not self._ended:
            wait = self.cb_config.poll_interval
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    return False
            self._cond.wait(wait)
        return True

    def get_result(
        self, request_id: str | None = None, timeout: float | None = None
    ) -> GenerationOutput | None:
        """The final output of ``request_id``, or, when None, the next final output in finishing
        order (each returned once). None after ``timeout`` seconds, at once for an unknown id,
        and once the manager has stopped without one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if request_id is None:
                self._wait_until(lambda: bool(self._results), deadline)
                return self._results.popleft() if self._results else None
            if request_id not in self._streams:
                return None
            self._wait_until(lambda: request_id in self._finals, deadline)
            return self._finals.get(request_id)

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator:
        """Yields the request's outputs: partial ones when streaming, then the final one. Ends
        after ``timeout`` seconds in all, at once for an unknown id, and when the manager stops.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            stream = self._streams.get(request_id)
        while stream is not None:
            with self._cond:
                if not self._wait_until(lambda: bool(stream), deadline) or not stream:
                    return
                output = stream.popleft()
            yield output
            if output.is_finished():
                return

    def metrics(self) -> dict[str, Any]:
        """A snapshot, taken between steps (before their outputs are published).

        Keys: ``running``, ``waiting`` (requests); ``blocks_in_use`` (held by requests),
        ``blocks_free`` (held by none, cached ones included), ``blocks_cached`` (held by none
        but naming a prefix); ``kv_cache_bytes`` (the pool's size, scratch block included:
        :func:`~genjax.cache.memory.check_pool_fits`) and ``kv_cache_tokens`` (the slots of
        its usable blocks; both fixed); ``prefill_tokens`` (run through prefill),
        ``prefix_cache_hit_rate`` (of the tokens admitted requests looked up, the share found
        cached) with ``prefix_cache_hit_tokens`` and ``prefix_cache_query_tokens``;
        ``constraint_automata`` (automata installed in the constraint pool); ``steps``, ``tokens``
        (generated), ``preemptions``, ``step_seconds`` (device calls), ``busy_seconds`` (wall
        time of steps), ``tokens_per_second`` (tokens / busy_seconds); ``ttft_seconds`` and
        ``itl_seconds``: histograms (:class:`~genjax.serving.metrics.Histogram` snapshots).
        """
        with self._cond:
            return copy.deepcopy(self._snapshot)

    # ---- the loop -----------------------------------------------------------------------
    def _refresh(self) -> None:
        """Takes the metrics snapshot (loop thread, or before the loop starts)."""
        scheduler, counters = self._scheduler, self._counters
        allocator = scheduler.allocator
        queried = scheduler.prefix_query_tokens
        busy = counters["busy_seconds"]
        snapshot = {
            **counters,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "preemptions": scheduler.num_preemptions,
            "blocks_in_use": allocator.num_used,
            "blocks_free": allocator.num_free,
            "blocks_cached": allocator.num_cached,
            "kv_cache_bytes": self._pool_bytes,
            "kv_cache_tokens": (self.shape.num_blocks - 1) * self.shape.block_size,
            "prefill_tokens": scheduler.prefill_tokens,
            "prefix_cache_hit_tokens": scheduler.prefix_hit_tokens,
            "prefix_cache_query_tokens": queried,
            "prefix_cache_hit_rate": scheduler.prefix_hit_tokens / queried if queried else 0.0,
            "constraint_automata": 0
            if self._constraints is None
            else self._constraints.num_installed,
            "tokens_per_second": counters["tokens"] / busy if busy > 0 else 0.0,
            "ttft_seconds": self._ttft.snapshot(),
            "itl_seconds": self._itl.snapshot(),
        }
        with self._cond:
            self._snapshot = snapshot

    def _record_latencies(self, request: RequestState, count: int) -> None:
        """Feeds the histograms with the timestamps of the request's ``count`` new tokens."""
        stamps = request.timestamps
        new = len(stamps) - count
        if count and new == 0:
            self._ttft.add(stamps[0] - request.created_time)
        for i in range(max(new, 1), len(stamps)):
            self._itl.add(stamps[i] - stamps[i - 1])

    def _publish(self, request: RequestState, final: bool) -> None:
        """Publishes the output of ``request``'s id (all its sequences); final only once every
        sequence has ended, and nothing after the final one."""
        if request.request_id in self._finals:
            return
        final = final and all(r.done for r in request.members)
        output = output_of(request)
        with self._cond:
            if final:
                self._finals[request.request_id] = output
                self._results.append(output)
            if final or request.streaming:
                self._streams[request.request_id].append(output)
            self._cond.notify_all()
        for handler in self._handlers:
            try:
                handler(output)
            except Exception:  # a user's handler must not stop the engine
                _log.exception("result handler failed")

    def _handle(self, scheduler: Scheduler, message) -> None:
        kind, payload = message
        if kind == "add":  # a request's records, one per sequence
            for request in payload:
                scheduler.add(request)
        elif kind == "cancel":
            requests = [*scheduler.waiting, *scheduler.running]
            ended = [r for r in requests if r.request_id == payload and not r.done]
            for request in ended:
                scheduler.finish(request, RequestStatus.CANCELLED, "cancelled")
            if ended:
                self._refresh()
                self._publish(ended[0], final=True)

    def _take_messages(self, scheduler: Scheduler, block: bool) -> None:
        """Handles every queued message; ``block`` first waits (bounded) for one."""
        try:
            if block:
                self._handle(scheduler, self._inbox.get(timeout=self.cb_config.poll_interval))
            while True:
                self._handle(scheduler, self._inbox.get_nowait())
        except queue.Empty:
            pass

    @contextlib.contextmanager
    def _stepping(self) -> Iterator[bool]:
        """Marks a step under way once no pause holds the loop; yields False when stopping."""
        with self._gate:
            while self._pauses and not self._stopping.is_set():
                self._gate.wait(self.cb_config.poll_interval)
            self._busy = True
        try:
            yield not self._stopping.is_set()
        finally:
            with self._gate:
                self._busy = False
                self._gate.notify_all()

    def _run_step(self, scheduler: Scheduler) -> None:
        begin = time.perf_counter()
        work = scheduler.plan()
        if work is None:
            return
        self._state, out = self._step(work)
        out = jax.device_get(out)
        self._counters["step_seconds"] += time.perf_counter() - begin
        self._counters["steps"] += 1
        updates = scheduler.absorb(out)
        for request, count in updates:
            self._counters["tokens"] += count
            self._record_latencies(request, count)
        self._counters["busy_seconds"] += time.perf_counter() - begin
        self._refresh()  # blocks of finished requests are already free
        touched: dict[str, RequestState] = {}  # one publication per request id
        for request, count in updates:
            if request.done or count:
                touched.setdefault(request.request_id, request)
        for request in touched.values():
            self._publish(request, final=request.done)

    def _run(self) -> None:
        scheduler = self._scheduler
        reason, status, error = "cancelled", RequestStatus.CANCELLED, None
        try:
            while not self._stopping.is_set():
                self._take_messages(scheduler, block=not scheduler.has_work)
                with self._stepping() as go:
                    if go:
                        self._take_messages(scheduler, block=False)
                        self._run_step(scheduler)
        except Exception as exc:  # every request must still end
            _log.exception("continuous-batching loop failed")
            reason, status, error = "error", RequestStatus.FAILED, repr(exc)
        finally:
            self._shutdown(scheduler, status, reason, error)

    def _shutdown(self, scheduler: Scheduler, status, reason: str, error) -> None:
        """Ends every request left (queued ones included), then marks the loop ended."""
        messages = []
        with self._cond:  # add_request checks `_stopping` under this lock: nothing is lost
            self._stopping.set()
            try:
                while True:
                    messages.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
        for message in messages:
            self._handle(scheduler, message)
        left = [*scheduler.waiting, *scheduler.running]
        for request in left:
            scheduler.finish(request, status, reason, error)
        self._refresh()
        for request in left:
            self._publish(request, final=True)
        with self._cond:
            self._ended = True
            self._cond.notify_all()


def init_continuous_batching(
    model,
    params,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    tokenizer=None,
    mesh: jax.sharding.Mesh | None = None,
) -> ContinuousBatchingManager:
    """Builds a :class:`ContinuousBatchingManager` (not started).

    Args:
        model: a genjax decoder-only model (static: it shapes the compiled step).
        params: its parameters (traced).
        generation_config: the default config of requests; its unset fields (all of them for
            None) come from ``model.generation_config``, as ``genjax.generate`` fills them.
        continuous_batching_config: the engine's static sizes.
        tokenizer: decodes new tokens for ``stop_strings``.
        mesh: a ``jax.sharding.Mesh`` to run the engine on (static), as ``genjax.generate(...,
            mesh=)``: params split by :data:`genjax.sharding.DEFAULT_RULES` (heads and MLP
            columns on ``model``), the paged KV pool (and an int8 pool's scales) split over KV
            heads on ``model`` (replicated when they do not divide it, as in ``generate``),
            everything else replicated: the engine's rows are not split over ``data``. Tokens
            equal one device's. None: the default device.

    Raises:
        UnsupportedError: an encoder-decoder model (T5, BART): the engine's paged cache holds
            decoder-only self-attention; run those with ``genjax.generate``.
        InputError: a bad ``continuous_batching_config`` value (naming it; see
            :meth:`ContinuousBatchingConfig.engine_shape`).
        CacheMemoryError: the KV pool would not fit in the device's free memory
            (:func:`~genjax.cache.memory.check_pool_fits`).
        ShardingError: query heads that do not divide over the mesh's ``model`` axis.
        UnsupportedError: 4-bit params on a mesh (:func:`~genjax.sharding.check_no_four_bit`).

    Example:
        >>> manager = init_continuous_batching(model, params)
    """
    if getattr(model, "is_encoder_decoder", False):
        raise UnsupportedError(
            f"the continuous-batching engine runs decoder-only models; {type(model).__name__} is "
            "an encoder-decoder model. Generate with genjax.generate(model, params, ids, config)."
        )
    return ContinuousBatchingManager(
        model, params, generation_config, continuous_batching_config, tokenizer, mesh
    )
