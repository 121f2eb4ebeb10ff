"""The balanced bound: a makespan no run of the offered trace can beat, whatever the policy.

One bound per trace (at its load), the same for every policy, so their ratios (bound makespan /
achieved makespan) compare as their throughputs do: a policy whose prompts hit the KV store
more does less work and scores higher. Built from the trace alone (lengths, block ids,
arrivals) and the cost models of ``work.py``; it holds for any placement, any order, any prefix
hits a run gets (looked up at arrival or at start, any store capacity).

**Prefill work.** A prefill step computing n tokens after ctx costs ``a + sum over its
positions p of tok(p)``, ``tok(p) = b + d * (p + 1/2)`` (``PrefillCost.seconds`` is exactly
that), so a prompt computed in s steps costs ``s * a`` plus the sum of tok over the positions
it computes. A position of a block (trace block id and its index in the prompt) that no other
request holds, and every prompt's last token (the first output token needs it), are computed
by their own request: with ``u_r`` the sum of tok over those positions of request r and n_r
their number, r's prefill costs at least

    f_r = a * max(1, ceil(n_r / n_max), ceil(u_r / (budget - a))) + u_r

(n_max: the most tokens a step computes, the fixed chunk or the budget's at context 0; the
budget term only when a single token always fits within ``budget - a``, so every budget step
computes at most that much). Every block held by several requests is computed at least once
before anyone hits it, by a request holding it (its positions up to the earliest last token of
those requests): E, the sum of tok over those positions, adds at least E to the steps' total.
So total prefill work >= sum_r f_r + E.

**Alone.** Blocks of r that no request arriving before r holds (block ids chain, so they follow
every block that one does) are computed after r arrives, in order, by r or by others whose
prefill ends before r's starts. So r's first token comes at least ``f_r + tok over its other
such positions`` after its arrival t_r, and then decode alone takes
``Costs.decode_alone_s(r)``: Z_r.

**Decode** is ``work.py``'s D_r: (O_r - 1) * (a / B_max + b) + c * (KV its steps read).

With N_p prefill and N_d decode instances and the first arrival at t0::

    bound makespan = max( (sum_r f_r + E) / N_p,  sum_r D_r / N_d,  max_r (t_r - t0 + Z_r) )
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.router.sim.trace import BLOCK_TOKENS, TraceRequest
from services.router.sim.work import Costs

_SLACK = 1e-9
"""Float rounding must not count a step that a budget-sized chunk does not take."""

BlockKey = tuple[int, int]
"""(trace block id, its index in the prompt)."""


@dataclass(frozen=True)
class Bound:
    prefill_s: float
    """Total prefill work's lower bound over the prefill instances."""
    decode_s: float
    """Total decode card-seconds' lower bound over the decode instances."""
    alone_s: float
    """The latest request alone: arrival after t0 plus its own least time."""

    @property
    def makespan_s(self) -> float:
        return max(self.prefill_s, self.decode_s, self.alone_s)


def balanced_bound(requests: Sequence[TraceRequest], costs: Costs, num_prefill: int, num_decode: int) -> Bound:
    """The bound of the module docstring for ``requests`` (arrival order), seconds after t0."""
    if not requests:
        return Bound(0.0, 0.0, 0.0)
    ends = _shared_block_ends(requests)
    own = [_own_prefill_s(r, ends, costs) for r in requests]
    shared_s = sum(_tok_s(costs, key[1] * BLOCK_TOKENS, end) for key, end in ends.items() if end is not None)
    decode_s = sum(costs.decode_work_s(r) for r in requests)
    return Bound(prefill_s=(sum(own) + shared_s) / num_prefill, decode_s=decode_s / num_decode,
                 alone_s=_latest_alone_s(requests, own, ends, costs))


def _blocks(request: TraceRequest) -> list[tuple[BlockKey, int, int]]:
    """(key, first position, end before the last token) of each of its blocks."""
    last = request.input_length - 1
    return [((block_id, k), k * BLOCK_TOKENS, min((k + 1) * BLOCK_TOKENS, last))
            for k, block_id in enumerate(request.hash_ids) if k * BLOCK_TOKENS < request.input_length]


def _shared_block_ends(requests: Sequence[TraceRequest]) -> dict[BlockKey, int | None]:
    """Every block: None when one request holds it, else the end of the positions that one of
    its holders must compute (the earliest of their last tokens)."""
    ends: dict[BlockKey, int | None] = {}
    holders: dict[BlockKey, int] = {}
    for request in requests:
        for key, _, end in _blocks(request):
            holders[key] = holders.get(key, 0) + 1
            ends[key] = end if key not in ends else min(end, ends[key])  # type: ignore[type-var]
    return {key: (ends[key] if holders[key] > 1 else None) for key in ends}


def _tok_s(costs: Costs, start: int, end: int) -> float:
    """Sum of tok(p) over positions [start, end): a step's cost without its fixed part."""
    return costs.prefill.seconds(end - start, start) - costs.prefill.a if end > start else 0.0


def _own_prefill_s(request: TraceRequest, ends: dict[BlockKey, int | None], costs: Costs) -> float:
    """f_r: the prefill only ``request`` can do, in the fewest steps it could take."""
    last = request.input_length - 1
    spans = [(start, end) for key, start, end in _blocks(request) if ends[key] is None]
    spans += [(min(len(request.hash_ids) * BLOCK_TOKENS, last), last), (last, last + 1)]
    u = sum(_tok_s(costs, start, end) for start, end in spans)
    n = sum(max(0, end - start) for start, end in spans)
    return costs.prefill.a * _min_steps(n, u, costs, request.input_length) + u


def _min_steps(num_tokens: int, tok_s: float, costs: Costs, max_ctx: int) -> int:
    prefill, budget = costs.prefill, costs.step_budget_s
    n_max = costs.chunk_tokens or prefill.tokens_within(budget, 0)
    steps = max(1, math.ceil(num_tokens / n_max - _SLACK))
    one_token_s = _tok_s(costs, max_ctx - 1, max_ctx)
    if not costs.chunk_tokens and 0 < one_token_s <= budget - prefill.a:
        steps = max(steps, math.ceil(tok_s / (budget - prefill.a) - _SLACK))
    return steps


def _latest_alone_s(requests: Sequence[TraceRequest], own: Sequence[float], ends: dict[BlockKey, int | None],
                    costs: Costs) -> float:
    """max_r (t_r - t0 + Z_r); blocks count as seen only from requests that arrived strictly earlier."""
    t0 = requests[0].arrival_s
    seen: set[BlockKey] = set()
    arrived: list[BlockKey] = []
    latest, arrival = 0.0, t0
    for request, own_s in zip(requests, own):
        if request.arrival_s > arrival:
            seen.update(arrived)
            arrived, arrival = [], request.arrival_s
        blocks = _blocks(request)
        unseen_s = sum(_tok_s(costs, start, end) for key, start, end in blocks
                       if ends[key] is not None and key not in seen)
        latest = max(latest, request.arrival_s - t0 + own_s + unseen_s + costs.decode_alone_s(request))
        arrived.extend(key for key, _, _ in blocks)
    return latest
