"""The simulator's balanced bound: one per trace, the same for every policy, and never beaten.

The property is checked on seeded random traces (shared prefixes, repeats, partial blocks,
evictions, every policy, both hit lookups, fixed chunks and step budgets) with every decode
cost term non-zero; hypothesis is not a dependency, so the seeds are a plain loop.
"""

from __future__ import annotations

import math
import random

import pytest

from services.common.cost_model import DecodeCost, PrefillCost
from services.router.policies import POLICIES
from services.router.sim.bound import balanced_bound
from services.router.sim.cluster import SPEC, SimConfig
from services.router.sim.experiment import evaluate, prepare
from services.router.sim.trace import BLOCK_TOKENS, TraceRequest
from services.router.sim.work import Costs
from tests.unit.router.test_sim import COSTS, req

SIM_POLICIES = [SPEC] + sorted(set(POLICIES) - {"encoder_balance"})


def test_a_shared_prefix_is_counted_once_and_the_latest_alone_waits_for_it():
    # 1 ms per token, no step cost. Block 1 is shared: its 512 positions once (0.512 s); each
    # prompt's own block but its last token (511) plus that last token: 0.512 s each.
    requests = [req(0, 0.0, 1024, hash_ids=(1, 2)), req(1, 0.0, 1024, hash_ids=(1, 3))]
    bound = balanced_bound(requests, COSTS, 1, 1)
    assert bound.prefill_s == pytest.approx(1.536)
    assert bound.alone_s == pytest.approx(1.024)        # nobody computed block 1 before 0 s
    late = [*requests, req(2, 5.0, 1024, hash_ids=(1, 2))]   # a repeat: only its last token is its own
    assert balanced_bound(late, COSTS, 1, 1).alone_s == pytest.approx(5.001)
    # One instance computes r0 whole, then r1 after its hit on block 1: exactly the bound.
    report = evaluate(prepare(requests, SimConfig(1, 1, COSTS)), "round_robin")
    assert report.makespan_s == pytest.approx(1.536) and report.balanced_ratio == pytest.approx(1.0)


def test_steps_cost_their_fixed_part_at_least_once_per_budget():
    # a = 10 ms a step, 1 ms a token, budget 110 ms: at most 100 tokens (100 ms) a step.
    costs = Costs(prefill=PrefillCost(a=0.01, b=1e-3, d=0.0), decode=DecodeCost(0.01, 0.0, 0.0), step_budget_s=0.11)
    (alone,) = [req(0, 0.0, 250)]
    bound = balanced_bound([alone], costs, 1, 1)
    assert bound.prefill_s == pytest.approx(0.25 + 3 * 0.01)    # 3 steps: 100 + 100 + 50 tokens
    assert bound.prefill_s == pytest.approx(costs.prefill_seconds(250, 0))


def test_every_policy_is_held_against_the_same_bound():
    requests = [req(i, 0.05 * i, 300 + (i * 7919) % 2500, 2 + i % 4, hash_ids=(i % 3, 100 + i)) for i in range(40)]
    experiment = prepare(requests, SimConfig(3, 2, COSTS))
    reports = [evaluate(experiment, name) for name in (SPEC, "round_robin", "cache_aware")]
    assert {r.bound_makespan_s for r in reports} == {experiment.bound.makespan_s}
    # The same bound, so the ratios rank the policies as their makespans do.
    ranked = sorted(reports, key=lambda r: r.makespan_s)
    assert [r.balanced_ratio for r in ranked] == sorted((r.balanced_ratio for r in reports), reverse=True)


def random_trace(rng: random.Random, num: int) -> list[TraceRequest]:
    """Chained block ids as a Mooncake trace has them: a prompt extends some earlier prompt's
    full blocks (or repeats it whole) with blocks of its own, the last one possibly partial."""
    requests: list[TraceRequest] = []
    next_id, at = 0, 0.0
    for i in range(num):
        at += rng.choice((0.0, rng.expovariate(4.0)))
        base = rng.choice(requests) if requests and rng.random() < 0.6 else None
        if base is not None and rng.random() < 0.25:
            length, ids = base.input_length, base.hash_ids
        else:
            keep = rng.randint(0, base.input_length // BLOCK_TOKENS) if base is not None else 0
            length = keep * BLOCK_TOKENS + rng.randint(1, 2_500)
            num_new = math.ceil(length / BLOCK_TOKENS) - keep
            ids = (base.hash_ids[:keep] if base is not None else ()) + tuple(range(next_id, next_id + num_new))
            next_id += num_new
        requests.append(TraceRequest(f"r{i}", at, length, rng.randint(1, 40), ids))
    return requests


def random_costs(rng: random.Random) -> Costs:
    prefill = PrefillCost(a=rng.uniform(1e-3, 0.03), b=rng.uniform(1e-6, 3e-5), d=rng.uniform(1e-12, 1e-8))
    decode = DecodeCost(a=rng.uniform(1e-3, 5e-3), b=rng.uniform(1e-6, 1e-4), c=rng.uniform(1e-10, 1e-7))
    chunk = rng.choice((0, 0, 128, 1_000))
    return Costs(prefill, decode, step_budget_s=prefill.a + rng.uniform(2e-3, 0.08), chunk_tokens=chunk,
                 decode_max_batch=rng.randint(1, 8))


@pytest.mark.parametrize("first_seed", range(0, 120, 20))
def test_no_run_beats_the_bound(first_seed):
    for seed in range(first_seed, first_seed + 20):
        rng = random.Random(seed)
        config = SimConfig(rng.randint(1, 3), rng.randint(1, 3), random_costs(rng),
                           kv_capacity_blocks=rng.choice((4, 16, 1 << 16)), hits_at=rng.choice(("start", "arrival")))
        experiment = prepare(random_trace(rng, rng.randint(1, 25)), config, load=rng.uniform(0.3, 3.0))
        policy = rng.choice(SIM_POLICIES)
        report = evaluate(experiment, policy, seed=seed)
        assert report.balanced_ratio <= 1.0 + 1e-9, (seed, policy, report.makespan_s, experiment.bound)
