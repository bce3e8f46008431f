"""The host side of continuous batching: the block allocator and the FIFO scheduler.

Plain Python and numpy (no threads, no JAX computation, so nothing compiles here). The scheduler
owns the block tables and the slot of each running request; each round trip it builds one
:class:`~genjax.serving.engine.StepInput` with :meth:`Scheduler.plan` and reads the step's
:class:`~genjax.serving.engine.StepOutput` back with :meth:`Scheduler.absorb`.

Policy:

* FIFO admission: the oldest waiting requests take free slots while fewer than ``P``
  (``max_prefill_requests``) prompts are being prefilled; each prompt then runs ``C`` tokens
  per step beside the decoding rows, the prefilling prompts' chunks in one model call. (Requests
  sharing leading blocks with a prompt being prefilled, such as the records of one request's
  ``num_return_sequences``, wait until it has filled them, and find them in the prefix cache.)
* Blocks are allocated as requests grow, just before the step that writes them; a step runs
  one decode iteration while a prompt is being prefilled, else up to ``K`` (the device loop
  returns after an iteration in which a row finished, so a waiting request's slot frees as
  soon as with one iteration per step).
* When blocks run out, the newest running request is preempted: its blocks are freed, its slot
  released, and it goes back to the front of the queue; readmitted, it prefills its prompt and
  the tokens it already generated (recomputation, as vLLM's default preemption) and continues.
* A finished request (EOS, ``max_new_tokens``, a stop string) frees its slot and blocks at once,
  before its final output is published.
* Prefix caching (on by default): an admitted request first takes the cached blocks of its
  longest known prefix (:mod:`genjax.serving.blocks`) and prefills only what follows (at least
  its last token, whose logits choose the first new token); each full block it prefills is named
  for later requests. With an int8 pool (``kv_cache_dtype="int8"``) the prefix taken is cut to
  a multiple of ``C`` tokens (of ``lcm(block_size, C)``): a chunk's tokens attend to each other
  exactly and to earlier ones through their int8 codes, so every chunk must start at a multiple
  of ``C``, as in ``genjax.generate(..., prefill_chunk_size=C)``, for a block to hold the same
  values whichever request wrote it.
  Preemption and cancellation drop the request's references like finishing.
* ``num_return_sequences = n``: a request runs as ``n`` records of the same id
  (:meth:`RequestState.fork`), queued together; with prefix caching the first prefills the
  prompt and the others share its full blocks. Cancelling the id ends every one.
* Structured output: a request with a constraint takes a reference to its automaton in the
  constraint pool (:mod:`genjax.serving.constraint_pool`) when admitted, and drops it with its
  slot. When the automaton cannot be placed (the pool is full of automata in use), the request
  stays at the head of the queue, and the requests behind it wait too (FIFO), until running
  requests free space. Admitted, its row starts in the automaton's initial state, or, readmitted
  after a preemption, in the state its generated tokens lead to (walked on the host).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import time
from typing import Any

import numpy as np

from genjax.cache import SCRATCH_BLOCK
from genjax.constraints import Constraint
from genjax.serving.blocks import BlockAllocator, block_hashes
from genjax.serving.constraint_pool import ConstraintPool, walk
from genjax.serving.engine import EngineShape, RowSettings, StepInput, StepOutput

__all__ = ["BlockAllocator", "RequestState", "RequestStatus", "Scheduler"]


class RequestStatus(enum.Enum):
    """Where a request is in its life; the last three are final."""

    PENDING = "pending"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclasses.dataclass(eq=False)
class RequestState:
    """The host's record of one request."""

    request_id: str
    prompt: list[int]  # the prompt as given
    row: RowSettings  # [1] values written into the slot on admission
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...] = ()
    streaming: bool = False
    num_logprobs: int | None = None  # None: no log-probabilities; k: the chosen's and the top k
    created_time: float = dataclasses.field(default_factory=time.time)
    max_time: float | None = None  # seconds from its first admission (transformers' max_time)
    started: float | None = None  # the scheduler's clock at its first admission
    generated: list[int] = dataclasses.field(default_factory=list)
    timestamps: list[float] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # per generated token
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: str | None = None
    error: str | None = None
    slot: int | None = None
    blocks: list[int] = dataclasses.field(default_factory=list)
    pending: list[int] = dataclasses.field(default_factory=list)  # prefill tokens (prompt + gen)
    prefilled: int = 0  # tokens of `pending` already in the cache
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # of `pending`'s full blocks
    named: int = 0  # leading blocks already named in the prefix cache (shared or registered)
    admitted: bool = False  # its settings were written into the slot
    order: int = 0  # admission counter: the largest is the newest (preempted first)
    text_checked: int = 0  # characters of the decoded text already searched for stop strings
    constraint: Constraint | None = None  # structured output: the automaton the tokens follow
    constraint_key: bytes = b""  # its content digest (the pool's key)
    constraint_state: int = -1  # while it holds a slot: its row's starting pool state
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    copies: int = 1  # the request's num_return_sequences
    sequence: int = 0  # this record's sequence among them (RowSettings.sample_row)
    family: list[RequestState] = dataclasses.field(default_factory=list)  # the request's
    #   records, one per sequence, when copies > 1 (shared by all of them); else empty

    @property
    def members(self) -> list[RequestState]:
        """The records of this record's request: its family, or itself alone."""
        return self.family or [self]

    def fork(self) -> list[RequestState]:
        """The records the scheduler runs for this request, one per sequence.

        Itself when ``copies`` is 1; else ``copies`` records of the same id, sequence ``j``
        drawing as row ``j`` of ``genjax.generate``'s batch (``RowSettings.sample_row``). They
        are queued together and run as independent requests sharing the prompt's blocks: with
        prefix caching the first prefills the prompt and names its full blocks, and each
        other takes them and prefills only the tokens after the last full block (at least
        one, whose logits choose its first token); without it, each prefills the prompt.
        """
        if self.copies == 1:
            return [self]
        family: list[RequestState] = []
        for j in range(self.copies):
            family.append(
                dataclasses.replace(
                    self,
                    row=self.row.replace(sample_row=np.asarray([j], np.int32)),
                    sequence=j,
                    family=family,
                    generated=[],
                    timestamps=[],
                    logprobs=[],
                    top_logprobs=[],
                    blocks=[],
                    pending=[],
                    hashes=[],
                    extra={},
                )
            )
        return family

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt) + len(self.generated)

    @property
    def done(self) -> bool:
        """True once the request has its final status."""
        return self.status in (
            RequestStatus.FINISHED,
            RequestStatus.CANCELLED,
            RequestStatus.FAILED,
        )


class Scheduler:
    """FIFO admission, chunked prefill, block allocation and preemption (see the module doc).

    Args:
        shape: the engine's static sizes.
        tokenizer: decodes tokens for stop strings; None when no request has stop strings.
        prefix_caching: share the cached blocks of equal prompt prefixes.
        constraints: the constraint pool's host copy; None: no request has a constraint.
        clock: seconds for ``max_time`` (``time.monotonic``; a test may pass its own).
    """

    def __init__(
        self,
        shape: EngineShape,
        tokenizer=None,
        prefix_caching: bool = True,
        constraints: ConstraintPool | None = None,
        clock=time.monotonic,
    ):
        self.shape = shape
        self.clock = clock
        self.constraints = constraints
        self.tokenizer = tokenizer
        self.prefix_caching = prefix_caching
        self.allocator = BlockAllocator(shape.num_blocks)
        self.slots: list[RequestState | None] = [None] * shape.max_batch_size
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.prefilling: list[RequestState] = []  # admission order: the lanes' order
        self.tables = np.zeros((shape.max_batch_size, shape.max_blocks_per_row), np.int32)
        self.release = np.zeros((shape.max_batch_size,), bool)
        self.num_preemptions = 0
        self.prefill_tokens = 0  # tokens run through prefill chunks
        self.prefix_query_tokens = 0  # tokens admitted requests looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, tokens found (their prefill skipped)
        self._admissions = 0
        self._chunks: list[tuple[RequestState, int, bool]] = []  # (request, count, last) of
        #   each lane the planned step runs
        # Cached prefixes are taken in runs of this many blocks: 1, or with an int8 pool the
        # blocks of lcm(block_size, C) tokens (chunks then start at multiples of C).
        run = math.lcm(shape.block_size, shape.chunk) // shape.block_size
        self._prefix_blocks = run if shape.quantized else 1

    # ---- requests coming and going ------------------------------------------------------
    def add(self, request: RequestState) -> None:
        """Queues a request (FIFO)."""
        self.waiting.append(request)

    @property
    def running(self) -> list[RequestState]:
        """Requests holding a slot."""
        return [r for r in self.slots if r is not None]

    @property
    def has_work(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting) or any(r is not None for r in self.slots)

    def _vacate(self, request: RequestState) -> None:
        """Frees the request's slot and blocks (its row is released on the next step)."""
        if request.slot is not None:
            self.release[request.slot] = True
            self.tables[request.slot] = SCRATCH_BLOCK
            self.slots[request.slot] = None
            request.slot = None
        self.allocator.free(request.blocks)
        request.blocks = []
        if request.constraint_state >= 0:
            self.constraints.release(request.constraint_key)
            request.constraint_state = -1
        if request in self.prefilling:
            self.prefilling.remove(request)

    def finish(self, request: RequestState, status: RequestStatus, reason: str, error=None):
        """Ends a request: frees what it holds and records its final status."""
        if request in self.waiting:
            self.waiting.remove(request)
        self._vacate(request)
        request.status, request.finish_reason, request.error = status, reason, error

    def _preempt(self, request: RequestState) -> None:
        self._vacate(request)
        request.status = RequestStatus.PENDING
        request.admitted = False
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    # ---- planning a step ----------------------------------------------------------------
    def _admit(self) -> None:
        while len(self.prefilling) < self.shape.prefill_lanes and self._admit_one():
            pass

    def _admit_one(self) -> bool:
        """Admits the oldest waiting request; False when none can start now."""
        if not self.waiting or None not in self.slots:
            return False
        request = self.waiting[0]
        if self._waits_for_a_prefix(request):
            return False
        if request.constraint is not None:
            start = self.constraints.acquire(request.constraint_key, request.constraint)
            if start is None:  # no room in the pool until running requests end
                return False
            request.constraint_state = start + walk(request.constraint, request.generated)
        self.waiting.popleft()
        request.slot = self.slots.index(None)
        self.slots[request.slot] = request
        request.pending = request.prompt + request.generated
        request.prefilled = 0
        request.hashes, request.named = [], 0
        if self.prefix_caching:
            self._take_cached_prefix(request)
        request.status = RequestStatus.PREFILLING
        if request.max_time is not None and request.started is None:
            request.started = self.clock()  # preempted and readmitted: the first admission's
        self._admissions += 1
        request.order = self._admissions
        self.prefilling.append(request)
        return True

    def _waits_for_a_prefix(self, request: RequestState) -> bool:
        """True when a prompt being prefilled shares whole leading blocks with the request's
        and has not filled them all yet: admitted once it has, the request finds them in the
        prefix cache rather than prefilling them again (a burst of chats with one system
        prompt; a request's ``num_return_sequences`` records)."""
        if not self.prefix_caching or not self.prefilling:
            return False
        size = self.shape.block_size
        tokens = request.prompt + request.generated
        usable = (len(tokens) - 1) // size  # its last token is always prefilled
        mine = block_hashes(tokens, size)[:usable]
        # Chained hashes: equal ones are the shared leading blocks.
        return any(
            other.named < sum(a == b for a, b in zip(mine, other.hashes, strict=False))
            for other in self.prefilling
        )

    def _take_cached_prefix(self, request: RequestState) -> None:
        """Gives the request the cached blocks of its longest known prefix, leaving at least
        its last token to prefill."""
        size = self.shape.block_size
        request.hashes = block_hashes(request.pending, size)
        usable = (len(request.pending) - 1) // size
        blocks = self.allocator.match(request.hashes[:usable], self._prefix_blocks)
        request.blocks = blocks
        request.named = len(blocks)
        request.prefilled = len(blocks) * size
        self.tables[request.slot, : len(blocks)] = blocks
        self.prefix_query_tokens += len(request.pending)
        self.prefix_hit_tokens += request.prefilled

    def _name_prefilled_blocks(self, request: RequestState) -> None:
        """Names the request's blocks that its prefill has filled, for later requests."""
        full = min(request.prefilled // self.shape.block_size, len(request.hashes))
        for i in range(request.named, full):
            self.allocator.register(request.blocks[i], request.hashes[i])
        request.named = max(request.named, full)

    def _slots_needed(self, request: RequestState, steps: int) -> int:
        """Cache slots the request writes in a step of ``steps`` decode iterations."""
        cap = len(request.prompt) + request.max_new_tokens - 1  # the last token is never fed
        if request in self.prefilling:
            count = min(self.shape.chunk, len(request.pending) - request.prefilled)
            end = request.prefilled + count
            if end < len(request.pending):
                return end
            return max(end, min(end + steps, cap))
        return max(request.num_tokens - 1, min(request.num_tokens - 1 + steps, cap))

    def _allocate(self, steps: int) -> bool:
        """Grows every running request's blocks for the step; False when the pool is short."""
        size = self.shape.block_size
        wanted = []
        for request in self.running:
            need = -(-self._slots_needed(request, steps) // size) - len(request.blocks)
            if need > 0:
                wanted.append((request, need))
        if sum(n for _, n in wanted) > self.allocator.num_free:
            return False
        for request, need in wanted:
            first = len(request.blocks)
            request.blocks += self.allocator.allocate(need)
            self.tables[request.slot, first : len(request.blocks)] = request.blocks[first:]
        return True

    def plan(self) -> StepInput | None:
        """The next step's input, or None when nothing runs or waits."""
        self._admit()
        # One iteration while a prompt is prefilled (its next chunk comes next step). A request
        # still waiting here waits for a row to finish (no free slot, or no room in the
        # constraint pool), and the decode loop returns after the iteration in which one does:
        # running K iterations does not delay it, and a step of one iteration would pay the
        # rows' gather and scatter for a single token.
        steps = 1 if self.prefilling else self.shape.max_steps
        while not self._allocate(steps):
            if steps > 1:
                steps = 1
                continue
            self._preempt(max(self.running, key=lambda r: r.order))
        if not self.running:
            return None
        return self._step_input(steps)

    def decode_rows(self, ending=(), bucket: int | None = None) -> np.ndarray:
        """int32[B_k]: the slots the step decodes: every running request's but the prefilling
        ones' (except those in ``ending``, whose last chunk runs: their first token comes this
        step), then free slots up to the smallest bucket that holds them (or ``bucket``)."""
        active = [request.slot for request in self._decoding(ending)]
        if bucket is None:
            bucket = next(b for b in self.shape.buckets if b >= len(active))
        chosen = set(active)
        fill = [slot for slot in range(self.shape.max_batch_size) if slot not in chosen]
        return np.asarray(active + fill[: bucket - len(active)], np.int32)

    def span(self, ending=()) -> int:
        """``M_s``: the shortest of :attr:`EngineShape.spans` holding the blocks of every
        request the step decodes (:meth:`decode_rows`; a request's blocks cover what the step
        writes: :meth:`_allocate`)."""
        longest = max((len(r.blocks) for r in self._decoding(ending)), default=0)
        return next(s for s in self.shape.spans if s >= longest)

    def _decoding(self, ending=()) -> list[RequestState]:
        """The requests a step decodes: every running one but the prefilling ones, except
        those in ``ending`` (their first token comes this step)."""
        return [
            request
            for request in self.slots
            if request is not None and (request not in self.prefilling or request in ending)
        ]

    def _step_input(
        self,
        steps: int,
        bucket: int | None = None,
        span: int | None = None,
        prefill_span: int | None = None,
        lanes: int | None = None,
        chunk_size: int | None = None,
    ) -> StepInput:
        """The step's input; ``bucket`` and ``span`` force the decoded-row count and the decode
        loop's attention span, ``lanes``, ``chunk_size`` and ``prefill_span`` the prompt
        chunks' count, length and span (warm-up compiles each)."""
        shape = self.shape
        if lanes is None:
            lanes = next(p for p in shape.lane_buckets if p >= len(self.prefilling))
        counts = [min(shape.chunk, len(r.pending) - r.prefilled) for r in self.prefilling]
        if chunk_size is None:  # the shortest chunk length holding every lane's tokens
            chunk_size = next(c for c in shape.chunks if c >= max(counts, default=1))
        chunk = np.zeros((lanes, chunk_size), np.int32)
        history = np.zeros((lanes, shape.max_length), np.int32)
        slot = np.full((lanes,), -1, np.int32)
        start, count = np.zeros((lanes,), np.int32), np.ones((lanes,), np.int32)
        last, admit = np.zeros((lanes,), bool), np.zeros((lanes,), bool)
        prompt_length = np.zeros((lanes,), np.int32)
        automaton = np.full((lanes,), -1, np.int32)
        rows = [RowSettings.empty(1, shape)] * lanes
        self._chunks = []
        for i, request in enumerate(self.prefilling):
            slot[i], start[i], count[i] = request.slot, request.prefilled, counts[i]
            last[i] = request.prefilled + count[i] == len(request.pending)
            chunk[i, : count[i]] = request.pending[start[i] : start[i] + count[i]]
            admit[i], prompt_length[i] = not request.admitted, len(request.prompt)
            automaton[i] = request.constraint_state
            if admit[i]:  # the cached prefix's tokens, which no chunk carries
                history[i, : start[i]] = request.pending[: start[i]]
                rows[i] = request.row
            request.admitted = True
            self._chunks.append((request, int(count[i]), bool(last[i])))
        if prefill_span is None:  # the shortest span holding every chunk's tokens
            blocks = -(-int((start + count)[slot >= 0].max(initial=0)) // shape.block_size)
            prefill_span = next(s for s in shape.prefill_spans(chunk_size) if s >= blocks)
        prefill_table = np.zeros((lanes, prefill_span), np.int32)
        prefill_table[slot >= 0] = self.tables[slot[slot >= 0], :prefill_span]
        ending = [request for request, _, ends in self._chunks if ends]
        decode_rows = self.decode_rows(ending, bucket)
        work = StepInput(
            block_tables=self.tables.copy(),
            release=self.release.copy(),
            num_steps=np.asarray(steps, np.int32),
            prefill_slot=slot,
            prefill_start=start,
            prefill_tokens=chunk,
            prefill_count=count,
            prefill_last=last,
            prefill_table=prefill_table,
            prompt_length=prompt_length,
            row=RowSettings.stack(rows),
            admit=admit,
            constraint_state=automaton,
            history=history,
            decode_rows=decode_rows,
            decode_tables=self.tables[decode_rows, : span or self.span(ending)],
        )
        self.release[:] = False
        return work

    # ---- reading a step's output --------------------------------------------------------
    def absorb(self, out: StepOutput) -> list[tuple[RequestState, int]]:
        """Appends the step's tokens to their requests and finishes those that ended.

        Args:
            out: the step's output, as numpy arrays.

        Returns:
            ``(request, new_tokens)`` for every request that received tokens or finished.
        """
        updates: dict[int, tuple[RequestState, int]] = {}
        now = time.time()

        def add(request, token, scored, index):
            if request.done:
                return
            request.generated.append(int(token))
            request.timestamps.append(now)
            if request.num_logprobs is not None:
                logprob, ids, values = (np.asarray(x)[index] for x in scored)
                k = request.num_logprobs
                request.logprobs.append(float(logprob))
                pairs = zip(ids[:k].tolist(), values[:k].tolist(), strict=True)
                request.top_logprobs.append([(t, v) for t, v in pairs if t >= 0])
            count = updates.get(id(request), (request, 0))[1]
            updates[id(request)] = (request, count + 1)
            self._check_end(request, token)

        first = (out.first.logprobs, out.first.top_ids, out.first.top_logprobs)
        for lane, (request, count, last) in enumerate(self._chunks):
            if request not in self.prefilling:
                continue  # ended meanwhile (cancelled)
            request.prefilled += count
            self.prefill_tokens += count
            if self.prefix_caching:
                self._name_prefilled_blocks(request)
            if last:
                self.prefilling.remove(request)
                request.status = RequestStatus.DECODING
                add(request, out.first_token[lane], first, lane)
        self._chunks = []
        scored = (out.logprobs, out.top_ids, out.top_logprobs)
        for i in range(int(out.steps)):
            for slot, token in enumerate(out.tokens[i]):
                owner = self.slots[slot]
                if token >= 0 and owner is not None:
                    add(owner, token, scored, (i, slot))
        for slot, ended in enumerate(out.finished):
            owner = self.slots[slot]
            if ended and owner is not None and not owner.done:
                self._end_by_rule(owner)
                updates.setdefault(id(owner), (owner, 0))
        self._end_past_max_time([request for request, _ in updates.values()])
        return list(updates.values())

    def _end_past_max_time(self, requests: list[RequestState]) -> None:
        """Ends (reason "length") the requests that received tokens after their ``max_time``:
        as transformers' ``MaxTimeCriteria``, checked once a token is out, here once per round
        trip, so a request keeps the tokens of the trip that crossed its limit."""
        timed = [r for r in requests if r.max_time is not None and not r.done]
        now = self.clock() if timed else 0.0
        for request in timed:
            if now - request.started > request.max_time:
                self.finish(request, RequestStatus.FINISHED, "length")

    def _end_by_rule(self, request: RequestState) -> None:
        last = request.generated[-1] if request.generated else None
        reason = "stop" if last in request.eos_token_ids else "length"
        self.finish(request, RequestStatus.FINISHED, reason)

    def _check_end(self, request: RequestState, token: int) -> None:
        """Host-side end rules for the token just appended: EOS, the length, stop strings."""
        if int(token) in request.eos_token_ids:
            self.finish(request, RequestStatus.FINISHED, "stop")
        elif len(request.generated) >= request.max_new_tokens:
            self.finish(request, RequestStatus.FINISHED, "length")
        elif request.stop_strings and self._stop_string_hit(request):
            self.finish(request, RequestStatus.FINISHED, "stop")

    def _stop_string_hit(self, request: RequestState) -> bool:
        """True when the decoded new text now contains a stop string (checked from where the
        last check could not have seen a match); the tokens after it are not kept."""
        text = self.tokenizer.decode(request.generated)
        longest = max(len(s) for s in request.stop_strings)
        begin = max(0, request.text_checked - longest + 1)
        request.text_checked = len(text)
        return any(s in text[begin:] for s in request.stop_strings)
