"""Simulated prefill and decode instances: their queues, their clocks, their load reports.

A **prefill instance** computes one prompt at a time, first come first served; a prompt's time
is its step-by-step cost after the prefix the KV store served when its prefill began
(``Costs.prefill_seconds``). Its load report counts the queued compute the way the engine
reports it (``LoadReport.queued_prefill_compute_s``, its own model): the running prompt's
remaining seconds plus the estimated seconds of the queued ones; the running prompt's tokens
count as uncomputed in proportion to its remaining time.

A **decode instance** runs continuous batching: each step emits one token for every running
request and costs ``DecodeCost.seconds(batch, kv)``; a request that arrives joins at the next
step boundary (or waits while ``max_batch`` are running, or, with a KV capacity, while its
prompt's KV does not fit beside the running ones': a request's KV then grows into the room
others leave, as an engine's preemption would make room, which is not simulated). No event per token: between two
changes of the batch (a join, a finish) the batch is fixed and its KV grows by ``batch`` tokens
a step, so k steps from a boundary take, in closed form::

    T(k) = k * s0 + c * batch * k * (k - 1) / 2,     s0 = a + b * batch + c * kv

and the instance jumps from boundary to boundary (``advance``).

Both keep their **lifetime** for the autoscaled cluster (``scaling.py``): when they were started
(they serve only after a start-up), and when they were removed (after draining).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from services.common.cost_model import DecodeCost
from services.common.wire import LoadReport
from services.router.sim.trace import TraceRequest


@dataclass
class Queued:
    request: TraceRequest
    num_cached: int
    """Hit tokens known when it was routed."""
    estimate_s: float
    """Its compute time at that hit."""


@dataclass
class Lifetime:
    started_at: float = 0.0
    """When it was started (it costs from then on, start-up included)."""
    removed_at: float | None = None
    """When it left the pool (drained); None: still there."""
    is_retiring: bool = False
    """Told to leave: it takes no new work and is removed once idle."""


class SimPrefill:
    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.life = Lifetime()
        self.queue: deque[Queued] = deque()
        self.queued_s = 0.0
        self.num_queued_tokens = 0
        self.running: Queued | None = None
        self.running_since = 0.0
        self.running_until = 0.0
        self.num_running_tokens = 0
        self.busy_s = 0.0

    def report(self, now: float) -> LoadReport:
        """What the engine would stream to the router now (``WatchLoad``)."""
        remaining_s, num_tokens = 0.0, self.num_queued_tokens
        if self.running is not None:
            remaining_s = max(0.0, self.running_until - now)
            span_s = self.running_until - self.running_since
            num_tokens += round(self.num_running_tokens * remaining_s / span_s) if span_s > 0 else 0
        return LoadReport(self.instance_id, "prefill", num_running=int(self.running is not None),
                          num_waiting=len(self.queue), num_queued_prefill_tokens=num_tokens,
                          queued_prefill_compute_s=remaining_s + self.queued_s)

    def enqueue(self, item: Queued) -> None:
        self.queue.append(item)
        self.queued_s += item.estimate_s
        self.num_queued_tokens += item.request.input_length - item.num_cached

    def next_up(self) -> Queued | None:
        """The next prompt to compute, if idle and one is queued (the caller starts it)."""
        if self.running is not None or not self.queue:
            return None
        item = self.queue.popleft()
        self.queued_s = max(0.0, self.queued_s - item.estimate_s)
        self.num_queued_tokens -= item.request.input_length - item.num_cached
        return item

    def start(self, item: Queued, now: float, seconds: float, num_tokens: int) -> None:
        """Computes ``item``'s ``num_tokens`` uncached tokens in ``seconds`` from ``now``."""
        self.running, self.running_since, self.running_until = item, now, now + seconds
        self.num_running_tokens = num_tokens
        self.busy_s += seconds

    def finish(self) -> Queued:
        item, self.running = self.running, None
        assert item is not None, "finish() on an idle prefill instance"
        return item

    @property
    def num_requests(self) -> int:
        return len(self.queue) + (self.running is not None)

    @property
    def is_idle(self) -> bool:
        return self.running is None and not self.queue


@dataclass
class Decoding:
    request: TraceRequest
    steps_left: int
    kv: int


class SimDecode:
    def __init__(self, instance_id: str, cost: DecodeCost, max_batch: int, kv_capacity_tokens: int = 0) -> None:
        self.instance_id = instance_id
        self.life = Lifetime()
        self.cost = cost
        self.max_batch = max_batch
        self.kv_capacity_tokens = kv_capacity_tokens
        """KV tokens it holds (0: no limit, and reported as unknown)."""
        self.running: list[Decoding] = []
        self.waiting: deque[Decoding] = deque()
        self.kv = 0
        """KV tokens of the running batch at ``synced_at``."""
        self.waiting_kv = 0
        self.synced_at = 0.0
        """A step boundary (possibly just ahead of now: the step in progress ends there)."""
        self.busy_s = 0.0
        self.version = 0
        """Bumped whenever the next finish moves (stale finish events are dropped)."""
        self._s0 = 0.0
        self._half_growth = 0.0

    # ----- closed-form stepping -------------------------------------------------------------
    def _rebatch(self) -> None:
        """The batch or its KV changed: recompute the step terms of T(k)."""
        batch = len(self.running)
        self._s0 = self.cost.seconds(batch, self.kv)
        self._half_growth = self.cost.c * batch / 2

    def steps_seconds(self, k: int) -> float:
        """T(k): seconds of the next k steps of the current batch from ``synced_at``."""
        return k * self._s0 + self._half_growth * k * (k - 1)

    def steps_reaching(self, dt: float) -> int:
        """The fewest steps whose end is at or after ``dt`` seconds past ``synced_at``."""
        if dt <= 0 or not self.running:
            return 0
        s0, q = self._s0, self._half_growth
        # T(k) = q k^2 + (s0 - q) k: the positive root of T(k) = dt, then exact checks.
        k = math.ceil(dt / s0) if q <= 0 else math.ceil((-(s0 - q) + math.sqrt((s0 - q) ** 2 + 4 * q * dt)) / (2 * q))
        k = max(k, 1)
        while k > 1 and self.steps_seconds(k - 1) >= dt:
            k -= 1
        while self.steps_seconds(k) < dt:
            k += 1
        return k

    def steps_done_by(self, dt: float) -> int:
        """The most steps that end within ``dt`` seconds past ``synced_at``."""
        k = self.steps_reaching(dt)
        return k - 1 if self.steps_seconds(k) > dt else k

    def advance(self, k: int) -> list[Decoding]:
        """Run k steps of the current batch; returns those that finished at the new boundary."""
        if k <= 0:
            return []
        seconds = self.steps_seconds(k)
        self.synced_at += seconds
        self.busy_s += seconds
        self.kv += k * len(self.running)
        for item in self.running:
            item.steps_left -= k
            item.kv += k
        done = [item for item in self.running if item.steps_left <= 0]
        if done:
            self.running = [item for item in self.running if item.steps_left > 0]
            self.kv -= sum(item.kv for item in done)
        self._rebatch()
        return done

    # ----- events ---------------------------------------------------------------------------
    def next_finish_at(self) -> float | None:
        """When the next running request finishes, the batch unchanged until then."""
        if not self.running:
            return None
        return self.synced_at + self.steps_seconds(min(item.steps_left for item in self.running))

    def join(self, request: TraceRequest, now: float) -> list[Decoding]:
        """``request`` (prefilled, first token out) arrives at ``now``: it joins at the end of
        the step in progress, or waits for room. Returns the requests that finish at that step's
        end (at ``synced_at``), if it is the one the next finish event was due at."""
        done = []
        if not self.running:
            self.synced_at = max(self.synced_at, now)
        else:
            # Never past the next finish (its event is still due: only rounding could say so).
            steps = min(self.steps_reaching(now - self.synced_at), min(i.steps_left for i in self.running))
            done = self.advance(steps)
        self.waiting.append(Decoding(request, request.output_length - 1, request.input_length + 1))
        self.waiting_kv += request.input_length + 1
        self.admit()
        self.version += 1
        return done

    def on_finish_event(self) -> list[Decoding]:
        """Run to the next finish (the event for it is due now); admit waiting ones."""
        steps = min(item.steps_left for item in self.running)
        done = self.advance(steps)
        self.admit()
        self.version += 1
        return done

    @property
    def num_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def is_idle(self) -> bool:
        return not self.running and not self.waiting

    def _fits(self, item: Decoding) -> bool:
        return not self.kv_capacity_tokens or not self.running or self.kv + item.kv <= self.kv_capacity_tokens

    def admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch and self._fits(self.waiting[0]):
            item = self.waiting.popleft()
            self.waiting_kv -= item.kv
            self.running.append(item)
            self.kv += item.kv
        self._rebatch()

    def report(self, now: float, block_size: int = 16) -> LoadReport:
        """What the engine would stream to the router now (``WatchLoad``)."""
        kv = self.kv
        if self.running and now > self.synced_at:
            # Steps done since the last boundary (applied at the next event; this is a snapshot).
            kv += self.steps_done_by(now - self.synced_at) * len(self.running)
        return LoadReport(self.instance_id, "decode", num_running=len(self.running), num_waiting=len(self.waiting),
                          num_kv_tokens_in_use=kv + self.waiting_kv,
                          num_total_blocks=self.kv_capacity_tokens // block_size)
