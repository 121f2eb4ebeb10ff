"""The SPEC Prefill LB: prompt-length buckets whose share of the prefill fleet follows demand.

Prompts fall in buckets by length (reference: <16K, 16-64K, 64-256K, >=256K tokens). Each round
(``round_s``) the instances are re-divided among the buckets in proportion to the compute each
bucket demanded in the previous round and still has waiting (seconds from the cost model, so one
long prompt weighs what it costs, not 1), with a per-bucket cap. Short prompts then never queue behind a 256K one,
and no length class can starve the others.

    round k-1: demand_s + backlog_s per bucket ──allocate──> counts ──assign (stable)──> instance -> bucket
    round k:   requests wait at the router, one queue per bucket; an instance with room (queued
               compute <= room_s) takes the oldest request of its own bucket, or, when its
               bucket's queue is empty, the oldest one of any other (nothing idles while work waits)

Binding late keeps a request free to start wherever room appears first, instead of betting at
arrival on one instance's queue. Until a round with demand has finished there is nothing to
divide by: all available instances form one pool and every request takes the first room anywhere
(``borrowed`` = 1). A round without any demand keeps the last division that had some. Demand is
recorded at arrival (``on_arrival``: what was asked, not what a busy bucket managed to send).
What a round's division follows is its demand plus each bucket's **backlog** when it closed (the
compute of its requests still waiting at the router): the next round must serve about what the
last one brought and what is still owed. On demand alone a bucket that fell behind (a round that
gave it few instances) would get only its arrival share and, at saturation, never catch up.
``pick`` places one request at once (least queued compute in its bucket, work-conserving), for
callers that do not queue.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from fractions import Fraction

from services.common.cost_model import PrefillCost
from services.router.policies.base import InstanceView, Pick, QueueingPolicy, RequestView, available
from services.router.policies.least_requests import num_requests

DEFAULT_BOUNDS = (16_384, 65_536, 262_144)
DEFAULT_ROUND_S = 10.0
_MIN_WAKE_S = 1e-6
"""Float rounding must not make a waiting request re-ask at the same instant forever."""
REFERENCE_CONTEXT = 1_048_576
"""The reference model's context: DEFAULT_BOUNDS are 1/64, 1/16 and 1/4 of it."""


def bucket_of(num_tokens: int, bounds: Sequence[int]) -> int:
    """Bucket b holds ``bounds[b-1] <= num_tokens < bounds[b]``."""
    return bisect.bisect_right(bounds, num_tokens)


def scale_bounds(max_model_len: int, bounds: Sequence[int] = DEFAULT_BOUNDS) -> tuple[int, ...]:
    """``bounds`` at the same fractions of ``max_model_len`` as of the reference 1M context (2048
    -> (32, 128, 512)), rounded, then raised where needed to stay >= 1 and strictly ascending."""
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    scaled: list[int] = []
    for bound in bounds:
        value = max(1, round(max_model_len * bound / REFERENCE_CONTEXT))
        scaled.append(max(value, scaled[-1] + 1) if scaled else value)
    return tuple(scaled)


def allocate(demand_s: Sequence[float], num_instances: int, caps: Sequence[int]) -> list[int]:
    """Instances per bucket, summing to ``num_instances``; exact arithmetic (Fraction).

    1. Proportional to demand, largest remainder (ties: lower bucket).
    2. Clamped to ``caps`` (0: no cap); the excess is spare.
    3. Each bucket with demand and no instance gets one (most demand first): from the spare,
       else from the bucket with >= 2 instances and the least demand per instance.
    4. Spare goes one by one to the bucket under its cap with the most demand per instance
       (ties: fewer instances, lower bucket); with no demand at all that is an even spread.
       When every bucket is at its cap the spare goes by the same rule ignoring caps: idle
       instances help nobody, so caps bind only while they can hold the fleet.
    """
    if len(caps) != len(demand_s) or num_instances < 0:
        raise ValueError(f"allocate needs one cap per bucket and num_instances >= 0, got "
                         f"{len(demand_s)} buckets, {len(caps)} caps, {num_instances} instances")
    if any(not math.isfinite(d) or d < 0 for d in demand_s) or any(c < 0 for c in caps):
        raise ValueError(f"demand and caps must be finite and >= 0, got {list(demand_s)}, {list(caps)}")
    num_buckets = len(demand_s)
    demand = [Fraction(d) for d in demand_s]
    limit = [c or num_instances for c in caps]
    counts = [0] * num_buckets
    if sum(demand) > 0:
        quotas = [num_instances * d / sum(demand) for d in demand]
        counts = [math.floor(q) for q in quotas]
        by_remainder = sorted(range(num_buckets), key=lambda b: (counts[b] - quotas[b], b))
        for b in by_remainder[:num_instances - sum(counts)]:
            counts[b] += 1
    counts = [min(c, cap) for c, cap in zip(counts, limit)]
    spare = num_instances - sum(counts)
    for b in sorted((b for b in range(num_buckets) if demand[b] > 0 and counts[b] == 0),
                    key=lambda b: (-demand[b], b)):
        if spare > 0:
            spare -= 1
        else:
            donors = [j for j in range(num_buckets) if counts[j] >= 2]
            if not donors:
                break
            counts[min(donors, key=lambda j: (demand[j] / counts[j], j))] -= 1
        counts[b] += 1

    def neediness(b: int) -> tuple[bool, Fraction, int, int]:
        starved = counts[b] == 0 and demand[b] > 0
        return starved, demand[b] / counts[b] if counts[b] else demand[b], -counts[b], -b

    for _ in range(spare):
        open_buckets = [b for b in range(num_buckets) if counts[b] < limit[b]] or range(num_buckets)
        counts[max(open_buckets, key=neediness)] += 1
    return counts


def assign(prev: dict[str, int], counts: Sequence[int], instance_ids: Sequence[str]) -> dict[str, int]:
    """Instance -> bucket with ``counts[b]`` instances in bucket b, keeping as many instances as
    possible in their ``prev`` bucket (a move costs the instance's warm prefix cache). Ids are
    taken in sorted order: where a bucket shrinks, the smallest ids stay; newcomers fill the
    lowest buckets with room."""
    ordered = sorted(instance_ids)
    if len(set(ordered)) != len(ordered) or any(c < 0 for c in counts) or sum(counts) != len(ordered):
        raise ValueError(f"assign needs distinct ids and counts >= 0 summing to their number, "
                         f"got {list(counts)} for {len(ordered)} ids")
    free = list(counts)
    result: dict[str, int] = {}
    for instance_id in ordered:
        b = prev.get(instance_id, -1)
        if 0 <= b < len(free) and free[b] > 0:
            result[instance_id] = b
            free[b] -= 1
    for instance_id in (i for i in ordered if i not in result):
        b = next(b for b, n in enumerate(free) if n > 0)
        result[instance_id] = b
        free[b] -= 1
    return {i: result[i] for i in ordered}


def validated(bounds: Sequence[int], caps: Sequence[int], round_s: float,
              room_s: float) -> tuple[tuple[int, ...], tuple[int, ...], float, float]:
    """The settings as stored, or a ValueError naming the setting that is wrong."""
    bounds, caps = tuple(bounds), tuple(caps)
    if not bounds or any(not isinstance(b, int) or b < 1 for b in bounds) or \
            any(lo >= hi for lo, hi in zip(bounds, bounds[1:])):
        raise ValueError(f"prefill_buckets bounds must be strictly ascending token counts >= 1, got {bounds}")
    if len(caps) != len(bounds) + 1 or any(not isinstance(c, int) or c < 0 for c in caps):
        raise ValueError(f"prefill_buckets caps must be {len(bounds) + 1} integers >= 0 (one per bucket, "
                         f"0: no cap), got {caps}")
    if not (isinstance(round_s, (int, float)) and math.isfinite(round_s) and round_s > 0):
        raise ValueError(f"prefill_buckets round_s must be a number of seconds > 0, got {round_s!r}")
    if not (isinstance(room_s, (int, float)) and math.isfinite(room_s) and room_s >= 0):
        raise ValueError(f"prefill_buckets room_s must be a number of seconds >= 0, got {room_s!r}")
    return bounds, caps, float(round_s), float(room_s)


class PrefillBuckets(QueueingPolicy):
    """Per-bucket router queues dispatched to the least queued compute (then fewer requests,
    then id) among the instances with room, the buckets re-divided every ``round_s`` seconds of
    ``clock``. A change in the set of available instances, or :meth:`configure`, re-divides at
    the next pick or dispatch with the same demand.

    ``room_s``: an instance takes a request from the router's queues while its queued compute
    (running prompt's rest included) is at most this; a little above 0 covers the time a
    request takes to reach it, so it does not idle in between."""

    name = "prefill_buckets"

    def __init__(self, bounds: Sequence[int] = DEFAULT_BOUNDS, caps: Sequence[int] = (0, 0, 0, 0),
                 round_s: float = DEFAULT_ROUND_S, room_s: float = 0.1, cost: PrefillCost = PrefillCost(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._bounds, self._caps, self._round_s, self._room_s = validated(bounds, caps, round_s, room_s)
        self._cost = cost
        self._clock = clock
        self._unplaced: dict[str, RequestView] = {}
        """Arrived, not yet sent (by request id): the backlog, bucketed by the current bounds."""
        self._reset_history()

    def _reset_history(self) -> None:
        num_buckets = len(self._bounds) + 1
        self._round_start: float | None = None
        self._demand = [0.0] * num_buckets
        self._last_demand = (0.0,) * num_buckets
        self._last_backlog = (0.0,) * num_buckets
        self._basis: tuple[float, ...] | None = None
        """The last finished round's demand plus backlog, when not all zero: what the division
        follows."""
        self._assignment: dict[str, int] = {}
        self._assigned_ids: frozenset[str] | None = None
        """The available ids the assignment was made for; None: re-divide at the next pick."""

    # ----- admin API ---------------------------------------------------------------------------
    @property
    def bounds(self) -> tuple[int, ...]:
        return self._bounds

    @property
    def caps(self) -> tuple[int, ...]:
        return self._caps

    @property
    def round_s(self) -> float:
        return self._round_s

    @property
    def room_s(self) -> float:
        return self._room_s

    @property
    def allocation(self) -> dict[int, tuple[str, ...]]:
        """Bucket -> its instance ids (all empty while the fleet is one pool)."""
        return {b: tuple(i for i, ib in self._assignment.items() if ib == b) for b in range(len(self._caps))}

    @property
    def last_demand_s(self) -> tuple[float, ...]:
        return self._last_demand

    @property
    def last_backlog_s(self) -> tuple[float, ...]:
        """Compute still waiting at the router per bucket when the last round closed."""
        return self._last_backlog

    def configure(self, bounds: Sequence[int] | None = None, caps: Sequence[int] | None = None,
                  round_s: float | None = None, room_s: float | None = None) -> None:
        """Change settings (all validated before any applies); a new number of buckets drops
        the demand history, since it was counted in the old buckets. Requests already waiting
        stay in the queue they joined (the caller re-queues them when the buckets change)."""
        new = validated(self._bounds if bounds is None else bounds, self._caps if caps is None else caps,
                        self._round_s if round_s is None else round_s,
                        self._room_s if room_s is None else room_s)
        is_reshaped = len(new[0]) != len(self._bounds)
        self._bounds, self._caps, self._round_s, self._room_s = new
        if is_reshaped:
            self._reset_history()
        self._assigned_ids = None

    # ----- routing -----------------------------------------------------------------------------
    def queue_of(self, request: RequestView) -> int:
        return bucket_of(request.num_prompt_tokens, self._bounds)

    def on_arrival(self, request: RequestView) -> None:
        self._roll(self._clock())
        self._demand[self.queue_of(request)] += self._compute_s(request)
        self._unplaced[request.request_id] = request

    def on_pick(self, request: RequestView, pick: Pick) -> None:
        self._unplaced.pop(request.request_id, None)

    def on_leave(self, request: RequestView) -> None:
        self._unplaced.pop(request.request_id, None)

    def _compute_s(self, request: RequestView) -> float:
        return self._cost.prompt_seconds(request.num_prompt_tokens, request.num_cached_tokens)

    def dispatch(self, heads: Sequence[tuple[int, RequestView]],
                 instances: Sequence[InstanceView]) -> tuple[int, Pick] | None:
        """The oldest head whose bucket has an instance with room goes to the least loaded of
        them; a head whose bucket has none borrows the least loaded instance with room of a
        bucket that has nobody waiting."""
        candidates = self._divided(instances)
        roomy = [i for i in candidates if i.queued_compute_s <= self._room_s]
        waiting = {bucket for bucket, _ in heads}
        for bucket, request in heads:
            members = [i for i in roomy if self._assignment.get(i.instance_id) == bucket] or \
                [i for i in roomy if self._assignment.get(i.instance_id) not in waiting]
            if members:
                return bucket, self._pick_of(min(members, key=_load), bucket)
        return None

    def wake_after_s(self, instances: Sequence[InstanceView]) -> float | None:
        """When the first available instance's queued compute drains to ``room_s``."""
        drains = [i.queued_compute_s - self._room_s for i in available(instances)]
        return max(min(drains), _MIN_WAKE_S) if drains else None

    def pick(self, request: RequestView, instances: Sequence[InstanceView]) -> Pick | None:
        candidates = self._divided(instances)
        if not candidates:
            return None
        bucket = self.queue_of(request)
        members = [i for i in candidates if self._assignment.get(i.instance_id) == bucket]
        chosen = min(members or candidates, key=_load)
        if members:
            # Work-conserving: another bucket's instance takes the request when it would start
            # it sooner by more than the request's own compute (so a bucket is not raided for
            # a small gain, and nothing waits behind an idle instance).
            own_s = self._compute_s(request)
            outside = min(candidates, key=_load)
            if outside.queued_compute_s + own_s < chosen.queued_compute_s or (_is_idle(outside) and not _is_idle(chosen)):
                chosen = outside
        return self._pick_of(chosen, bucket)

    def _pick_of(self, chosen: InstanceView, bucket: int) -> Pick:
        return Pick(chosen.instance_id, chosen.queued_compute_s, {
            "bucket": float(bucket), "queued_compute_s": chosen.queued_compute_s,
            "requests": float(num_requests(chosen)),
            "borrowed": float(self._assignment.get(chosen.instance_id) != bucket)})

    def _divided(self, instances: Sequence[InstanceView]) -> list[InstanceView]:
        """The available instances, the buckets divided among them for the current round."""
        candidates = available(instances)
        self._roll(self._clock())
        ids = frozenset(i.instance_id for i in candidates)
        if ids != self._assigned_ids:
            self._divide(ids)
        return candidates

    def _roll(self, now: float) -> None:
        """Close the round once ``round_s`` has passed (the first round starts at the first call)."""
        if self._round_start is None:
            self._round_start = now
        if now - self._round_start < self._round_s:
            return
        self._last_demand = tuple(self._demand)
        backlog = [0.0] * len(self._demand)
        for request in self._unplaced.values():
            backlog[self.queue_of(request)] += self._compute_s(request)
        self._last_backlog = tuple(backlog)
        self._demand = [0.0] * len(self._demand)
        if sum(self._last_demand) + sum(backlog) > 0:
            self._basis = tuple(d + b for d, b in zip(self._last_demand, backlog))
        self._round_start = now
        self._assigned_ids = None

    def _divide(self, ids: frozenset[str]) -> None:
        if self._basis is None:
            self._assignment = {}
        else:
            counts = allocate(self._basis, len(ids), self._caps)
            self._assignment = assign(self._assignment, counts, sorted(ids))
        self._assigned_ids = ids


def _load(instance: InstanceView) -> tuple[float, int, str]:
    return instance.queued_compute_s, num_requests(instance), instance.instance_id


def _is_idle(instance: InstanceView) -> bool:
    return instance.queued_compute_s == 0 and num_requests(instance) == 0
