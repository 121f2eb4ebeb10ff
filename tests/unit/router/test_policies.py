"""Routing policies over hand-built snapshots: exact picks, availability, the SPEC balancers."""

from __future__ import annotations

import pytest

from services.router.policies import POLICIES, InstanceView, Pick, Policy, RequestView, make_policy
from services.router.policies.cache_aware import CacheAware
from services.router.policies.decode_balance import DecodeBalance
from services.router.policies.encoder_balance import EncoderBalance
from services.router.policies.least_requests import LeastRequests
from services.router.policies.power_of_two import PowerOfTwo
from services.router.policies.prefill_buckets import (DEFAULT_BOUNDS, PrefillBuckets, allocate, assign,
                                                      bucket_of, scale_bounds)

SEEDED = {"power_of_two": {"seed": 0}, "encoder_balance": {"seed": 0}}


def inst(instance_id: str, role: str = "prefill", **fields) -> InstanceView:
    return InstanceView(instance_id, role, **fields)


def req(num_prompt_tokens: int = 100, request_id: str = "r", **fields) -> RequestView:
    return RequestView(request_id, num_prompt_tokens, **fields)


def route(policy: Policy, request: RequestView, instances: list[InstanceView]) -> str:
    """Arrive, pick and report back, the way the instance pool does."""
    policy.on_arrival(request)
    chosen = policy.pick(request, instances)
    assert chosen is not None
    policy.on_pick(request, chosen)
    return chosen.instance_id


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ----- registry and availability ---------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_make_policy_builds_every_registered_policy(name):
    policy = make_policy(name)
    assert isinstance(policy, Policy) and policy.name == name


def test_make_policy_passes_settings_and_rejects_unknown_names():
    assert make_policy("cache_aware", balance_abs_threshold=4).balance_abs_threshold == 4
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_nothing_available_gives_none(name):
    policy = make_policy(name, **SEEDED.get(name, {}))
    assert policy.pick(req(), []) is None
    down = [inst("a", is_healthy=False), inst("b", is_draining=True)]
    assert policy.pick(req(), down) is None


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_unhealthy_and_draining_instances_are_never_picked(name):
    policy = make_policy(name, **SEEDED.get(name, {}))
    instances = [inst("a", is_healthy=False, machine="m1"), inst("b", is_draining=True, machine="m2"),
                 inst("c", num_running=50, num_waiting=9, queued_compute_s=30.0, num_kv_tokens=10**6,
                      num_patches_in_flight=99, machine="m3")]
    assert {route(policy, req(block_hashes=(b"x",)), instances) for _ in range(20)} == {"c"}


# ----- baselines -------------------------------------------------------------------------------
def test_least_requests_counts_running_plus_waiting_and_breaks_ties_by_id():
    instances = [inst("c", num_running=1), inst("b", num_waiting=1), inst("a", num_running=2)]
    chosen = LeastRequests().pick(req(), instances)
    assert chosen == Pick("b", 1.0, {"requests": 1.0})


def test_power_of_two_exact_picks_with_a_seed():
    instances = [inst("d"), inst("c", num_running=3), inst("b", num_waiting=1), inst("a", num_running=3)]
    policy = PowerOfTwo(seed=7)
    # Draws with seed 7: (c,a) tie -> c, (d,c), (a,d), (a,b), (a,c) tie -> a, (b,a).
    assert [policy.pick(req(), instances).instance_id for _ in range(6)] == ["c", "d", "d", "b", "a", "b"]
    first = PowerOfTwo(seed=7).pick(req(), instances)
    assert first.breakdown == {"requests": 3.0, "first_requests": 3.0, "second_requests": 3.0}


def test_power_of_two_with_one_instance_picks_it():
    assert PowerOfTwo(seed=1).pick(req(), [inst("x", num_running=4), inst("y", is_healthy=False)]) == \
        Pick("x", 4.0, {"requests": 4.0, "first_requests": 4.0})


# ----- cache aware -----------------------------------------------------------------------------
def test_cache_aware_follows_the_longest_prefix_sent_before():
    policy = CacheAware()
    instances = [inst("a"), inst("b"), inst("c")]
    assert route(policy, req(block_hashes=(b"1", b"2", b"3")), instances) == "a"  # nothing known: fewest, id
    policy.on_pick(req(block_hashes=(b"1", b"9")), Pick("b"))
    loaded = [inst("a", num_running=3), inst("b", num_running=1), inst("c")]
    chosen = policy.pick(req(block_hashes=(b"1", b"2", b"7")), loaded)
    assert chosen == Pick("a", 2.0, {"matched_blocks": 2.0, "requests": 3.0, "balanced_mode": 0.0})
    # Equal match (b"1" on a and b): fewer requests wins.
    assert policy.pick(req(block_hashes=(b"1", b"5")), loaded).instance_id == "b"
    # A later block alone is no prefix match.
    assert policy.pick(req(block_hashes=(b"0", b"2")), loaded).instance_id == "c"


def test_cache_aware_falls_back_to_least_requests_when_imbalanced():
    policy = CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5)
    policy.on_pick(req(block_hashes=(b"1",)), Pick("a"))
    hot = [inst("a", num_running=10), inst("b", num_running=5)]  # 10-5 > 4 and 10 > 7.5
    assert policy.pick(req(block_hashes=(b"1",)), hot) == \
        Pick("b", 0.0, {"matched_blocks": 0.0, "requests": 5.0, "balanced_mode": 1.0})
    warm = [inst("a", num_running=9), inst("b", num_running=5)]  # 9-5 = 4: not above the threshold
    assert policy.pick(req(block_hashes=(b"1",)), warm).instance_id == "a"


def test_cache_aware_forgets_least_recent_blocks_and_removed_instances():
    policy = CacheAware(max_tracked_blocks=2)
    policy.on_pick(req(block_hashes=(b"p", b"x1")), Pick("a"))
    policy.on_pick(req(block_hashes=(b"p", b"y1")), Pick("a"))  # evicts x1, keeps the shared prefix
    assert policy.matched_blocks("a", (b"p", b"y1")) == 2
    assert policy.matched_blocks("a", (b"p", b"x1")) == 1
    policy.pick(req(), [inst("b")])
    assert policy.matched_blocks("a", (b"p",)) == 0


# ----- decode balance --------------------------------------------------------------------------
DECODE = [inst("busy", "decode", num_running=10, num_kv_tokens=1_000),   # many short requests
          inst("full", "decode", num_running=2, num_kv_tokens=50_000)]   # a few long ones


def test_decode_short_goes_to_low_concurrency_long_goes_to_low_kv():
    policy = DecodeBalance()
    assert policy.pick(req(100, max_tokens=100), DECODE).instance_id == "full"
    assert policy.pick(req(60_000, max_tokens=1_000), DECODE).instance_id == "busy"


def test_decode_breakdown_holds_the_formula_terms():
    chosen = DecodeBalance(long_threshold_tokens=1_000).pick(req(0, max_tokens=1_000), DECODE)
    # lam = 1000 / (1000 + 1000) = 0.5; max requests 11, max kv 50000.
    assert chosen.instance_id == "busy"
    assert chosen.breakdown == pytest.approx({
        "requests": 10.0, "kv_tokens": 1_000.0, "short_weight": 0.5,
        "requests_term": 0.5 * 11 / 11, "kv_term": 0.5 * 1_000 / 50_000})
    assert chosen.score == pytest.approx(0.5 + 0.01)


def test_decode_ties_go_to_the_smallest_id_and_weights_are_checked():
    same = [inst("y", "decode", num_running=1), inst("x", "decode", num_running=1)]
    assert DecodeBalance().pick(req(), same).instance_id == "x"
    with pytest.raises(ValueError, match="weights"):
        DecodeBalance(weight_requests=0, weight_kv=0)
    with pytest.raises(ValueError, match="long_threshold_tokens"):
        DecodeBalance(long_threshold_tokens=0)


# ----- encoder balance -------------------------------------------------------------------------
def test_encoder_random_machine_then_fewest_patches():
    instances = [inst("e1", "encoder", machine="m1", num_patches_in_flight=5),
                 inst("e2", "encoder", machine="m1", num_patches_in_flight=2),
                 inst("e3", "encoder", machine="m2"),
                 inst("solo", "encoder", num_patches_in_flight=9)]
    policy = EncoderBalance(seed=3)
    # Seed 3 draws the machines m1, solo, solo, m1, m2, solo.
    assert [policy.pick(req(), instances).instance_id for _ in range(6)] == ["e2", "solo", "solo", "e2", "e3", "solo"]
    assert EncoderBalance(seed=3).pick(req(), instances) == Pick("e2", 2.0, {"patches": 2.0, "machines": 3.0})


def test_encoder_instances_without_machine_are_each_their_own_machine():
    instances = [inst("a", "encoder"), inst("b", "encoder"), inst("m", "encoder", machine="a")]
    assert EncoderBalance(seed=0).pick(req(), instances).breakdown["machines"] == 3.0
    assert {EncoderBalance(seed=s).pick(req(), instances).instance_id for s in range(30)} == {"a", "b", "m"}


# ----- prefill buckets: pure core --------------------------------------------------------------
def test_bucket_of_uses_upper_bounds():
    assert [bucket_of(n, DEFAULT_BOUNDS) for n in (0, 16_383, 16_384, 65_535, 65_536, 262_144, 10**7)] == \
        [0, 0, 1, 1, 2, 3, 3]


def test_scale_bounds_keeps_the_reference_fractions_ascending_and_positive():
    assert scale_bounds(1_048_576) == DEFAULT_BOUNDS
    assert scale_bounds(2048) == (32, 128, 512)
    assert scale_bounds(8192) == (128, 512, 2048)
    assert scale_bounds(1) == (1, 2, 3)
    with pytest.raises(ValueError, match="max_model_len"):
        scale_bounds(0)


@pytest.mark.parametrize("demand, n, caps, expected", [
    ([60, 30, 10, 0], 10, [0, 0, 0, 0], [6, 3, 1, 0]),      # exact proportion
    ([1, 1, 1, 1], 6, [0, 0, 0, 0], [2, 2, 1, 1]),          # equal remainders: lower buckets first
    ([5, 3, 0, 0], 3, [0, 0, 0, 0], [2, 1, 0, 0]),          # 1.875 / 1.125: remainders .875 > .125
    ([99, 1, 0, 0], 10, [0, 0, 0, 0], [9, 1, 0, 0]),        # demand gets at least one
    ([100, 1, 1, 0], 2, [0, 0, 0, 0], [1, 1, 0, 0]),        # too few instances: most demand first
    ([0, 0, 0, 0], 6, [0, 0, 0, 0], [2, 2, 1, 1]),          # no demand: even spread
    ([10, 80, 10, 0], 8, [0, 3, 0, 0], [3, 3, 2, 0]),       # capped excess: most demand per instance
    ([5, 0, 0, 0], 4, [3, 0, 0, 2], [3, 1, 0, 0]),          # capped excess to empty buckets, low first
    ([0, 0, 0, 5], 10, [2, 2, 2, 2], [2, 2, 2, 4]),         # caps cannot hold the fleet: demand decides
    ([3, 0, 0, 0], 0, [0, 0, 0, 0], [0, 0, 0, 0]),
])
def test_allocate_exact(demand, n, caps, expected):
    assert allocate(demand, n, caps) == expected


def test_allocate_rejects_bad_input():
    with pytest.raises(ValueError, match="one cap per bucket"):
        allocate([1.0, 2.0], 3, [0])
    with pytest.raises(ValueError, match=">= 0"):
        allocate([1.0, -2.0], 3, [0, 0])


def test_assign_keeps_instances_in_their_bucket_when_it_can():
    prev = {"a": 0, "b": 0, "c": 0, "d": 1}
    assert assign(prev, [1, 1, 0, 2], ["d", "c", "b", "a"]) == {"a": 0, "b": 3, "c": 3, "d": 1}
    assert assign(prev, [3, 1, 0, 0], ["a", "b", "c", "d"]) == prev
    # A newcomer fills the lowest bucket with room; a gone instance frees its place.
    assert assign(prev, [2, 1, 1, 0], ["a", "b", "d", "e"]) == {"a": 0, "b": 0, "d": 1, "e": 2}
    with pytest.raises(ValueError, match="summing"):
        assign({}, [1, 1], ["a"])


# ----- prefill buckets: the policy -------------------------------------------------------------
BOUNDS = (100, 1_000, 10_000)


def fleet(**loads: float) -> list[InstanceView]:
    return [inst(f"p{i}", queued_compute_s=loads.get(f"p{i}", 0.0)) for i in range(4)]


def test_prefill_buckets_follow_a_shift_in_the_length_mix_within_two_rounds():
    clock = FakeClock()
    policy = PrefillBuckets(bounds=BOUNDS, caps=(3, 0, 0, 2), round_s=10.0, clock=clock)
    first = policy.pick(req(50), fleet())
    assert first.breakdown == {"bucket": 0.0, "queued_compute_s": 0.0, "requests": 0.0, "borrowed": 1.0}
    for _ in range(10):                                   # round 1: short prompts only, one pool
        route(policy, req(50), fleet())
    assert policy.allocation == {0: (), 1: (), 2: (), 3: ()}
    clock.now = 10.0
    route(policy, req(50), fleet())                       # round 2 follows round 1's demand
    assert policy.last_demand_s[0] > 0 and policy.last_demand_s[1:] == (0.0, 0.0, 0.0)
    assert policy.allocation == {0: ("p0", "p1", "p2"), 1: ("p3",), 2: (), 3: ()}  # cap 3, spare -> bucket 1
    assert policy.pick(req(20_000), fleet(p0=0.5, p1=0.5, p2=0.5)).breakdown["borrowed"] == 1.0
    for _ in range(10):                                   # the mix shifts to long prompts
        route(policy, req(20_000), fleet())
    clock.now = 20.0
    chosen = policy.pick(req(20_000), fleet(p1=2.0))
    # Bucket 3 takes its cap of 2; the one short prompt of round 2 keeps bucket 0 one instance and
    # the spare (bucket 3 is full) goes there too; p0 and p1 stay where they were.
    assert policy.allocation == {0: ("p0", "p1"), 1: (), 2: (), 3: ("p2", "p3")}
    assert chosen == Pick("p2", 0.0, {"bucket": 3.0, "queued_compute_s": 0.0, "requests": 0.0, "borrowed": 0.0})


def test_prefill_buckets_pick_least_queued_compute_then_requests_in_the_bucket():
    clock = FakeClock()
    policy = PrefillBuckets(bounds=BOUNDS, round_s=1.0, clock=clock)
    route(policy, req(50), fleet())
    route(policy, req(5_000), fleet())
    clock.now = 1.0
    policy.pick(req(50), fleet())
    # Demand 0.0235 s vs 0.0776 s (cost model) over 4 instances: 1 short, 3 medium.
    assert policy.allocation == {0: ("p0",), 1: (), 2: ("p1", "p2", "p3"), 3: ()}
    loads = [inst("p0", queued_compute_s=1.0), inst("p1", queued_compute_s=1.0, num_running=2),
             inst("p2", queued_compute_s=1.0, num_running=1), inst("p3", queued_compute_s=3.0)]
    assert policy.pick(req(50), loads).instance_id == "p0"
    assert policy.pick(req(5_000), loads).instance_id == "p2"
    # Work-conserving: p0 is 8 s behind, more than the short prompt's own compute, so another
    # bucket's instance takes it; a small gap does not (the bucket keeps its isolation).
    loads[0] = inst("p0", queued_compute_s=9.0)
    borrowed = policy.pick(req(50), loads)
    assert borrowed.instance_id == "p2" and borrowed.breakdown["borrowed"] == 1.0
    loads[0] = inst("p0", queued_compute_s=1.01)
    assert policy.pick(req(50), loads).instance_id == "p0"


def short_prompts_round() -> PrefillBuckets:
    """A policy one round in, whose only demand was one short prompt: bucket 0 has the fleet."""
    clock = FakeClock()
    policy = PrefillBuckets(bounds=BOUNDS, round_s=1.0, clock=clock)
    route(policy, req(50), fleet())
    clock.now = 1.0
    policy.pick(req(50), fleet())
    return policy


def test_prefill_buckets_redivide_when_the_available_set_changes():
    policy = short_prompts_round()
    assert policy.allocation[0] == ("p0", "p1", "p2", "p3")
    policy.pick(req(50), [inst("p0", is_healthy=False), *fleet()[1:], inst("p9")])
    assert policy.allocation[0] == ("p1", "p2", "p3", "p9")


def test_prefill_buckets_configure_validates_and_applies_at_the_next_pick():
    policy = short_prompts_round()
    with pytest.raises(ValueError, match="strictly ascending"):
        policy.configure(bounds=(100, 100, 1_000))
    with pytest.raises(ValueError, match="caps must be 4 integers"):
        policy.configure(caps=(1, 1))
    with pytest.raises(ValueError, match="caps must be 4 integers"):
        policy.configure(caps=(1, -1, 0, 0))
    with pytest.raises(ValueError, match="round_s"):
        policy.configure(round_s=0)
    with pytest.raises(ValueError, match="bounds"):
        PrefillBuckets(bounds=(0, 5, 9))
    assert (policy.bounds, policy.caps, policy.round_s) == (BOUNDS, (0, 0, 0, 0), 1.0)
    policy.configure(caps=(2, 0, 0, 0), round_s=5.0)
    assert policy.allocation[0] == ("p0", "p1", "p2", "p3")  # not yet
    policy.pick(req(50), fleet())
    assert policy.allocation == {0: ("p0", "p1"), 1: ("p2",), 2: ("p3",), 3: ()}
    assert (policy.caps, policy.round_s) == ((2, 0, 0, 0), 5.0)
    with pytest.raises(ValueError, match="caps must be 3 integers"):
        policy.configure(bounds=(100, 1_000))                # caps must follow the number of buckets
    policy.configure(bounds=(100, 1_000), caps=(0, 0, 0))   # 3 buckets: history dropped, one pool
    assert policy.pick(req(50), fleet()).breakdown["borrowed"] == 1.0
    assert policy.allocation == {0: (), 1: (), 2: ()} and policy.last_demand_s == (0.0, 0.0, 0.0)
