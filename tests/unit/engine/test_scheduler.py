"""Scheduling decisions with exact chunks and block ids (torch-free)."""

from pathlib import Path

from kvstore.hashing import root_hash
from services.common.sampling_params import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.scheduler import Scheduler
from services.engine.sequence import FinishReason, RequestId, Sequence, SequenceStatus

ROOT = root_hash(model="t", block_size=4, dtype="float32")


def make(num_blocks=16, budget=8, max_seqs=4, max_len=64):
    bm = BlockManager(num_blocks, 4, ROOT)
    return Scheduler(bm, max_seqs, budget, max_len, eos_token_ids=(2,)), bm


def add(sched, rid, n, **params):
    s = Sequence(RequestId(rid), list(range(10, 10 + n)), SamplingParams(**params))
    sched.add(s)
    return s


def run_step(sched, seqs, token=5):
    out = sched.schedule()
    sampled = {c.request_id: [token] for c in out.chunks if c.samples}
    sched.postprocess(out, sampled, {s.request_id: s for s in seqs})
    return out


def test_scheduler_imports_no_torch():
    import services.engine.block_manager as bm
    import services.engine.scheduler as sc
    import services.engine.scheduler_output as so
    import services.engine.sequence as sq
    for mod in (sc, so, bm, sq):
        assert "torch" not in Path(mod.__file__).read_text()


def test_chunked_prefill_under_budget_then_decode():
    sched, _ = make(budget=8)
    a = add(sched, "a", 20, max_tokens=3)
    out = run_step(sched, [a])
    assert [(c.start_position, len(c.token_ids), c.samples) for c in out.chunks] == [(0, 8, False)]
    out = run_step(sched, [a])
    assert [(c.start_position, len(c.token_ids), c.samples) for c in out.chunks] == [(8, 8, False)]
    out = run_step(sched, [a])
    assert [(c.start_position, len(c.token_ids), c.samples) for c in out.chunks] == [(16, 4, True)]
    out = run_step(sched, [a])
    assert [(c.start_position, len(c.token_ids)) for c in out.chunks] == [(20, 1)]
    assert a.output_token_ids == [5, 5]


def test_decodes_go_first_and_new_prefills_share_the_budget():
    sched, _ = make(budget=8)
    a = add(sched, "a", 4, max_tokens=5)
    run_step(sched, [a])
    b = add(sched, "b", 20, max_tokens=5)
    out = run_step(sched, [a, b])
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 7)]


def test_finish_on_eos_max_tokens_and_stop_token_frees_blocks():
    sched, bm = make(budget=16)
    a = add(sched, "a", 4, max_tokens=10)
    b = add(sched, "b", 4, max_tokens=1)
    c = add(sched, "c", 4, max_tokens=10, stop_token_ids=[5])
    seqs = [a, b, c]
    out = sched.schedule()
    sched.postprocess(out, {"a": [2], "b": [7], "c": [5]}, {s.request_id: s for s in seqs})
    assert [s.finish_reason.value for s in seqs] == ["stop", "length", "stop"]
    assert c.stop_reason == 5
    assert bm.num_free_blocks == bm.num_blocks
    assert not sched.has_unfinished
    assert sorted(sched.schedule().finished_request_ids) == ["a", "b", "c"]


def test_min_tokens_ignores_eos_until_reached():
    sched, _ = make()
    a = add(sched, "a", 4, max_tokens=10, min_tokens=2)
    run_step(sched, [a], token=2)
    assert not a.is_finished
    run_step(sched, [a], token=2)
    assert a.finish_reason.value == "stop"


def test_preemption_by_recompute_when_blocks_run_out():
    sched, bm = make(num_blocks=4, budget=16)
    a = add(sched, "a", 8, max_tokens=20)
    b = add(sched, "b", 7, max_tokens=20)
    run_step(sched, [a, b])  # a: 2 blocks, b: 2 blocks; pool full
    assert bm.num_free_blocks == 0
    run_step(sched, [a, b])  # b grows to 8 tokens (fits), a needs a 3rd block: b is preempted
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.num_preemptions == 1 and sched.waiting[0] is b
    assert len(a.block_table) == 3
    sched.finish(a, FinishReason.ABORT)
    out = run_step(sched, [a, b])  # b comes back; its first block is a prefix-cache hit
    assert [(c.request_id, c.start_position) for c in out.chunks] == [("b", 4)]
    sched.finish(b, FinishReason.ABORT)
    assert bm.num_free_blocks == 4


def test_nothing_to_do_is_none():
    sched, _ = make()
    assert sched.schedule() is None


def test_max_num_seqs_limits_admission():
    sched, _ = make(max_seqs=2, budget=64)
    seqs = [add(sched, str(i), 4) for i in range(3)]
    out = run_step(sched, seqs)
    assert [c.request_id for c in out.chunks] == ["0", "1"]


def test_a_chunk_carries_only_what_changed_and_the_runners_copy_stays_exact():
    """What the runner rebuilds from the chunks (a request's tokens and block table) equals the
    sequence after every step, through a preemption; a decode's chunk holds O(1) of it."""
    sched, bm = make(num_blocks=6, budget=16)
    seqs = [add(sched, "a", 9, max_tokens=12), add(sched, "b", 7, max_tokens=12)]
    copies: dict[str, tuple[list[int], list[int]]] = {}
    for _ in range(60):
        out = sched.schedule()
        if out is None:
            break
        for c in out.chunks:
            seq = next(s for s in seqs if s.request_id == c.request_id)
            if c.new_request is not None:
                copies[c.request_id] = ([*c.new_request.prompt_token_ids, *c.new_request.output_token_ids], [])
            tokens, table = copies[c.request_id]
            tokens += c.new_token_ids
            del table[c.num_kept_blocks:]
            table += c.new_block_ids
            assert (tokens, table) == (seq.token_ids, seq.block_table)
            if c.new_request is None and len(c.token_ids) == 1:
                assert len(c.new_token_ids) == 1 and len(c.new_block_ids) <= 1
        sched.postprocess(out, {c.request_id: [5] for c in out.chunks if c.samples},
                          {s.request_id: s for s in seqs})
    assert sum(s.num_preemptions for s in seqs) >= 1
    assert all(s.is_finished for s in seqs) and bm.num_free_blocks == 6
