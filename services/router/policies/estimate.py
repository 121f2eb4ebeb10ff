"""What the router believes about one instance: its last load report, what it sent since, and
its health. Pure state (times are arguments, no I/O): the live pool and the simulator feed it the
same reports and sends, so a policy sees the same picture in both.

Between two reports the router counts the requests it sent (``num_sent``) and their estimated
prefill compute (``sent_s``: the reference cost model scaled by ``cost_scale``, what the
instance's own fitted model says of its queue over what the reference says, since a CPU engine
is far slower than the reference card), so a burst does not all land on the instance that
looked idlest at the last report. The reported queued compute drains at one second per second,
or by what this router's requests there finished since (``done_s``), whichever says more::

    queued_compute_s = max(0, reported - max(now - report_at, done_s)) + sent_s

An instance is **unhealthy** while ``is_broken`` (its report stream failed, or an RPC found it
unavailable, since its last report), when no report came for ``health_timeout_s``, or while
**ejected** (``ejected_until``: outlier ejection after consecutive failures); one never heard
from counts as healthy (a router starting with its instances works at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.cost_model import PrefillCost
from services.router.policies.base import InstanceView

if TYPE_CHECKING:   # annotations only: importing the core loads no protobuf, gRPC or asyncio
    from services.common.wire import LoadReport

REPORT_INTERVAL_S = 0.5
"""How often an instance streams its load (``WatchLoad``); the simulator scales it with time."""


@dataclass
class LoadEstimate:
    address: str
    """Where it is (host:port live; the simulated instance's id in the simulator)."""
    instance_id: str = ""
    """From its load reports; its address until the first one."""
    load: LoadReport | None = None
    report_at: float = float("-inf")
    is_broken: bool = False
    """Its report stream failed, or an RPC found it unavailable, since its last report."""
    is_drained: bool = False
    """Drained through the admin API: no new requests."""
    is_ready: bool = True
    """What its orchestrator says (Kubernetes readiness in the endpoint slice): not ready, no
    new requests. Kept apart from ``is_drained`` so that an undrain does not override it."""
    is_leaving: bool = False
    """It left the membership: no new requests; it is removed once its requests are done."""
    needs_report: bool = False
    """It joined while the router ran: no requests before its first load report (a router
    starting with its instances sends to them at once instead)."""
    num_sent: int = 0
    """Requests sent since its last report."""
    sent_s: float = 0.0
    """Their estimated prefill compute (those still running)."""
    done_s: float = 0.0
    """Estimated compute of this router's requests that it counted and that finished since."""
    num_reports: int = 0
    """Load reports received (a placement remembers the count it was sent at)."""
    cost_scale: float = 1.0
    """Its own estimate of its queued prefill over the reference cost model's, last time it
    reported both (what the router multiplies its own estimates by)."""
    num_failures: int = 0
    """Requests that failed on it in a row (a success resets it)."""
    ejected_until: float = float("-inf")
    """Outlier ejection: no new requests before this time (the pool's clock)."""

    def __post_init__(self) -> None:
        self.instance_id = self.instance_id or self.address

    def is_healthy(self, now: float, health_timeout_s: float) -> bool:
        if self.is_broken or now < self.ejected_until:
            return False
        if self.load is None:
            return not self.needs_report
        return self.is_reporting(now, health_timeout_s)

    def is_held(self) -> bool:
        """No new requests whatever its load: drained, not ready, or leaving."""
        return self.is_drained or not self.is_ready or self.is_leaving

    def is_reporting(self, now: float, health_timeout_s: float) -> bool:
        """Its latest report is fresh (False before the first one)."""
        return self.load is not None and not self.is_broken and now - self.report_at <= health_timeout_s

    def queued_compute_s(self, load: LoadReport, now: float, cost: PrefillCost) -> float:
        """The instance's own estimate when it has one (its fitted model), else the reference's,
        drained since the report, plus what was sent since."""
        reported = load.queued_prefill_compute_s or cost.seconds(load.num_queued_prefill_tokens)
        drained = max(now - self.report_at, self.done_s) if self.load is not None else self.done_s
        return max(0.0, reported - drained) + self.sent_s

    def on_report(self, report: LoadReport, now: float, cost: PrefillCost) -> None:
        if report.queued_prefill_compute_s > 0 and report.num_queued_prefill_tokens > 0:
            self.cost_scale = report.queued_prefill_compute_s / cost.seconds(report.num_queued_prefill_tokens)
        self.load, self.report_at = report, now
        self.instance_id = report.instance_id or self.address
        self.is_broken, self.num_sent, self.sent_s, self.done_s = False, 0, 0.0, 0.0
        self.num_reports += 1

    def on_sent(self, compute_s: float) -> int:
        """A request with ``compute_s`` of estimated prefill went there; returns the report
        count to hand back to :meth:`on_done`."""
        self.num_sent += 1
        self.sent_s += compute_s
        return self.num_reports

    def on_done(self, compute_s: float, sent_at_report: int) -> None:
        """A request it was sent (at report count ``sent_at_report``) finished or failed: if no
        report has counted it yet, uncount it; else what it reported drains by it."""
        if sent_at_report == self.num_reports:
            self.num_sent = max(0, self.num_sent - 1)
            self.sent_s = max(0.0, self.sent_s - compute_s)
        else:
            self.done_s += compute_s

    def view(self, role: str, now: float, health_timeout_s: float, cost: PrefillCost,
             block_size: int = 16) -> InstanceView:
        load = self.load
        if load is None:
            return InstanceView(
                instance_id=self.instance_id, role=role, machine=self.address.rsplit(":", 1)[0],
                num_waiting=self.num_sent, queued_compute_s=max(0.0, -self.done_s) + self.sent_s,
                is_healthy=self.is_healthy(now, health_timeout_s), is_draining=self.is_held())
        return InstanceView(
            instance_id=self.instance_id, role=role, machine=self.address.rsplit(":", 1)[0],
            num_running=load.num_running, num_waiting=load.num_waiting + self.num_sent,
            num_queued_prefill_tokens=load.num_queued_prefill_tokens,
            queued_compute_s=self.queued_compute_s(load, now, cost),
            num_kv_tokens=load.num_kv_tokens_in_use,
            kv_capacity_tokens=load.num_total_blocks * block_size, num_patches_in_flight=load.num_patches_in_flight,
            is_healthy=self.is_healthy(now, health_timeout_s),
            is_draining=self.is_held() or load.is_draining)
