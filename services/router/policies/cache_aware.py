"""Cache-aware routing in the style of SGLang's router: send a prompt where its prefix went before.

The router cannot see the instances' caches, so it remembers what it sent: for each instance the
block hashes of the prompts routed there, most recently used last, at most
``max_tracked_blocks`` per instance (the oldest are forgotten first, as the instance's own cache
would evict them). Block hashes are chained, so a prompt's matched prefix is its leading run of
hashes found in an instance's set.

Prefix affinity alone piles a popular prefix onto one instance, so when load is imbalanced
(``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min``, counting
running plus waiting requests) the policy routes by least requests instead until it evens out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.router.policies.base import InstanceView, Pick, Policy, RequestView, available
from services.router.policies.least_requests import num_requests


class CacheAware(Policy):
    """Longest matched prefix (ties: fewer requests, then smallest id); least requests while the
    load is imbalanced. ``balanced_mode`` in the breakdown is 1 when that fallback decided."""

    name = "cache_aware"
    needs_block_hashes = True

    def __init__(self, balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.5,
                 max_tracked_blocks: int = 100_000) -> None:
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0 or max_tracked_blocks < 1:
            raise ValueError("cache_aware needs balance_abs_threshold >= 0, balance_rel_threshold >= 1 "
                             "and max_tracked_blocks >= 1")
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tracked_blocks = max_tracked_blocks
        self._sent: dict[str, OrderedDict[bytes, None]] = {}
        """Instance id -> the block hashes sent there, least recently used first."""

    def matched_blocks(self, instance_id: str, block_hashes: Sequence[bytes]) -> int:
        sent = self._sent.get(instance_id)
        if not sent:
            return 0
        matched = 0
        for block_hash in block_hashes:
            if block_hash not in sent:
                break
            matched += 1
        return matched

    def is_imbalanced(self, candidates: Sequence[InstanceView]) -> bool:
        loads = [num_requests(i) for i in candidates]
        most, least = max(loads), min(loads)
        return most - least > self.balance_abs_threshold and most > self.balance_rel_threshold * least

    def pick(self, request: RequestView, instances: Sequence[InstanceView]) -> Pick | None:
        candidates = available(instances)
        if not candidates:
            return None
        # Instances gone from the pool will not come back with their cache: forget them.
        present = {i.instance_id for i in instances}
        for instance_id in [i for i in self._sent if i not in present]:
            del self._sent[instance_id]
        matched = {i.instance_id: self.matched_blocks(i.instance_id, request.block_hashes) for i in candidates}
        is_fallback = self.is_imbalanced(candidates)
        if is_fallback:
            chosen = min(candidates, key=lambda i: (num_requests(i), i.instance_id))
        else:
            chosen = min(candidates, key=lambda i: (-matched[i.instance_id], num_requests(i), i.instance_id))
        num_matched = matched[chosen.instance_id]
        return Pick(chosen.instance_id, float(num_matched), {
            "matched_blocks": float(num_matched), "requests": float(num_requests(chosen)),
            "balanced_mode": float(is_fallback)})

    def on_pick(self, request: RequestView, pick: Pick) -> None:
        sent = self._sent.setdefault(pick.instance_id, OrderedDict())
        # Touched last block first, so a prompt's leading blocks are the most recent: eviction
        # drops tails before the shared prefix (a radix cache evicts leaves first too).
        for block_hash in reversed(request.block_hashes):
            sent[block_hash] = None
            sent.move_to_end(block_hash)
        while len(sent) > self.max_tracked_blocks:
            sent.popitem(last=False)
