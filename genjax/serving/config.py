"""The static sizes of the continuous-batching engine (:class:`ContinuousBatchingConfig`).

The KV pool is sized in blocks (``num_blocks``), or from a byte budget
(``kv_cache_memory_bytes``, vLLM's name) divided by the bytes of one block as
:func:`genjax.cache.memory.paged_block_bytes` counts them: with ``kv_cache_dtype="int8"`` a block
takes about half the bytes of a bfloat16 one and a quarter of a float32 one, so the same budget
holds about twice (four times) the blocks, and tokens.
"""

from __future__ import annotations

import dataclasses

from genjax.cache.memory import paged_block_bytes
from genjax.errors import InputError
from genjax.serving.engine import EngineShape

__all__ = ["KV_CACHE_DTYPES", "SHORTEST_SPAN", "ContinuousBatchingConfig", "attention_spans"]

SHORTEST_SPAN = 256
"""The shortest attention span (tokens) of ``ContinuousBatchingConfig.attention_spans=None``;
the others are it times powers of 4 below ``max_length``, then ``max_length``."""

KV_CACHE_DTYPES = ("auto", "int8")
"""Values of ``ContinuousBatchingConfig.kv_cache_dtype`` (and ``genjax serve --kv-cache-dtype``)."""


@dataclasses.dataclass(frozen=True)
class ContinuousBatchingConfig:
    """Static sizes of the engine (each one shapes the compiled step).

    Attributes:
        max_batch_size: ``R``, requests decoded together.
        block_size: slots per cache block.
        max_length: the most tokens (prompt plus new) of one request; rounded up to blocks.
        num_blocks: blocks in the pool (the scratch block included); None: as many as
            ``kv_cache_memory_bytes`` holds, or when that is None too, enough for
            ``max_batch_size`` requests of ``max_length`` (no preemption).
        kv_cache_memory_bytes: the pool's size in bytes (per device, all layers, keys, values
            and scales); the pool gets ``kv_cache_memory_bytes // paged_block_bytes(...)``
            blocks, the scratch block included (:func:`genjax.cache.memory.paged_block_bytes`).
            None: ``num_blocks`` decides. Setting both raises InputError.
        kv_cache_dtype: what the pool stores: ``"auto"``, the model's dtype; ``"int8"``, int8
            codes with one scale (in the model's dtype) per key or value vector of one slot and
            KV head, as ``genjax.generate``'s ``cache_implementation="quantized"`` with
            ``cache_config={"nbits": 8}`` (:mod:`genjax.cache.paged`). Each model call attends
            to its own tokens' exact keys and values and to the earlier ones dequantized, so a
            request runs the computation of ``genjax.generate`` of it alone with that cache and
            ``prefill_chunk_size=prefill_chunk_size`` (prefix-cache hits are cut to whole
            chunks to keep it; the README's "The int8 KV pool" says what preemption and
            rounding change). The engine's choice for every request: a request asking
            ``cache_implementation="quantized"`` runs only on an int8 pool.
        prefill_chunk_size: ``C``, prompt tokens prefilled per step and request.
        prefill_chunk_sizes: shorter chunk lengths (below ``C``) a step's prompt chunks may
            run in: a step runs its chunks in the shortest of these and ``C`` that holds each
            one, so a prompt's last tokens (38-token chat prompts with ``C = 32``: 6) cost about
            their own rows of products rather than ``C``. Each is a prefill program per lane
            count and span. None: ``C / 2`` and ``C / 4`` where whole and at least 8 (``C = 32``:
            8 and 16; ``C = 8``: none); ``()``: ``C`` alone.
        max_prefill_requests: ``P``, the most requests whose prompt chunks run in one step
            (one model call of ``P_k`` rows of ``C`` tokens, ``P_k`` the smallest of the powers
            of two below ``P`` and ``P`` holding them): requests that arrive together start
            together rather than one a step. Each ``P_k`` is a compiled prefill program per
            span; a call costs ``P_k`` chunks whatever their lengths.
        attention_spans: the lengths (tokens, each rounded up to whole blocks) the decode loop
            and the prompt chunks may attend over; every one is a compiled decode program per
            decoded-row bucket and a prefill program (when it holds a whole chunk), and a step
            attends over the shortest that holds its decoding rows' blocks, a chunk over the
            shortest that holds its tokens, so short requests do not pay for ``max_length``
            (:func:`~genjax.serving.config.attention_spans`).
            ``max_length`` is always one. None: :data:`SHORTEST_SPAN` (256) tokens times the
            powers of 4 below ``max_length`` (256, 1024, then ``max_length``: at most 3 programs
            per bucket to ``max_length`` 4096); ``()``: ``max_length`` alone (fewest programs,
            fastest warmup).
        max_decode_steps: ``K``, decode steps per host round trip while no prompt is being
            prefilled (the round trip ends early once a row finishes).
        max_eos_tokens: the most EOS ids per request.
        max_logit_bias: ``L_b``, the most entries of a request's bias table: its
            ``sequence_bias`` sequences (OpenAI's ``logit_bias``), ``suppress_tokens``,
            ``bad_words_ids`` and ``begin_suppress_tokens``.
        max_bias_sequence_length: the longest ``sequence_bias`` or ``bad_words_ids`` sequence
            a request may give; each step compares the last ``max_bias_sequence_length - 1``
            tokens of every history with each entry's prefix (in steps where a row has a
            bias), and the table holds ``L_b * (max_bias_sequence_length - 1)`` prefix ids per
            row. 1: single tokens only.
        max_top_logprobs: the most top log-probabilities a request may ask per token
            (``logprobs=k``); 0 leaves them out of the compiled step.
        max_no_repeat_ngram_size: ``N``, the largest ``no_repeat_ngram_size`` (and
            ``encoder_no_repeat_ngram_size``) a request may set; each step compares ``N - 1``
            offsets of every history (in steps where a row uses it); 0 leaves the option out
            of the compiled step.
        max_constraint_states: ``S_p``, states in the engine's pool of structured-output
            automata (:mod:`genjax.serving.constraint_pool`); an automaton of ``n`` states takes
            ``n + 1``. 0: no pool, and a request with a constraint raises InputError. The
            server also bounds each guided build by it (and by ``max_constraint_edges``):
            an automaton that would not fit is refused before it is built
            (:mod:`genjax.constraints.limits`).
        max_constraint_edges: ``E_p``, transitions in the pool (a JSON-schema automaton over a
            4096-token vocabulary takes from thousands to a few hundred thousand). The pool
            takes ``S_p * ceil(V / 32) * 4 + 4 * E_p`` bytes of device memory (``V`` the
            vocabulary): 6 MiB by default for the bundled model.
        prefix_caching: share the cache blocks of equal prompt prefixes (full blocks only).
        poll_interval: the longest single wait of the loop and of callers (each is woken by the
            event it waits for; this only bounds it).
    """

    max_batch_size: int = 8
    block_size: int = 16
    max_length: int = 512
    num_blocks: int | None = None
    prefill_chunk_size: int = 32
    prefill_chunk_sizes: tuple[int, ...] | None = None
    max_prefill_requests: int = 1
    attention_spans: tuple[int, ...] | None = None
    max_decode_steps: int = 8
    max_eos_tokens: int = 4
    max_logit_bias: int = 300
    max_bias_sequence_length: int = 8
    max_top_logprobs: int = 20
    max_no_repeat_ngram_size: int = 8
    max_constraint_states: int = 4096
    max_constraint_edges: int = 2**20
    prefix_caching: bool = True
    poll_interval: float = 0.05
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None

    def engine_shape(self, model=None) -> EngineShape:
        """The :class:`EngineShape` these settings give; ``model`` (its layers, KV heads, head
        size and dtype) is needed only to size the pool from ``kv_cache_memory_bytes``.

        Raises:
            InputError: a size below 1, an unknown ``kv_cache_dtype``, both ``num_blocks`` and
                ``kv_cache_memory_bytes``, or a pool that cannot hold one whole request.
        """
        for name in (
            "max_batch_size",
            "block_size",
            "max_length",
            "prefill_chunk_size",
            "max_prefill_requests",
        ):
            if getattr(self, name) < 1:
                raise InputError(f"ContinuousBatchingConfig.{name} must be >= 1.")
        if self.max_prefill_requests > self.max_batch_size:
            raise InputError(
                f"ContinuousBatchingConfig.max_prefill_requests={self.max_prefill_requests} "
                f"exceeds max_batch_size={self.max_batch_size}: at most every slot can prefill "
                f"at once; lower it to {self.max_batch_size} or less."
            )
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InputError(
                f"ContinuousBatchingConfig.kv_cache_dtype={self.kv_cache_dtype!r} is not "
                f"supported; use one of {list(KV_CACHE_DTYPES)}: 'auto' keeps the model's "
                f"dtype, 'int8' stores int8 codes with one scale per head vector."
            )
        per_row = -(-self.max_length // self.block_size)
        blocks = self._pool_blocks(model)
        if blocks is None:
            blocks = self.max_batch_size * per_row + 1
        if blocks - 1 < per_row:
            budget = ""
            if self.kv_cache_memory_bytes is not None:
                budget = f" (kv_cache_memory_bytes={self.kv_cache_memory_bytes:,})"
            raise InputError(
                f"num_blocks={blocks}{budget} holds {blocks - 1} usable blocks, fewer than the "
                f"{per_row} one request of max_length={self.max_length} may need. Raise "
                f"num_blocks (or kv_cache_memory_bytes) to at least {per_row + 1} blocks, lower "
                f"max_length, or store the pool with kv_cache_dtype='int8'."
            )
        states, edges = self.max_constraint_states, self.max_constraint_edges
        if states < 0 or (states > 0 and edges < 1):
            raise InputError(
                f"ContinuousBatchingConfig.max_constraint_states={states} and "
                f"max_constraint_edges={edges}: both must be >= 1 for a constraint pool, or "
                f"max_constraint_states 0 for none."
            )
        return EngineShape(
            max_batch_size=self.max_batch_size,
            num_blocks=blocks,
            block_size=self.block_size,
            max_blocks_per_row=per_row,
            chunk=self.prefill_chunk_size,
            max_steps=max(1, self.max_decode_steps),
            max_eos=max(1, self.max_eos_tokens),
            max_bias=max(0, self.max_logit_bias),
            max_bias_prefix=max(0, self.max_bias_sequence_length - 1),
            max_top_logprobs=max(0, self.max_top_logprobs),
            max_ngram=max(0, self.max_no_repeat_ngram_size),
            constraint_states=states,
            constraint_edges=edges if states else 0,
            kv_cache_dtype=self.kv_cache_dtype,
            span_blocks=self._span_blocks(),
            prefill_lanes=self.max_prefill_requests,
            chunk_sizes=self._chunk_sizes(),
        )

    def _chunk_sizes(self) -> tuple[int, ...]:
        """``prefill_chunk_sizes`` checked, or its default (:attr:`EngineShape.chunks` adds
        ``C``)."""
        chunk, sizes = self.prefill_chunk_size, self.prefill_chunk_sizes
        if sizes is None:
            return tuple(c for c in (chunk // 4, chunk // 2) if c >= 8 and chunk % c == 0)
        if not isinstance(sizes, tuple | list) or any(
            isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= chunk for c in sizes
        ):
            raise InputError(
                f"ContinuousBatchingConfig.prefill_chunk_sizes={sizes!r}: give a tuple of chunk "
                f"lengths from 1 to prefill_chunk_size={chunk} (None: {chunk} / 2 and / 4 when "
                f"whole and at least 8; (): prefill_chunk_size alone)."
            )
        return tuple(sorted(set(sizes) - {chunk}))

    def _span_blocks(self) -> tuple[int, ...]:
        """``attention_spans`` in blocks (:attr:`EngineShape.spans` adds the whole table)."""
        spans = self.attention_spans
        if spans is None:
            return attention_spans(self.max_length, self.block_size, SHORTEST_SPAN)
        listed = isinstance(spans, tuple | list)
        if not listed or any(
            isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= self.max_length
            for s in spans
        ):
            raise InputError(
                f"ContinuousBatchingConfig.attention_spans={spans!r}: give a tuple of token "
                f"counts from 1 to max_length={self.max_length} (None: {SHORTEST_SPAN} times "
                f"powers of 4; (): max_length alone)."
            )
        return tuple(sorted({-(-s // self.block_size) for s in spans}))

    def _pool_blocks(self, model) -> int | None:
        """The blocks ``num_blocks`` or ``kv_cache_memory_bytes`` asks for (None: neither)."""
        budget = self.kv_cache_memory_bytes
        if budget is None:
            return self.num_blocks or None
        if self.num_blocks is not None:
            raise InputError(
                f"ContinuousBatchingConfig sets both num_blocks={self.num_blocks} and "
                f"kv_cache_memory_bytes={budget}; set one of them."
            )
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise InputError(
                f"ContinuousBatchingConfig.kv_cache_memory_bytes must be a positive int (bytes), "
                f"got {budget!r}."
            )
        if model is None:
            raise InputError(
                "ContinuousBatchingConfig.kv_cache_memory_bytes sizes the pool from the model's "
                "block size in bytes: call engine_shape(model)."
            )
        return budget // paged_block_bytes(model, self.block_size, self.kv_cache_dtype == "int8")


def attention_spans(
    max_length: int, block_size: int, shortest: int, growth: int = 4
) -> tuple[int, ...]:
    """The decode loop's attention spans in blocks: ``shortest`` tokens times the powers of
    ``growth`` below ``max_length``, then ``max_length``, each rounded up to whole blocks.

    The decode loop reads every slot of the block tables it is given, and on a CPU that read
    (the gathered keys and values, written and read again) costs as much as the weights at a
    few rows: a step attends over the smallest span that holds its rows' blocks, so its cost
    follows the longest request in flight rather than ``max_length``. Measured on SmolLM-135M
    (``bench/engine_spans.py``, Intel Xeon, CPU time), 8 rows of 128 tokens: 768 slots cost
    1.43x 256 slots; 32 rows of 100 tokens: 256 slots cost 1.16x 128. Each span is a program
    per row bucket (about as slow to compile as the others), hence a few spans far apart
    rather than many.

    Example:
        >>> attention_spans(4096, 16, 256)  # 256 and 1024 tokens, then 4096
        (16, 64, 256)
        >>> attention_spans(768, 16, 128, growth=2)
        (8, 16, 32, 48)
        >>> attention_spans(200, 16, 256)
        (13,)
    """
    blocks = -(-max_length // block_size)
    spans, size = set(), max(1, shortest)
    while size < max_length:
        spans.add(-(-size // block_size))
        size *= max(2, growth)
    return tuple(sorted({*(s for s in spans if s < blocks), blocks}))
