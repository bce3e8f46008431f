"""Serving metrics: fixed-bucket latency histograms fed from the per-token timestamps.

A :class:`Histogram` keeps counts per bucket of fixed edges (Prometheus-style: bucket ``i``
counts values ``<= edges[i]`` and above ``edges[i - 1]``, the last bucket everything above the
last edge), with the sum and count, so that two snapshots subtract and rates and means follow.

The engine records one host timestamp per new token, taken when the step that chose it returns.
A step runs up to ``K`` decode iterations, so tokens of one step share a timestamp: the
inter-token latency is what a streaming client sees, bursts included (zero within a burst).
"""

from __future__ import annotations

import bisect
import dataclasses

__all__ = ["ITL_EDGES", "TTFT_EDGES", "Histogram"]

TTFT_EDGES = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Seconds: bucket edges of the time to first token (arrival to first new token)."""

ITL_EDGES = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Seconds: bucket edges of the inter-token latency (between a request's new tokens)."""


@dataclasses.dataclass
class Histogram:
    """Counts of values per fixed bucket, with their sum.

    Example:
        >>> h = Histogram((0.1, 1.0))
        >>> for value in (0.05, 0.1, 0.5, 7.0):
        ...     h.add(value)
        >>> h.snapshot()
        {'edges': [0.1, 1.0], 'counts': [2, 1, 1], 'count': 4, 'sum': 7.65}
    """

    edges: tuple[float, ...]
    counts: list[int] = dataclasses.field(default_factory=list)
    total: float = 0.0

    def __post_init__(self):
        if not self.counts:
            self.counts = [0] * (len(self.edges) + 1)

    def add(self, value: float) -> None:
        """Counts one value."""
        self.counts[bisect.bisect_left(self.edges, value)] += 1
        self.total += value

    def snapshot(self) -> dict:
        """A plain copy: ``edges``, ``counts`` (one more than the edges), ``count``, ``sum``."""
        return dict(
            edges=list(self.edges),
            counts=list(self.counts),
            count=sum(self.counts),
            sum=round(self.total, 9),
        )
