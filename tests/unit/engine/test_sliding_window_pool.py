"""A hybrid model's sliding-window layers keep only their window in the engine's KV pool.

The block accounting is held to exact block ids (torch-free); the engine to transformers'
greedy tokens on prompts far longer than the window, with the window pool's use checked after
every step: a sequence holds at most ceil((W - 1) / B) + 1 window blocks while its
full-attention blocks grow with it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from kvstore.hashing import root_hash
from services.common.sampling_params import SamplingParams
from services.engine.block_manager import NULL_BLOCK, BlockManager, SlidingWindowBlockManager
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.kernels import select as kernel_select
from services.engine.kv_groups import KVGroups, PrefixHit, num_window_blocks
from services.engine.models.loader import load_model
from services.engine.scheduler import Scheduler
from services.engine.sequence import RequestId, Sequence
from tests.factories import make_tiny_model_dir, random_prompts

W, B = 24, 16
MAX_WINDOW_BLOCKS = -(-(W - 1) // B) + 1  # 3: what a sequence holds after every step
ROOT = root_hash(model="t", block_size=B, dtype="float32")
GREEDY = dict(temperature=0, ignore_eos=True)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ----- block accounting (torch-free) -----------------------------------------------------
def groups(num_full=64, num_window=16) -> KVGroups:
    return KVGroups([BlockManager(num_full, B, ROOT), SlidingWindowBlockManager(num_window, B, ROOT, W)])


def seq_of(n: int, rid="a", offset=3) -> Sequence:
    return Sequence(RequestId(rid), list(range(offset, offset + n)), SamplingParams(max_tokens=100))


def test_out_of_window_blocks_are_freed_and_stay_cached():
    kv = groups()
    full, window = kv.managers
    s = seq_of(100)
    assert kv.allocate_slots(s, 64) == [[0, 1, 2, 3], [1, 2, 3, 4]]  # window block 0 is NULL
    s.num_computed_tokens = 64
    kv.commit(s)
    # The next query (64) sees keys >= 41: blocks 0 and 1 (positions < 32) are out.
    assert s.table(1) == [NULL_BLOCK, NULL_BLOCK, 3, 4] and s.block_table == [0, 1, 2, 3]
    assert window.num_free_blocks == 14 and window.num_cached_blocks == 4
    kv.allocate_slots(s, 36)
    s.num_computed_tokens = 100
    kv.commit(s)  # keys >= 77: blocks 0-3 out
    assert s.table(1) == [NULL_BLOCK] * 4 + [5, 6, 7] and len(s.block_table) == 7
    kv.free(s)
    assert window.num_free_blocks == window.num_blocks == 16 and full.num_free_blocks == 64


def test_a_prefix_hit_needs_the_window_blocks_of_its_first_query():
    kv = groups()
    a = seq_of(100)
    kv.allocate_slots(a, 100)
    a.num_computed_tokens = 100
    kv.commit(a)
    kv.free(a)
    b = seq_of(100, "b")
    hit = kv.get_computed_blocks(b)
    # 99 // 16 = 6 blocks at most; the query at 96 sees keys >= 73: window blocks 4 and 5,
    # still cached (freed, not evicted), and NULL before them.
    assert hit.num_tokens == 96
    assert hit.blocks == ([0, 1, 2, 3, 4, 5], [NULL_BLOCK] * 4 + [5, 6])
    # a's partial last blocks (no hash) went to the front of the free queues: reused first.
    assert kv.allocate_slots(b, 4, hit) == [[6], [7]]
    assert b.block_table == [0, 1, 2, 3, 4, 5, 6] and b.table(1) == [NULL_BLOCK] * 4 + [5, 6, 7]


def cache_only(manager: BlockManager, seq: Sequence, blocks: list[int]) -> None:
    """Put blocks ``blocks`` of ``seq`` (and no others) in ``manager``'s prefix cache."""
    hashes = manager.update_hashes(seq)
    ids = manager.allocate_blocks(len(blocks))
    manager.register(ids, [(hashes[i], tuple(seq.token_ids[i * B:(i + 1) * B])) for i in blocks])
    manager.unpin(ids)


def test_a_hit_is_cut_back_to_where_the_window_pool_holds_the_window():
    kv = groups()
    full, window = kv.managers
    s = seq_of(100)
    cache_only(full, s, [0, 1, 2, 3, 4, 5])
    cache_only(window, s, [3, 4])
    # Block 5 is gone, so not 96; the query at 80 sees keys >= 57: blocks 3 and 4.
    hit = kv.get_computed_blocks(s)
    assert hit.num_tokens == 80 and hit.blocks == ([0, 1, 2, 3, 4], [NULL_BLOCK] * 3 + [1, 2])
    kv2 = groups()
    cache_only(kv2.full, s, [0, 1, 2, 3, 4, 5])
    cache_only(kv2.managers[1], s, [3, 5])  # 96 needs 4 and 5; 64 needs 2 and 3; 32 needs 0 and 1
    assert kv2.get_computed_blocks(s) == PrefixHit(0, ([], []))


def test_allocation_is_all_or_nothing_across_groups():
    kv = groups(num_full=64, num_window=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    a, b = seq_of(60, "a"), seq_of(60, "b", offset=100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    # a takes all 4 window blocks; b would need one more: not admitted, nothing allocated for it.
    assert [c.request_id for c in out.chunks] == ["a"] and not any(b.block_tables)
    assert out.chunks[0].other_tables[0].new_block_ids == [1, 2, 3, 4]
    assert kv.full.num_free_blocks == 60


def test_a_short_window_pool_preempts_like_a_short_full_pool():
    kv = groups(num_full=64, num_window=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    a, b = seq_of(10, "a"), seq_of(10, "b", offset=100)
    seqs = {s.request_id: s for s in (a, b)}
    sched.add(a)
    sched.add(b)
    while a.num_computed_tokens < 32:  # both decode; each holds 2 window blocks at 16..31
        out = sched.schedule()
        sched.postprocess(out, {c.request_id: [5] for c in out.chunks if c.samples}, seqs)
    assert sched.num_preemptions == 0 and len(a.table(1)) == len(b.table(1)) == 2
    # a's token at 32 needs a third window block (blocks 0 and 1 are seen until 39): b goes.
    out = sched.schedule()
    assert [c.request_id for c in out.chunks] == ["a"] and sched.num_preemptions == 1
    assert b.block_tables == [[], []] and a.table(1) == [1, 3, 4]  # b's last block, freed first


# ----- the engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("hybrid"), "qwen2", seed=5, num_hidden_layers=3,
                               use_sliding_window=True, sliding_window=W,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])


@pytest.fixture(scope="module")
def hf(hybrid_dir):
    return transformers.Qwen2ForCausalLM.from_pretrained(hybrid_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def loaded(hybrid_dir):
    return load_model(str(hybrid_dir))


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine(loaded, **overrides) -> LLMEngine:
    args = dict(num_kv_blocks=128, max_num_seqs=2, max_num_batched_tokens=64, device="cpu") | overrides
    return LLMEngine(EngineConfig(block_size=B, **args), loaded)


def run(eng: LLMEngine, prompts: list[list[int]], max_tokens: int, check=None) -> list:
    ids = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, **GREEDY)) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if check is not None:
            check(eng)
    return [done[i] for i in ids]


def test_long_sequence_keeps_only_its_window_and_matches_transformers(loaded, hf):
    eng = engine(loaded)
    window_pool = eng.kv.managers[1]
    assert window_pool.num_blocks == num_window_blocks(W, B, 2, 64) == 12
    # One block more in each: the window pool's NULL, the full pool's discard block (a replay's).
    assert eng.runner.kv_caches[0].shape[:2] == (129, 1) and eng.runner.kv_caches[1].shape[:2] == (13, 2)
    prompt = random_prompts(1, [1000], seed=7)[0]
    seen = []

    def check(eng: LLMEngine) -> None:
        for seq in eng.scheduler.running:
            c = seq.num_computed_tokens
            held = [b for b in seq.table(1) if b != NULL_BLOCK]
            assert len(held) <= MAX_WINDOW_BLOCKS, (c, seq.table(1))
            assert len(seq.block_table) == ceil_div(c, B)
            stats = eng.stats()
            assert stats.num_used_window_blocks == len(held)
            assert stats.num_total_blocks - stats.num_free_blocks == len(seq.block_table)
            seen.append((c, len(held), len(seq.block_table)))

    out = run(eng, [prompt], 24, check)[0]
    assert out.token_ids == hf_greedy(hf, prompt, 24)
    # 16 chunks of prefill, then 23 decodes: the last finishes the request (nothing left to check).
    assert len(seen) == ceil_div(1000, 64) + 22
    assert max(n for _, n, _ in seen) == MAX_WINDOW_BLOCKS
    assert seen[-1] == (1022, 2, 64)  # 1,022 tokens' KV: 64 full-attention blocks, 2 window blocks
    assert eng.kv.num_used_blocks() == [0, 0]


def test_torch_attention_masks_the_freed_entries_exactly(loaded, hf, monkeypatch):
    """The torch path reads whole tables, freed entries too (NULL, or in the runner a stale id
    whose block now holds later positions): masked, they add exact zeros."""
    monkeypatch.setattr(kernel_select, "attention_backend", lambda device, dtype=None: "torch")
    eng = engine(loaded)
    assert eng.runner.attention_backend == "torch"
    prompt = random_prompts(1, [200], seed=12)[0]
    assert run(eng, [prompt], 16)[0].token_ids == hf_greedy(hf, prompt, 16)


def first_logprobs(eng: LLMEngine, prompt: list[int]):
    """The request's output: its first token's top-5 logprobs, its tokens and cached tokens."""
    request_id = eng.add_request(prompt, SamplingParams(max_tokens=8, logprobs=5, **GREEDY))
    while eng.has_unfinished_requests():
        done = [out for out in eng.step() if out.finished and out.request_id == request_id]
        if done:
            return done[0]


def test_prefix_hit_is_exact_and_without_its_window_replays_only_what_rebuilds_it(loaded):
    eng = engine(loaded, num_kv_blocks=256)
    prompt = random_prompts(1, [1000], seed=8)[0]
    first = first_logprobs(eng, prompt)
    again = first_logprobs(eng, prompt)
    # 999 // 16 = 62 blocks: the query at 992 sees 969..991, window blocks 60 and 61, still cached.
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 992)
    assert again.token_ids == first.token_ids
    # Other traffic cycles the 12-block window pool: the full-attention blocks survive, the
    # window's do not. Two sliding layers of W = 24: 2 * 23 = 46 tokens rebuild the window
    # exactly, from 944 (block-aligned) on; the full-attention KV there is kept, not rewritten.
    assert loaded.config.replay_tokens == 46
    run(eng, random_prompts(1, [300], seed=9), 4)
    hashes = eng.block_manager.update_hashes(seq_of_tokens(prompt))
    kept = eng.block_manager.cached_prefix(prompt, hashes)
    assert len(kept) == 62
    before = eng.runner.kv_caches[0][kept].clone()
    replayed = first_logprobs(eng, prompt)
    assert replayed.num_cached_tokens == 944 and replayed.token_ids == first.token_ids
    assert torch.equal(eng.runner.kv_caches[0][kept], before)
    for a, b in zip(replayed.logprobs[0].top, first.logprobs[0].top):
        assert a[0] == b[0] and abs(a[1] - b[1]) < 1e-5
    # The replay's window blocks hold exact KV from 992 - 23 on: the next hit is a full one.
    assert first_logprobs(eng, prompt).num_cached_tokens == 992


def test_a_replay_shorter_than_the_bound_is_not_exact(loaded):
    """The bound is needed: one sliding layer's worth (23 tokens) leaves the second sliding
    layer's window KV computed from hidden states that missed keys."""
    eng = engine(loaded, num_kv_blocks=256)
    prompt = random_prompts(1, [1000], seed=8)[0]
    first = first_logprobs(eng, prompt)
    run(eng, random_prompts(1, [300], seed=9), 4)
    eng.kv.shape = dataclasses.replace(eng.kv.shape, replay_tokens=23)
    short = first_logprobs(eng, prompt)
    assert short.num_cached_tokens == 960
    assert max(abs(a[1] - b[1]) for a, b in zip(short.logprobs[0].top, first.logprobs[0].top)) > 1e-5


def seq_of_tokens(token_ids: list[int]) -> Sequence:
    return Sequence(RequestId("probe"), token_ids, SamplingParams())


def test_preempted_hybrid_sequence_gives_the_same_tokens(loaded, hf):
    eng = engine(loaded, num_kv_blocks=30)  # 480 tokens for two 200-token prompts and 48 outputs each
    prompts = random_prompts(2, [200, 200], seed=10)
    outs = run(eng, prompts, 48)
    assert eng.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 48)
    assert eng.kv.num_used_blocks() == [0, 0]


def test_speculative_decoding_on_a_hybrid_model_gives_the_greedy_tokens(loaded, hf):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2})
    eng = engine(loaded, speculative_config=spec)
    segment = random_prompts(1, [40], seed=11)[0]
    prompt = segment * 5  # repeats for the n-gram drafter to find
    out = run(eng, [prompt], 40, lambda e: [_check_window(s) for s in e.scheduler.running])[0]
    assert eng.num_draft_tokens > 0
    assert out.token_ids == hf_greedy(hf, prompt, 40)
    assert eng.kv.num_used_blocks() == [0, 0]


def _check_window(seq: Sequence) -> None:
    assert len([b for b in seq.table(1) if b != NULL_BLOCK]) <= MAX_WINDOW_BLOCKS


def test_hand_over_moves_the_window_too_and_decode_continues_exactly(loaded, hf):
    """Prefill -> decode between two engines, blocks copied as the transfer engine would: the
    full-attention blocks of the prompt and the window blocks its next query sees."""
    from tests.unit.engine.test_handoff import run as run_to_end

    prefill, decode = engine(loaded, num_kv_blocks=128), engine(loaded, num_kv_blocks=128)
    for i, length in enumerate([5, 40, 300, 999]):
        prompt = random_prompts(1, [length], seed=20 + i)[0]
        params = SamplingParams(max_tokens=16, **GREEDY)
        rid = f"h{i}"
        prefill.add_request(prompt, params, rid)
        while not [o for o in prefill.step() if o.request_id == rid]:
            pass
        handoff = prefill.detach(rid)
        first = prefill.kv.managers[1].num_out_of_window(length)
        assert len(handoff.block_ids) == ceil_div(length, B)
        assert len(handoff.window_block_ids) == ceil_div(length, B) - first <= MAX_WINDOW_BLOCKS
        decode.add_request(prompt, params, rid, output_token_ids=handoff.output_token_ids, hold_for_kv=True)
        reservation = decode.reserve_kv(rid)
        assert len(reservation.window_block_ids) == len(handoff.window_block_ids)
        pairs = [(0, s, d) for s, d in list(zip(handoff.block_ids, reservation.block_ids))[reservation.num_local_blocks:]]
        pairs += [(1, s, d) for s, d in zip(handoff.window_block_ids, reservation.window_block_ids)]
        for group, src, dst in pairs:
            decode.prefix.block_buffer(dst, group).copy_(prefill.prefix.block_buffer(src, group))
        decode.commit_kv(rid, handoff.num_cached_tokens)
        prefill.release_handoff(handoff)
        assert run_to_end(decode)[rid].token_ids == hf_greedy(hf, prompt, 16), length
    assert prefill.kv.num_used_blocks() == decode.kv.num_used_blocks() == [0, 0]


def test_a_prefix_from_elsewhere_is_full_attention_blocks_and_a_replay(loaded):
    """What the KV store moves for a hybrid model: full-attention blocks only. Imported into
    another engine they are a hit without the windows: a bounded replay, same tokens."""
    source, target = engine(loaded, num_kv_blocks=256), engine(loaded, num_kv_blocks=256)
    prompt = random_prompts(1, [1000], seed=8)[0]
    cold = first_logprobs(source, prompt)
    export = source.prefix.export_kv(prompt)
    assert len(export.blocks) == 62 and export.blocks[0].data.shape[0] == 1  # the one full-attention layer
    assert target.prefix.import_kv(export.blocks) == 62
    source.prefix.release(export)
    replayed = first_logprobs(target, prompt)
    assert replayed.num_cached_tokens == 944 and replayed.token_ids == cold.token_ids
    assert source.kv.num_used_blocks() == target.kv.num_used_blocks() == [0, 0]
