"""What each request costs and the load a trace offers.

Costs come from ``services/common/cost_model.py`` (the reference numbers of SPEC.md), the same
models the live router and the engines use:

- **prefill** of a prompt of L tokens after H cached ones runs in steps; each step computes as
  many new tokens as fit a time budget (``PrefillCost.tokens_within``; the default 68 ms is the
  reference's 4,096-token step) or a fixed chunk, and costs ``PrefillCost.seconds(n, ctx)``;
- **decode** emits one token per running request per step, a step of ``batch`` requests holding
  ``kv`` tokens costing ``DecodeCost.seconds(batch, kv)``. The first output token comes from
  prefill, so a request with O output tokens needs O - 1 decode steps, the j-th reading
  L + 1 + j tokens of its own KV.

The balanced bound a run is held against, a makespan no run of the trace can beat, is built
from these costs in ``bound.py``; ``decode_work_s`` (D_r: a request's decode card-seconds at a
full batch B_max, the cheapest a token can be) and ``decode_alone_s`` (its decode alone, in a
batch of one) are its decode terms::

    D_r = (O_r - 1) * (a / B_max + b) + c * (KV its steps read)
    decode alone = (O_r - 1) * (a + b) + c * (KV its steps read)

**Offered work and load.** Before any run, the trace's ``hash_ids`` are replayed in arrival
order through a fresh ``kvstore.index.EmbeddedIndex`` (the KV store's own index code; each
request stores its blocks as it arrives), giving every request its offered prefill seconds P_r.
The offered load of a trace whose arrivals span S seconds, with N_p prefill and N_d decode
instances, is ``max(sum P_r / N_p, sum D_r / N_d) / S`` over those: the busier stage's share of
its balanced capacity. ``time_factor`` scales the arrival gaps so that it equals the requested
load (1.0: the trace offers exactly what the balanced cluster can do in its span), and the bound
is taken on the scaled trace. (A run usually hits less than the replay, its prompts computing
side by side, so at load 1.0 it is a little over.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.index import EmbeddedIndex
from kvstore.retention import Retention
from services.common.cost_model import DecodeCost, PrefillCost
from services.router.sim.trace import TraceRequest, span_s

CHAT_TTL_S = Retention().ttl_s("chat")
"""Trace prompts are chat: blocks live 7 days (longer than any trace, so capacity decides)."""


@dataclass(frozen=True)
class Costs:
    prefill: PrefillCost = field(default_factory=PrefillCost)
    decode: DecodeCost = field(default_factory=DecodeCost)
    step_budget_s: float = 0.068
    """Prefill step time budget (the reference's 4,096-token step takes 68 ms)."""
    chunk_tokens: int = 0
    """A fixed prefill chunk instead of the time budget (0: use the budget)."""
    decode_max_batch: int = 256
    """Most requests a decode instance runs at once (the reference measures up to 256)."""

    def prefill_seconds(self, num_tokens: int, num_cached: int) -> float:
        """Compute time of a prompt after ``num_cached`` hit tokens, step by step."""
        total, done = 0.0, num_cached
        while done < num_tokens:
            n = self.chunk_tokens or self.prefill.tokens_within(self.step_budget_s, done)
            n = min(n, num_tokens - done)
            total += self.prefill.seconds(n, done)
            done += n
        return total

    def decode_kv_read(self, request: TraceRequest) -> int:
        """KV tokens the request's own decode steps read, summed over its steps."""
        steps = request.output_length - 1
        return steps * (request.input_length + 1) + steps * (steps - 1) // 2

    def decode_work_s(self, request: TraceRequest) -> float:
        steps = request.output_length - 1
        per_step = self.decode.a / self.decode_max_batch + self.decode.b
        return steps * per_step + self.decode.c * self.decode_kv_read(request)

    def decode_alone_s(self, request: TraceRequest) -> float:
        steps = request.output_length - 1
        return steps * (self.decode.a + self.decode.b) + self.decode.c * self.decode_kv_read(request)


@dataclass(frozen=True)
class OfferedWork:
    """Per request, in trace order: P_r (at the replay's hits) and D_r of the module docstring."""

    prefill_s: tuple[float, ...]
    decode_s: tuple[float, ...]
    num_hit_tokens: int
    num_prompt_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def per_instance_s(self, num_prefill: int, num_decode: int) -> tuple[float, float]:
        """Balanced busy seconds of one prefill and of one decode instance."""
        return sum(self.prefill_s) / num_prefill, sum(self.decode_s) / num_decode


def offered_work(requests: Sequence[TraceRequest], costs: Costs, capacity_blocks: int) -> OfferedWork:
    now = [0.0]
    index = EmbeddedIndex(capacity_blocks, clock=lambda: now[0])
    prefill_s, num_hit_tokens = [], 0
    for request in requests:
        now[0] = request.arrival_s
        num_hit_blocks = index.lookup(request.hash_ids)  # renews the hit blocks
        for block_id in request.hash_ids[num_hit_blocks:]:
            index.insert(block_id, CHAT_TTL_S)
        cached = request.cached_tokens(num_hit_blocks)
        prefill_s.append(costs.prefill_seconds(request.input_length, cached))
        num_hit_tokens += cached
    return OfferedWork(tuple(prefill_s), tuple(costs.decode_work_s(r) for r in requests), num_hit_tokens,
                       sum(r.input_length for r in requests))


def offered_load(requests: Sequence[TraceRequest], work: OfferedWork, num_prefill: int, num_decode: int) -> float:
    """The busier stage's balanced busy time over the arrival span (inf: all arrive at once)."""
    span = span_s(requests)
    busiest = max(work.per_instance_s(num_prefill, num_decode))
    return busiest / span if span > 0 else float("inf")


def time_factor(requests: Sequence[TraceRequest], work: OfferedWork, num_prefill: int, num_decode: int,
                load: float) -> float:
    """What to multiply the arrival gaps by so that the offered load is ``load`` (1.0 when the
    trace has no span to scale)."""
    if not load > 0:
        raise ValueError(f"load must be > 0 (got {load!r})")
    offered = offered_load(requests, work, num_prefill, num_decode)
    return offered / load if offered != float("inf") else 1.0
