"""Prometheus metrics every service defines the same way.

``counter`` / ``gauge`` / ``histogram`` create a metric in the default registry once and hand
back the same object when asked again, so a module imported twice (tests, reloads) does not hit
prometheus_client's duplicate-registration error. Name metrics ``epd_<service>_<what>_<unit>``;
``services/common/server.py`` serves them on each process's metrics port.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

from prometheus_client import Counter, Gauge, Histogram

M = TypeVar("M", Counter, Gauge, Histogram)

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                  5.0, 7.5, 10.0, 20.0, 40.0)
"""Time to first token: prompt processing, queueing and (disaggregated) the KV transfer."""
INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05,
                         0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
"""Time between two output tokens of one request (one decode step plus scheduling)."""
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
                 90.0, 120.0, 300.0)
"""Whole-request latency, arrival to last token."""

_created: dict[str, Counter | Gauge | Histogram] = {}


def counter(name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
    return _get_or_create(Counter, name, documentation, labelnames)


def gauge(name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
    return _get_or_create(Gauge, name, documentation, labelnames)


def histogram(name: str, documentation: str, labelnames: Sequence[str] = (),
              buckets: Sequence[float] = E2E_BUCKETS_S) -> Histogram:
    return _get_or_create(Histogram, name, documentation, labelnames, buckets=tuple(buckets))


def _get_or_create(kind: type[M], name: str, documentation: str, labelnames: Sequence[str],
                   **kwargs: object) -> M:
    existing = _created.get(name)
    if existing is None:
        metric = kind(name, documentation, labelnames=tuple(labelnames), **kwargs)
        _created[name] = metric
        return metric
    # Asking again with a different shape is a bug: two modules claiming one name.
    if type(existing) is not kind or existing._labelnames != tuple(labelnames):
        raise RuntimeError(f"metric {name} already exists as {type(existing).__name__}"
                           f"{existing._labelnames}; asked for {kind.__name__}{tuple(labelnames)}")
    return existing  # type: ignore[return-value]


RESTART_COUNT_ENV = "EPD_RESTART_COUNT"
"""Set by the supervisor (``epd up``) on each process it starts: how often it restarted that one."""


def restart_count() -> int:
    """This process's EPD_RESTART_COUNT (0 when not supervised, or under Kubernetes, which keeps
    its own count: the pod's restartCount)."""
    try:
        return max(0, int(os.environ.get(RESTART_COUNT_ENV, "0")))
    except ValueError:
        return 0


# Every service imports this module (the router too), so every /metrics shows it.
gauge("epd_process_restarts", f"Times the supervisor (epd up) restarted this process: its {RESTART_COUNT_ENV}."
      ).set(restart_count())
