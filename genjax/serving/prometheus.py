"""Prometheus metrics of ``genjax serve``: the manager's counters read at each scrape, and the
HTTP requests the server answered.

Every number of :meth:`ContinuousBatchingManager.metrics` becomes one metric named
``genjax_<key>``: a counter (``genjax_<key>_total``) for the running totals (``steps``,
``tokens``, ``preemptions``, ``step_seconds``), a gauge for the rest (``blocks_in_use``,
``waiting``, ``running`` and any key the manager adds later). The server adds
``genjax_http_requests_total{endpoint, status}`` and ``genjax_http_requests_in_flight``.

Each :class:`ServerMetrics` has its own registry, so several apps in one process do not collide.
"""

from __future__ import annotations

import numbers

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_COUNTERS = {"steps", "tokens", "preemptions", "step_seconds"}


class _ManagerCollector:
    """Reads ``manager.metrics()`` at each scrape."""

    def __init__(self, manager):
        self.manager = manager

    def collect(self):
        for key, value in sorted(self.manager.metrics().items()):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                continue
            name = "genjax_" + "".join(c if c.isalnum() else "_" for c in key)
            text = f"the engine's {key!r} (ContinuousBatchingManager.metrics())"
            family = CounterMetricFamily if key in _COUNTERS else GaugeMetricFamily
            yield family(name, text, value=float(value))


class ServerMetrics:
    """The registry of one app.

    Example:
        >>> class Fake:
        ...     def metrics(self):
        ...         return {"steps": 3, "running": 0}
        >>> print(ServerMetrics(Fake()).render().decode().count("genjax_steps_total 3.0"))
        1
    """

    def __init__(self, manager):
        self.registry = CollectorRegistry()
        self.registry.register(_ManagerCollector(manager))
        self.requests = Counter(
            "genjax_http_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "genjax_http_requests_in_flight",
            "HTTP requests being answered",
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
