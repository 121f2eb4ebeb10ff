"""The SPEC Decode LB: balance request count and KV length at once, and pair them up.

A decode card is limited by two things: how many sequences it steps (concurrency) and how much
KV each step reads. Cards holding a few long requests have KV filled but concurrency to spare;
cards holding many short ones have the opposite. So a short request goes where concurrency is
low (even if KV is high), a long request where KV is low (even if concurrency is high), and the
two kinds fill each other's gaps.

For request length ``n = num_prompt_tokens + max_tokens`` and threshold ``T``, over the available
instances ``i`` (``r_i`` = running + waiting requests, ``k_i`` = KV tokens, ``p`` = the request's
prompt tokens), each axis counted as if the request were placed there and normalized by its
maximum over the instances::

    lam     = T / (T + n)                        # > 1/2 for a short request (n < T)
    score_i = lam       * w_r * (r_i + 1) / max_j (r_j + 1)
            + (1 - lam) * w_k * (k_i + p) / max_j (k_j + p)

Lowest score wins, ties go to the smallest id. ``lam`` slides smoothly from "mind concurrency"
to "mind KV", so requests near the threshold weigh both axes about equally and there is no cliff.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from services.router.policies.base import InstanceView, Pick, Policy, RequestView, available
from services.router.policies.least_requests import num_requests

logger = logging.getLogger(__name__)


class DecodeBalance(Policy):
    name = "decode_balance"

    def __init__(self, weight_requests: float = 1.0, weight_kv: float = 1.0,
                 long_threshold_tokens: int = 8192) -> None:
        if weight_requests < 0 or weight_kv < 0 or weight_requests + weight_kv <= 0:
            raise ValueError("decode_balance weights must be >= 0 and not both 0")
        if long_threshold_tokens < 1:
            raise ValueError(f"decode_balance long_threshold_tokens must be >= 1, got {long_threshold_tokens}")
        self.weight_requests = weight_requests
        self.weight_kv = weight_kv
        self.long_threshold_tokens = long_threshold_tokens

    def short_weight(self, request: RequestView) -> float:
        """``lam`` of the formula: the concurrency axis's share of the score."""
        length = max(0, request.num_prompt_tokens) + max(0, request.max_tokens)
        return self.long_threshold_tokens / (self.long_threshold_tokens + length)

    def pick(self, request: RequestView, instances: Sequence[InstanceView]) -> Pick | None:
        candidates = available(instances)
        if not candidates:
            return None
        lam = self.short_weight(request)
        prompt = max(0, request.num_prompt_tokens)
        max_requests = max(num_requests(i) + 1 for i in candidates)
        max_kv = max(max(i.num_kv_tokens + prompt for i in candidates), 1)
        best: tuple[float, str, dict[str, float]] | None = None
        for instance in candidates:
            requests_term = lam * self.weight_requests * (num_requests(instance) + 1) / max_requests
            kv_term = (1 - lam) * self.weight_kv * (instance.num_kv_tokens + prompt) / max_kv
            score = requests_term + kv_term
            if best is None or (score, instance.instance_id) < best[:2]:
                best = (score, instance.instance_id, {
                    "requests": float(num_requests(instance)), "kv_tokens": float(instance.num_kv_tokens),
                    "requests_term": requests_term, "kv_term": kv_term, "short_weight": lam})
        assert best is not None
        score, instance_id, breakdown = best
        logger.debug("decode pick %s for %s: score %.4f %s", instance_id, request.request_id, score, breakdown)
        return Pick(instance_id, score, breakdown)
