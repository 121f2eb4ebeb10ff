"""Time-budget chunking: chunk sizes solved from a known cost model, the online fit, and an
engine with a budget that produces exactly the tokens of one without."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from kvstore.hashing import root_hash
from services.common.config import ConfigError
from services.common.cost_model import PrefillCost
from services.common.sampling_params import SamplingParams
from services.engine import LLM
from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.scheduler import OnlineCost, Scheduler
from services.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from services.engine.sequence import RequestId, Sequence

ROOT = root_hash(model="t", block_size=4, dtype="float32")
COST = PrefillCost(a=0.012, b=0.001, d=1e-5)
"""Quadratic: at a 0.1 s budget a chunk at context 0 takes 66 tokens, at context 66 only 46."""
LINEAR = PrefillCost(a=1 / 64, b=1 / 1024, d=0.0)
"""Exact in binary: a 1/8 s budget buys (1/8 - 1/64) * 1024 = 112 tokens, each decode one less."""


def make(budget_s, cost, num_tokens=1000, num_blocks=256, max_seqs=8):
    bm = BlockManager(num_blocks, 4, ROOT)
    return Scheduler(bm, max_seqs, num_tokens, 1000, eos_token_ids=(2,), step_time_budget_s=budget_s,
                     cost=cost)


def add(sched, rid, n, max_tokens=8):
    first = 10 + 1000 * (len(sched.waiting) + len(sched.running))  # no prefix shared with the others
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    s = Sequence(RequestId(rid), list(range(first, first + n)), params)
    sched.add(s)
    return s


def step(sched, seqs):
    """One step with token 5 sampled; its chunks as (request id, start, number of tokens)."""
    out = sched.schedule()
    sched.postprocess(out, {c.request_id: [5] for c in out.chunks if c.samples},
                      {s.request_id: s for s in seqs})
    return [(c.request_id, c.start_position, len(c.token_ids)) for c in out.chunks]


# ----- the chunk solver ----------------------------------------------------------------------
def test_chunks_shrink_as_the_context_grows():
    sched = make(0.1, COST)
    a = add(sched, "a", 300)
    chunks = [step(sched, [a])[0] for _ in range(9)]
    assert [(start, n) for _, start, n in chunks] == [
        (0, 66), (66, 46), (112, 38), (150, 33), (183, 29), (212, 27), (239, 25), (264, 23), (287, 13)]
    assert a.num_output_tokens == 1  # the last chunk (capped by the 13 tokens left) sampled
    for _, start, n in chunks[:-1]:  # each chunk is the most that fits
        assert COST.seconds(n, start) <= 0.1 < COST.seconds(n + 1, start)


def test_decodes_are_paid_for_first():
    sched = make(1 / 8, LINEAR)
    small = [add(sched, rid, 4) for rid in "abc"]
    assert step(sched, small) == [("a", 0, 4), ("b", 0, 4), ("c", 0, 4)]
    d = add(sched, "d", 300)
    assert step(sched, [*small, d]) == [("a", 4, 1), ("b", 4, 1), ("c", 4, 1), ("d", 0, 109)]
    alone = make(1 / 8, LINEAR)
    e = add(alone, "e", 300)
    assert step(alone, [e]) == [("e", 0, 112)]


def test_a_decode_costs_one_token_at_its_context():
    sched = make(0.1, COST)
    small = [add(sched, rid, 4) for rid in "abc"]
    step(sched, small)
    d = add(sched, "d", 300)
    # 3 x (b + d * 4.5) = 3.135 ms of the budget goes to the decodes: 64 tokens instead of 66.
    assert step(sched, [*small, d])[-1] == ("d", 0, 64)


def test_prefills_in_one_step_share_the_seconds():
    sched = make(0.1, COST)
    a, b = add(sched, "a", 40), add(sched, "b", 300)
    # a takes 40 tokens (48 ms past the fixed 12), b gets what the other 40 ms buy at context 0.
    assert step(sched, [a, b]) == [("a", 0, 40), ("b", 0, 34)]


def test_token_budget_and_remaining_tokens_cap_the_chunk():
    sched = make(10.0, COST, num_tokens=50)
    a = add(sched, "a", 120)
    assert [step(sched, [a])[0][2] for _ in range(3)] == [50, 50, 20]
    sched = make(10.0, COST)
    b = add(sched, "b", 20)
    assert step(sched, [b]) == [("b", 0, 20)]


def test_every_step_makes_progress_within_a_budget_too_small_for_one_token():
    sched = make(0.005, COST)  # less than the fixed cost alone
    a, b = add(sched, "a", 3, max_tokens=2), add(sched, "b", 5)
    # a is admitted into the empty step with one token; b waits while a's steps are full.
    assert [step(sched, [a, b]) for _ in range(4)] == [
        [("a", 0, 1)], [("a", 1, 1)], [("a", 2, 1)], [("a", 3, 1)]]
    assert a.is_finished
    assert step(sched, [b]) == [("b", 0, 1)]


def test_without_a_budget_or_a_model_only_the_token_budget_applies():
    for budget_s, cost in ((0.0, COST), (0.1, None)):
        sched = make(budget_s, cost, num_tokens=100)
        a, b = add(sched, "a", 40), add(sched, "b", 300)
        assert step(sched, [a, b]) == [("a", 0, 40), ("b", 0, 60)]


def test_config_rejects_a_negative_budget():
    assert EngineConfig(step_time_budget_s=0.25).step_time_budget_s == 0.25
    with pytest.raises(ConfigError, match="step_time_budget_s: must be >= 0") as info:
        EngineConfig(step_time_budget_s=-1.0)
    assert info.value.field == "step_time_budget_s"


def test_the_scheduler_loads_no_torch():
    code = "import sys, services.engine.scheduler; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ----- the fit -------------------------------------------------------------------------------
TRUE = PrefillCost(a=0.004, b=2e-5, d=3e-9)


def assert_close(cost, expected, rel):
    assert (cost.a, cost.b, cost.d) == pytest.approx((expected.a, expected.b, expected.d), rel=rel)


def test_fit_recovers_known_coefficients():
    samples = [(n, ctx, TRUE.seconds(n, ctx)) for n in (16, 64, 256, 1024, 2048) for ctx in (0, 1000, 8000)]
    assert_close(PrefillCost.fit(samples), TRUE, 1e-6)
    rng = random.Random(0)
    noisy = [(n, ctx, t * rng.uniform(0.99, 1.01)) for n, ctx, t in samples * 4]
    assert_close(PrefillCost.fit(noisy), TRUE, 0.1)


def output(*chunks):
    """A step of chunks given as (start position, number of tokens)."""
    return SchedulerOutput([
        ScheduledChunk(RequestId(f"r{i}"), [7] * n, start, False)
        for i, (start, n) in enumerate(chunks)])


def true_seconds(out):
    """What TRUE charges for a step: one fixed cost, then every chunk's tokens."""
    return TRUE.a + sum(TRUE.seconds(len(c.token_ids), c.start_position) - TRUE.a for c in out.chunks)


def test_the_prior_is_the_reference_scaled_to_the_second_prefill_step():
    online = OnlineCost()
    assert online.observe(output((0, 256)), 5.0) is None  # warm-up: not measured
    assert online.observe(output((300, 1), (40, 1)), 0.01) is None  # decodes only: left out
    out = output((0, 512), (900, 1))
    prior = online.observe(out, 0.3)
    ref = PrefillCost()
    assert prior.seconds(513, online.samples[0][1]) == pytest.approx(0.3)
    assert (prior.b / prior.a, prior.d / prior.a) == pytest.approx((ref.b / ref.a, ref.d / ref.a))


def test_online_fit_of_mixed_steps_recovers_known_coefficients():
    online = OnlineCost()
    rng = random.Random(1)
    for _ in range(40):
        chunks = [(rng.randrange(0, 8000), rng.randrange(2, 2048)) for _ in range(rng.randrange(1, 3))]
        chunks += [(rng.randrange(0, 8000), 1) for _ in range(rng.randrange(0, 4))]  # decodes
        out = output(*chunks)
        online.observe(out, true_seconds(out))
    assert_close(online.cost, TRUE, 1e-6)


def test_refits_start_early():
    online = OnlineCost()
    online.observe(output((0, 64)), 1.0)  # warm-up
    for n, start in ((64, 0), (256, 64), (512, 2000), (1024, 0)):
        out = output((start, n))
        online.observe(out, true_seconds(out))
    assert_close(online.cost, TRUE, 1e-6)  # fitted at the 4th sample, not the 16th


# ----- the engine ----------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts_and_reference(tiny_llama_dir):
    from services.engine import LLM
    from tests.factories import random_prompts

    prompts = random_prompts(6, [5, 70, 17, 40, 33, 50], seed=7)
    reference = LLM(str(tiny_llama_dir), num_kv_blocks=256).generate(prompts, GREEDY)
    return prompts, [o.token_ids for o in reference]


def run_recording(llm, prompts, monkeypatch):
    """Generate, keeping every scheduled chunk."""
    sched, chunks = llm.engine.scheduler, []
    schedule = sched.schedule

    def recording():
        out = schedule()
        chunks.extend(out.chunks if out else [])
        return out

    monkeypatch.setattr(sched, "schedule", recording)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)], chunks


def test_a_budget_nothing_fits_gives_the_same_tokens(tiny_llama_dir, prompts_and_reference, monkeypatch):
    from services.engine import LLM

    prompts, reference = prompts_and_reference
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, max_num_batched_tokens=32, step_time_budget_s=1e-9)
    token_ids, chunks = run_recording(llm, prompts, monkeypatch)
    assert token_ids == reference
    # The fitted model is exposed and handed to the scheduler; under it nothing fits such a
    # budget, so after the first measured steps every prefill goes one token a step.
    assert llm.engine.prefill_cost is llm.engine.scheduler.cost is not None
    assert sum(len(c.token_ids) == 1 and not c.samples for c in chunks) > 100


def test_chunks_sized_by_a_known_model_give_the_same_tokens(tiny_llama_dir, prompts_and_reference,
                                                            monkeypatch):
    from services.engine import LLM

    prompts, reference = prompts_and_reference
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, max_num_batched_tokens=128, step_time_budget_s=0.1)
    monkeypatch.setattr(llm.engine._online_cost, "observe", lambda out, seconds: COST)
    llm.engine.scheduler.cost = COST
    token_ids, chunks = run_recording(llm, prompts, monkeypatch)
    assert token_ids == reference
    sizes = {len(c.token_ids) for c in chunks if not c.samples}
    # The time budget sized them, not the token budget (every prompt would fit 128 at once).
    assert len(sizes) > 3 and max(sizes) <= COST.tokens_within(0.1, 0) == 66


def test_load_stats_price_the_queued_prefill_with_the_fitted_model(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_num_batched_tokens=64)
    engine = llm.engine
    assert engine.stats().queued_prefill_compute_s == 0.0  # no model yet
    engine._online_cost.cost = PrefillCost(a=1.0, b=0.0, d=0.0)  # one second per step
    engine.add_request(list(range(3, 203)), SamplingParams(max_tokens=1))  # 200 tokens: 4 chunks of 64
    engine.add_request(list(range(3, 43)), SamplingParams(max_tokens=1))   # 40 tokens: 1 chunk
    assert engine.stats().queued_prefill_compute_s == 5.0
    while engine.has_unfinished_requests():
        engine.step()
