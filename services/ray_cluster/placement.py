"""Where each role's actors go: pure functions of the Ray cluster's resources (no Ray here).

A node advertises custom resources to take roles: ``epd_prefill``, ``epd_decode``, ``epd_encoder``,
``epd_kvstore``, ``epd_router`` (``ray start --resources '{"epd_decode": 4}'``: at most four decode
actors there). Where no node in the cluster has a role's resource, that role goes anywhere. Engines
(encoder, prefill, decode) take ``--ray-gpus-per-engine`` GPUs each (1; 0.5 puts two on one GPU)
where the cluster has GPUs and the device is not cpu; Ray then sets their CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

ENGINE_ROLES = ("encoder", "prefill", "decode")
ROLE_CPUS = {"encoder": 1.0, "prefill": 1.0, "decode": 1.0, "kvstore": 0.5, "router": 0.5}
"""Logical CPUs each actor reserves (Ray counts them; the process uses what it uses)."""


def role_resource(role: str) -> str:
    return f"epd_{role}"


def actor_resources(role: str, cluster_resources: Mapping[str, float], device: str,
                    gpus_per_engine: float = 1.0) -> dict[str, Any]:
    """``num_cpus``, ``num_gpus`` and ``resources`` for one actor of ``role``."""
    options: dict[str, Any] = {"num_cpus": ROLE_CPUS[role], "num_gpus": 0}
    if role in ENGINE_ROLES and device != "cpu" and cluster_resources.get("GPU", 0) > 0:
        options["num_gpus"] = gpus_per_engine
    if cluster_resources.get(role_resource(role), 0) > 0:
        options["resources"] = {role_resource(role): 1}
    return options


def kvstore_bundles(num_nodes: int, cluster_resources: Mapping[str, float]) -> list[dict[str, float]]:
    """One placement-group bundle per store node, to be spread across Ray nodes (SPREAD: on
    distinct nodes where there are enough, packed where there are not)."""
    bundle = {"CPU": ROLE_CPUS["kvstore"]}
    if cluster_resources.get(role_resource("kvstore"), 0) > 0:
        bundle[role_resource("kvstore")] = 1
    return [dict(bundle) for _ in range(num_nodes)]


def local_num_cpus(num_per_role: Mapping[str, int], num_machine_cpus: int) -> int:
    """Logical CPUs of a Ray that ``epd up --ray`` starts for itself: the machine's, or what epd's
    actors reserve if that is more (Ray's CPUs are a count to schedule by, not a limit), so that a
    small machine runs every actor instead of leaving some pending forever."""
    return max(num_machine_cpus, math.ceil(sum(ROLE_CPUS[role] * n for role, n in num_per_role.items())))
