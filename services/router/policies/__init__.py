"""Routing policies by name (STYLE rule 5: a lazy ``name -> "module:Class"`` registry).

    policy = make_policy("round_robin")
    pick = policy.pick(request_view, instance_views)

Prefill, decode and encoder each get a policy; the SPEC balancers are the defaults, the
baselines are there to compare against (the simulator runs any of them).
"""

from __future__ import annotations

import importlib
from typing import Any

from services.router.policies.base import InstanceView, Pick, Policy, QueueingPolicy, RequestView

POLICIES: dict[str, str] = {
    "round_robin": "services.router.policies.round_robin:RoundRobin",
    "least_requests": "services.router.policies.least_requests:LeastRequests",
    "power_of_two": "services.router.policies.power_of_two:PowerOfTwo",
    "cache_aware": "services.router.policies.cache_aware:CacheAware",
    "prefill_buckets": "services.router.policies.prefill_buckets:PrefillBuckets",
    "decode_balance": "services.router.policies.decode_balance:DecodeBalance",
    "encoder_balance": "services.router.policies.encoder_balance:EncoderBalance",
}


def make_policy(name: str, **settings: Any) -> Policy:
    target = POLICIES.get(name)
    if target is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**settings)


__all__ = ["POLICIES", "InstanceView", "Pick", "Policy", "QueueingPolicy", "RequestView", "make_policy"]
