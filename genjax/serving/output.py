"""What the continuous-batching manager hands back for a request: :class:`GenerationOutput`, a
snapshot of the host record (:class:`~genjax.serving.scheduler.RequestState`) taken when it is
published."""

from __future__ import annotations

import dataclasses

from genjax.serving.scheduler import RequestState, RequestStatus

__all__ = ["GenerationOutput", "output_of"]


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
    """One request's result (final) or progress (streaming).

    ``logprobs`` and ``top_logprobs`` are set for a request added with ``logprobs=k`` (an int
    ``k >= 0``), one entry per generated token: the token's log-probability under the model's
    raw distribution (``log_softmax`` of its logits, before any processor, as vLLM reports by
    default), and the ``k`` most likely tokens as ``(token_id, logprob)`` pairs, most likely
    first.

    A request of ``num_return_sequences = n`` has ``n`` sequences (vLLM's ``outputs``):
    ``sequences[j]`` (row ``j`` of ``genjax.generate``'s output with the same key, its new
    tokens), ``finish_reasons[j]``, and with ``logprobs=k`` ``sequence_logprobs[j]`` and
    ``sequence_top_logprobs[j]``; ``generated_tokens``, ``finish_reason``, ``timestamps``,
    ``logprobs`` and ``top_logprobs`` are sequence 0's. Its final output comes once every
    sequence has ended: ``status`` FAILED if one failed, else CANCELLED if one was cancelled,
    else FINISHED; before that, the status of the first sequence still running. A request of
    one sequence has ``sequences == [generated_tokens]``.
    """

    request_id: str
    prompt_ids: list[int]
    generated_tokens: list[int]
    status: RequestStatus
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    error: str | None = None
    created_time: float = 0.0
    timestamps: list[float] = dataclasses.field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    sequences: list[list[int]] = dataclasses.field(default_factory=list)
    finish_reasons: list[str | None] = dataclasses.field(default_factory=list)
    sequence_logprobs: list[list[float]] | None = None
    sequence_top_logprobs: list[list[list[tuple[int, float]]]] | None = None

    def is_finished(self) -> bool:
        """True for a final output."""
        return self.status in (
            RequestStatus.FINISHED,
            RequestStatus.CANCELLED,
            RequestStatus.FAILED,
        )


def output_of(request: RequestState) -> GenerationOutput:
    """The output to publish for ``request``'s id now, over all its sequences (lists copied)."""
    members = request.members
    first = members[0]
    scored = first.num_logprobs is not None
    logprobs = [list(r.logprobs) for r in members] if scored else None
    top_logprobs = [list(r.top_logprobs) for r in members] if scored else None
    return GenerationOutput(
        request_id=first.request_id,
        prompt_ids=list(first.prompt),
        generated_tokens=list(first.generated),
        status=_status(members),
        finish_reason=first.finish_reason,
        error=next((r.error for r in members if r.error is not None), None),
        created_time=first.created_time,
        timestamps=list(first.timestamps),
        logprobs=logprobs[0] if scored else None,
        top_logprobs=top_logprobs[0] if scored else None,
        sequences=[list(r.generated) for r in members],
        finish_reasons=[r.finish_reason for r in members],
        sequence_logprobs=logprobs,
        sequence_top_logprobs=top_logprobs,
    )


def _status(members: list[RequestState]) -> RequestStatus:
    """One status for a request's sequences (see :class:`GenerationOutput`)."""
    running = [r.status for r in members if not r.done]
    if running:
        return running[0]
    statuses = {r.status for r in members}
    for status in (RequestStatus.FAILED, RequestStatus.CANCELLED):
        if status in statuses:
            return status
    return RequestStatus.FINISHED
