"""Least requests: the instance with the fewest running plus waiting requests.

The simplest load-aware baseline; it ignores how long the requests are, which is exactly what
the SPEC balancers add on top of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.router.policies.base import InstanceView, Pick, Policy, RequestView, available


def num_requests(instance: InstanceView) -> int:
    return instance.num_running + instance.num_waiting


class LeastRequests(Policy):
    """Fewest ``num_running + num_waiting``; ties go to the smallest instance id, so the same
    snapshots always give the same pick."""

    name = "least_requests"

    def pick(self, request: RequestView, instances: Sequence[InstanceView]) -> Pick | None:
        candidates = available(instances)
        if not candidates:
            return None
        chosen = min(candidates, key=lambda i: (num_requests(i), i.instance_id))
        load = num_requests(chosen)
        return Pick(chosen.instance_id, float(load), {"requests": float(load)})
