"""The SPEC VE LB: a machine at random, then its encoder with the fewest image patches in flight.

Choosing the machine at random spreads images over hosts without any global view; within a
machine the patch count is cheap to compare and is what the vision encoder's time follows.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.router.policies.base import InstanceView, Pick, Policy, RequestView, available


def machine_key(instance: InstanceView) -> tuple[str, str]:
    """An instance whose machine is unknown ("") is a machine of its own; the tag keeps such an
    instance apart from a real host that happens to share its name."""
    return ("host", instance.machine) if instance.machine else ("instance", instance.instance_id)


class EncoderBalance(Policy):
    """Uniformly random machine (seeded ``random.Random``, machines sorted so a seed is
    reproducible), then fewest ``num_patches_in_flight`` on it; ties go to the smallest id."""

    name = "encoder_balance"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, request: RequestView, instances: Sequence[InstanceView]) -> Pick | None:
        candidates = available(instances)
        if not candidates:
            return None
        machines: dict[tuple[str, str], list[InstanceView]] = {}
        for instance in candidates:
            machines.setdefault(machine_key(instance), []).append(instance)
        machine = self._rng.choice(sorted(machines))
        chosen = min(machines[machine], key=lambda i: (i.num_patches_in_flight, i.instance_id))
        patches = float(chosen.num_patches_in_flight)
        return Pick(chosen.instance_id, patches, {"patches": patches, "machines": float(len(machines))})
