"""Round robin over the available instances: the baseline that ignores load."""

from __future__ import annotations

from collections.abc import Sequence

from services.router.policies.base import InstanceView, Pick, Policy, RequestView, available


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, request: RequestView, instances: Sequence[InstanceView]) -> Pick | None:
        candidates = available(instances)
        if not candidates:
            return None
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return Pick(chosen.instance_id, 0.0, {"turn": float(self._next - 1)})
