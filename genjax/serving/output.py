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

    def is_finished(self) -> bool:
        """True for a final output."""
        return self.status in (
            RequestStatus.FINISHED,
            RequestStatus.CANCELLED,
            RequestStatus.FAILED,
        )


def output_of(request: RequestState) -> GenerationOutput:
    """The output to publish for ``request`` now (lists copied)."""
    scored = request.num_logprobs is not None
    return GenerationOutput(
        request_id=request.request_id,
        prompt_ids=list(request.prompt),
        generated_tokens=list(request.generated),
        status=request.status,
        finish_reason=request.finish_reason,
        error=request.error,
        created_time=request.created_time,
        timestamps=list(request.timestamps),
        logprobs=list(request.logprobs) if scored else None,
        top_logprobs=list(request.top_logprobs) if scored else None,
    )
