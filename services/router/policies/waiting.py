"""Requests waiting at the router for a queueing policy (late binding), live and simulated alike.

    waiting.add(queue_of(policy, request), request, item)     # item: whatever the caller needs back
    for request, pick, item in dispatched(policy, waiting, views):  # views(): fresh snapshots
        ...send request to pick.instance_id (so the next views() shows it)...

One FIFO per queue; ``heads`` gives each non-empty queue's oldest request, oldest first across
queues, which is what ``QueueingPolicy.dispatch`` chooses among. Under any other policy there is
one queue, and its head goes wherever ``pick`` says (requests left waiting by a queueing policy
the router switched away from). Pure bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from services.router.policies.base import InstanceView, Pick, Policy, QueueingPolicy, RequestView

T = TypeVar("T")


class Waiting(Generic[T]):
    def __init__(self) -> None:
        self._queues: dict[int, deque[tuple[int, RequestView, T]]] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def add(self, queue: int, request: RequestView, item: T) -> None:
        self._queues.setdefault(queue, deque()).append((next(self._order), request, item))

    def heads(self) -> list[tuple[int, RequestView]]:
        """(queue, its oldest request) for each non-empty queue, oldest first."""
        firsts = sorted((q[0][0], key, q[0][1]) for key, q in self._queues.items() if q)
        return [(key, request) for _, key, request in firsts]

    def pop(self, queue: int) -> tuple[RequestView, T]:
        _, request, item = self._queues[queue].popleft()
        return request, item

    def remove(self, item: T) -> bool:
        """Takes ``item`` out of whichever queue holds it (its request left); False if none does."""
        for q in self._queues.values():
            for entry in q:
                if entry[2] is item:
                    q.remove(entry)
                    return True
        return False

    def drain(self) -> list[T]:
        """Everything still waiting, oldest first, leaving the queues empty."""
        return [item for _, item in self.drain_requests()]

    def drain_requests(self) -> list[tuple[RequestView, T]]:
        """The same with each item's request."""
        entries = sorted((e for q in self._queues.values() for e in q), key=lambda e: e[0])
        self._queues.clear()
        return [(request, item) for _, request, item in entries]

    def sizes(self) -> dict[int, int]:
        """Requests per non-empty queue (safe to read from another thread: /metrics)."""
        return {key: len(q) for key, q in sorted(dict(self._queues).items()) if q}


def queue_of(policy: Policy, request: RequestView) -> int:
    """The queue ``request`` waits in under ``policy`` (0 unless it queues)."""
    return policy.queue_of(request) if isinstance(policy, QueueingPolicy) else 0


def choose(policy: Policy, heads: Sequence[tuple[int, RequestView]],
           instances: Sequence[InstanceView]) -> tuple[int, Pick] | None:
    """``policy.dispatch`` for a queueing policy; for any other, the oldest head where ``pick``
    says."""
    if isinstance(policy, QueueingPolicy):
        return policy.dispatch(heads, instances)
    if not heads:
        return None
    queue, request = heads[0]
    pick = policy.pick(request, instances)
    return None if pick is None else (queue, pick)


def dispatched(policy: Policy, waiting: Waiting[T],
               views: Callable[[], Sequence[InstanceView]]) -> Iterator[tuple[RequestView, Pick, T]]:
    """Starts waiting requests for as long as the policy finds room; the caller sends each one
    before asking for the next (``views`` must then show it)."""
    while len(waiting):
        chosen = choose(policy, waiting.heads(), views())
        if chosen is None:
            return
        queue, pick = chosen
        request, item = waiting.pop(queue)
        policy.on_pick(request, pick)
        yield request, pick, item
