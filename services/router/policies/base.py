"""What every routing policy sees and returns (STYLE rule 6): snapshots in, a pick out.

A policy is a small class with ``pick(request, instances) -> Pick | None`` over immutable
snapshots; it never does I/O. The live router builds the snapshots from load reports, the
simulator from its simulated instances, and both call the same policy objects (rule 7). A
policy may keep its own state (a round-robin cursor, what it sent where) and learns what
happened through ``on_pick`` only. A :class:`QueueingPolicy` binds late instead: requests wait
at the router until its ``dispatch`` starts them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class InstanceView:
    """One instance as a policy sees it (from its latest load report)."""

    instance_id: str
    role: str
    """"prefill", "decode" or "encoder"."""
    machine: str = ""
    """Host the instance runs on (VE LB picks a machine first)."""
    num_running: int = 0
    num_waiting: int = 0
    num_queued_prefill_tokens: int = 0
    queued_compute_s: float = 0.0
    """Estimated seconds of prefill work queued (cost model over its queue)."""
    num_kv_tokens: int = 0
    """KV tokens held by its running requests."""
    kv_capacity_tokens: int = 0
    num_patches_in_flight: int = 0
    is_healthy: bool = True
    is_draining: bool = False

    @property
    def is_available(self) -> bool:
        return self.is_healthy and not self.is_draining


@dataclass(frozen=True)
class RequestView:
    """What a policy knows of a request before it is placed."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int = 0
    block_hashes: tuple[bytes, ...] = ()
    """Chained hashes of the prompt's full blocks (cache-aware policies)."""
    num_cached_tokens: int = 0
    """Prompt tokens the KV store will serve (known to prefill routing when looked up)."""
    num_patches: int = 0


@dataclass(frozen=True)
class Pick:
    instance_id: str
    score: float = 0.0
    breakdown: Mapping[str, float] = field(default_factory=dict)
    """The score's terms, for logs, the admin API and tests."""


class Policy(ABC):
    name: str = ""
    needs_block_hashes: bool = False
    """Whether pick reads ``request.block_hashes`` (the router hashes prompts only then)."""

    @abstractmethod
    def pick(self, request: RequestView, instances: Sequence[InstanceView]) -> Pick | None:
        """The instance for ``request`` among the available ``instances``; None: none fits now."""

    def on_arrival(self, request: RequestView) -> None:
        """``request`` came in (once, before it is placed or queued; a retry is not an arrival)."""

    def on_pick(self, request: RequestView, pick: Pick) -> None:
        """The request was sent where ``pick`` says (stateful policies update here)."""

    def on_leave(self, request: RequestView) -> None:
        """``request`` arrived but leaves unplaced (its client went away while it waited, or it
        failed: no instance was available)."""


class QueueingPolicy(Policy):
    """A policy that binds late: requests wait at the router, one FIFO per ``queue_of``, until
    ``dispatch`` starts one where there is room (``policies/placer.py`` runs the queues, live
    and simulated alike). ``pick`` still places a request at once for callers that do not queue."""

    @abstractmethod
    def queue_of(self, request: RequestView) -> int:
        """The router-side queue ``request`` waits in."""

    @abstractmethod
    def dispatch(self, heads: Sequence[tuple[int, RequestView]],
                 instances: Sequence[InstanceView]) -> tuple[int, Pick] | None:
        """Which queue's head starts now, and where: ``heads`` holds (queue, request) for each
        non-empty queue, oldest first. None: every head waits."""

    @abstractmethod
    def wake_after_s(self, instances: Sequence[InstanceView]) -> float | None:
        """With requests waiting and ``dispatch`` saying wait: in how many seconds it may say
        otherwise with no new report (queued compute drains as instances work); None: only a
        change in load can."""


def available(instances: Sequence[InstanceView]) -> list[InstanceView]:
    # is_available spelled out: this runs over every instance at every pick and dispatch.
    return [i for i in instances if i.is_healthy and not i.is_draining]
