"""Power of two choices: sample two instances, keep the less loaded one.

Almost as well balanced as least requests, but a burst of picks made from the same (stale)
snapshot spreads over many instances instead of all landing on the one that looked idlest.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.router.policies.base import InstanceView, Pick, Policy, RequestView, available
from services.router.policies.least_requests import num_requests


class PowerOfTwo(Policy):
    """Two distinct available instances drawn with a seeded ``random.Random`` (candidates are
    sorted by id first, so a seed gives the same picks whatever the snapshot order); the one
    with fewer requests wins, ties go to the first drawn. One instance: that one."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, request: RequestView, instances: Sequence[InstanceView]) -> Pick | None:
        candidates = sorted(available(instances), key=lambda i: i.instance_id)
        if not candidates:
            return None
        if len(candidates) == 1:
            only = candidates[0]
            load = float(num_requests(only))
            return Pick(only.instance_id, load, {"requests": load, "first_requests": load})
        first, second = self._rng.sample(candidates, 2)
        first_load, second_load = num_requests(first), num_requests(second)
        chosen = second if second_load < first_load else first
        load = float(min(first_load, second_load))
        return Pick(chosen.instance_id, load, {
            "requests": load, "first_requests": float(first_load), "second_requests": float(second_load)})
