"""The static sizes of the continuous-batching engine (:class:`ContinuousBatchingConfig`)."""

from __future__ import annotations

import dataclasses

from genjax.errors import InputError
from genjax.serving.engine import EngineShape

__all__ = ["ContinuousBatchingConfig"]


@dataclasses.dataclass(frozen=True)
class ContinuousBatchingConfig:
    """Static sizes of the engine (each one shapes the compiled step).

    Attributes:
        max_batch_size: ``R``, requests decoded together.
        block_size: slots per cache block.
        max_length: the most tokens (prompt plus new) of one request; rounded up to blocks.
        num_blocks: blocks in the pool (the scratch block included); None: enough for
            ``max_batch_size`` requests of ``max_length`` (no preemption).
        prefill_chunk_size: ``C``, prompt tokens prefilled per step.
        max_decode_steps: ``K``, decode steps per host round trip when nothing waits.
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
        max_no_repeat_ngram_size: ``N``, the largest ``no_repeat_ngram_size`` a request may
            set; each step compares ``N - 1`` offsets of every history (in steps where a row
            uses it); 0 leaves the option out of the compiled step.
        max_constraint_states: ``S_p``, states in the engine's pool of structured-output
            automata (:mod:`genjax.serving.constraint_pool`); an automaton of ``n`` states takes
            ``n + 1``. 0: no pool, and a request with a constraint raises InputError.
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

    def engine_shape(self) -> EngineShape:
        """The :class:`EngineShape` these settings give."""
        for name in ("max_batch_size", "block_size", "max_length", "prefill_chunk_size"):
            if getattr(self, name) < 1:
                raise InputError(f"ContinuousBatchingConfig.{name} must be >= 1.")
        per_row = -(-self.max_length // self.block_size)
        blocks = self.num_blocks or self.max_batch_size * per_row + 1
        if blocks - 1 < per_row:
            raise InputError(
                f"num_blocks={blocks} holds {blocks - 1} usable blocks, fewer than the {per_row} "
                f"one request of max_length={self.max_length} may need. Raise num_blocks to at "
                f"least {per_row + 1} or lower max_length."
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
        )
