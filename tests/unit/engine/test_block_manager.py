"""Block pool accounting with exact block ids (torch-free)."""

from kvstore.hashing import root_hash
from services.common.sampling_params import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.sequence import RequestId, Sequence

ROOT = root_hash(model="t", block_size=4, dtype="float32")


def seq(tokens, rid="r"):
    return Sequence(RequestId(rid), list(tokens), SamplingParams())


def finish_prefill(bm, s):
    s.num_computed_tokens = len(s)
    bm.cache_full_blocks(s)


def prefilled(bm, tokens, rid="a"):
    """A sequence whose prompt is computed and whose full blocks are in the prefix cache."""
    s = seq(tokens, rid)
    bm.allocate_slots(s, len(s))
    finish_prefill(bm, s)
    return s


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, 4, ROOT)
    s = seq(range(10))
    assert bm.allocate_slots(s, 10) == [0, 1, 2]
    assert s.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_no_room_is_none_and_changes_nothing():
    bm = BlockManager(2, 4, ROOT)
    s = seq(range(9))
    assert bm.allocate_slots(s, 9) is None
    assert bm.num_free_blocks == 2 and s.block_table == []


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(8, 4, ROOT)
    a = seq(range(12), "a")
    bm.allocate_slots(a, 12)
    finish_prefill(bm, a)
    assert bm.num_cached_blocks == 3
    b = seq(range(12), "b")
    hits = bm.get_computed_blocks(b)
    assert hits == [0, 1]  # the third block would leave nothing to compute
    assert bm.allocate_slots(b, 4, hits) == [3]
    assert b.block_table == [0, 1, 3]
    assert bm.blocks[0].ref_count == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_freed_cached_blocks_are_reused_lru_tail_first():
    bm = BlockManager(4, 4, ROOT)
    a = seq(range(8), "a")
    bm.allocate_slots(a, 8)
    finish_prefill(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 2
    # A cached hit after free: the blocks come back from the free queue.
    b = seq(list(range(8)) + [99], "b")
    hits = bm.get_computed_blocks(b)
    assert hits == [0, 1]
    bm.allocate_slots(b, 1, hits)
    bm.free(b)
    # Empty blocks are taken first, then the least recently freed cached one: the tail (1).
    c = seq([50] * 12, "c")
    assert bm.allocate_slots(c, 12) == [2, 3, 1]
    assert bm.num_cached_blocks == 1
    bm.free(c)


def test_different_tokens_never_hit():
    bm = BlockManager(8, 4, ROOT)
    a = prefilled(bm, range(9))
    assert bm.get_computed_blocks(seq([7] + list(range(1, 9)), "b")) == []
    bm.free(a)


def test_pin_keeps_blocks_out_of_the_free_queue():
    bm = BlockManager(4, 4, ROOT)
    bm.free(prefilled(bm, range(8)))
    bm.pin([0, 1])
    assert bm.num_free_blocks == 2
    bm.unpin([0, 1])
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2


def test_allocate_cached_skips_known_hashes():
    bm = BlockManager(4, 4, ROOT)
    a = prefilled(bm, range(8))
    entries = [(a.block_hashes[0], (0, 1, 2, 3)), (b"\x01" * 32, (9, 9, 9, 9))]
    slots = bm.allocate_cached(entries)
    assert slots == [None, 2]
    bm.unpin([2])
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 3
