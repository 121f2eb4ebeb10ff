"""Paged KV block accounting with local prefix caching. Torch-free.

Every block is in exactly one of three states::

    in use     ref_count > 0             owned by running sequences (shared when a prefix hits)
    cached     ref_count == 0, hashed    in the free queue, still findable by hash until reused
    empty      ref_count == 0, no hash   in the free queue

The free queue is in LRU order: a freed block goes to the back, an allocation takes the front,
so cached blocks live as long as possible and the least recently used prefix is evicted first.
A sequence frees its blocks tail first, so its last (least shareable) block is evicted before
its first. "No room" is a ``None`` return (STYLE rule 4); running out is never an exception.

A manager keeps one KV group's pool (``group``; kv_groups.py): every layer's for a plain model,
or a hybrid model's full-attention layers'. :class:`SlidingWindowBlockManager` keeps the
sliding-window layers' pool, freeing each sequence's blocks as they fall out of the window.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvstore.hashing import BlockHash, block_hashes
from services.engine.sequence import BlockId, Sequence


@dataclass
class Block:
    block_id: BlockId
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    """The block's tokens, kept to reject a (practically impossible) hash collision."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, root: BlockHash,
                 enable_prefix_caching: bool = True, group: int = 0) -> None:
        assert num_blocks > 0 and block_size > 0
        self.group = group
        """The KV group whose block tables (``seq.table(group)``) and pool this manager keeps."""
        self.block_size = block_size
        self.root = root
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(BlockId(i)) for i in range(num_blocks)]
        self._free: OrderedDict[BlockId, None] = OrderedDict((BlockId(i), None) for i in range(num_blocks))
        self._cached: dict[BlockHash, BlockId] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----- hashing -----------------------------------------------------------------------
    def update_hashes(self, seq: Sequence) -> list[BlockHash]:
        """Extend ``seq.block_hashes`` to cover every full block of its tokens."""
        start = len(seq.block_hashes)
        if (len(seq) // self.block_size) > start:
            parent = seq.block_hashes[-1] if start else None
            seq.block_hashes.extend(block_hashes(seq.token_ids, self.block_size, seq.root or self.root,
                                                 seq.block_extra_keys(self.block_size),
                                                 start=start, parent=parent))
        return seq.block_hashes

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> BlockId | None:
        block_id = self._cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    # ----- allocation --------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> list[BlockId]:
        """The cached blocks that cover the longest prefix of a not-yet-admitted sequence.

        At least one token is left to compute, so the step that finishes the prefill has a
        position to sample from.
        """
        assert not seq.table(self.group), "only for sequences that hold no blocks"
        if not self.enable_prefix_caching:
            return []
        max_hit_blocks = (len(seq) - 1) // self.block_size
        return self.cached_prefix(seq.token_ids, self.update_hashes(seq)[:max_hit_blocks])

    def cached_prefix(self, token_ids: list[int], hashes: list[BlockHash]) -> list[BlockId]:
        """Cached blocks for the leading ``hashes`` (of ``token_ids``' full blocks), up to the first miss."""
        bs = self.block_size
        hits: list[BlockId] = []
        for i, h in enumerate(hashes):
            block_id = self.lookup(h, tuple(token_ids[i * bs:(i + 1) * bs]))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[BlockId] = ()) -> list[BlockId] | None:
        """Make the block table cover ``num_computed_tokens + num_new_tokens`` tokens.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, admission only) join the table
        first. Returns the newly allocated block ids, or None — changing nothing — if the free
        queue cannot supply them.
        """
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            return None
        table = seq.table(self.group)
        num_new_blocks = self._num_new_blocks(seq, num_new_tokens, computed_blocks)
        for block_id in computed_blocks:
            self._touch(block_id)
        table.extend(computed_blocks)
        new_blocks = [self._take_free() for _ in range(max(num_new_blocks, 0))]
        table.extend(new_blocks)
        return new_blocks

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[BlockId] = ()) -> bool:
        """Whether :meth:`allocate_slots` would succeed (KVGroups asks every group first)."""
        # Touching a cached-but-free hit removes it from the free queue too.
        num_free_hits = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        return self._num_new_blocks(seq, num_new_tokens, computed_blocks) <= self.num_free_blocks - num_free_hits

    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[BlockId]) -> int:
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens)
        return num_needed - len(seq.table(self.group)) - len(computed_blocks)

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.table(self.group)):
            self._release(block_id)
        seq.block_tables[self.group] = []

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past what ``seq``'s tokens need (the slots of rejected drafts)."""
        num_needed = self.num_blocks_for(len(seq))
        table = seq.table(self.group)
        while len(table) > num_needed:
            self._release(table.pop())

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every full, computed block of ``seq`` in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = self.update_hashes(seq)
        table = seq.table(self.group)
        for i in range(min(seq.num_computed_tokens // bs, len(hashes))):
            block = self.blocks[table[i]]
            if block.block_hash is None:
                self._register(block, hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]))

    # ----- the disaggregation seam -----------------------------------------------------
    def pin(self, block_ids: list[BlockId]) -> None:
        """Hold blocks (e.g. while another engine reads them) so they cannot be evicted."""
        for block_id in block_ids:
            self._touch(block_id)

    def unpin(self, block_ids: list[BlockId]) -> None:
        for block_id in reversed(block_ids):
            self._release(block_id)

    def allocate_blocks(self, num_blocks: int) -> list[BlockId] | None:
        """Empty blocks, pinned, for KV that arrives before it may be found (see
        :meth:`register`); None if the free queue cannot supply them."""
        if num_blocks > self.num_free_blocks:
            return None
        return [self._take_free() for _ in range(num_blocks)]

    def register(self, block_ids: list[BlockId], entries: list[tuple[BlockHash, tuple[int, ...]]]) -> None:
        """The blocks now hold these hashes' KV: make them findable by the prefix cache."""
        for block_id, (block_hash, token_ids) in zip(block_ids, entries, strict=True):
            self._register(self.blocks[block_id], block_hash, token_ids)

    def allocate_cached(self, entries: list[tuple[BlockHash, tuple[int, ...]]]) -> list[BlockId | None] | None:
        """Reserve blocks for imported KV, pinned until the caller has written and unpinned them.

        Returns one entry per input: a new block id to fill, or None where the hash is
        already cached here. None overall if there is no room for the missing ones.
        """
        missing = [self._cached.get(h) is None for h, _ in entries]
        if sum(missing) > self.num_free_blocks:
            return None
        out: list[BlockId | None] = []
        for (block_hash, token_ids), is_missing in zip(entries, missing):
            if not is_missing:
                out.append(None)
                continue
            block_id = self._take_free()
            self._register(self.blocks[block_id], block_hash, token_ids)
            out.append(block_id)
        return out

    # ----- internals ---------------------------------------------------------------------
    def _register(self, block: Block, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        if block_hash in self._cached:
            return  # another block already holds this content; keep the first
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._cached[block_hash] = block.block_id

    def _take_free(self) -> BlockId:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict the cached content
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def _touch(self, block_id: BlockId) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _release(self, block_id: BlockId) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is None:
                # Nothing to keep: reuse it before any cached block.
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)
            else:
                self._free[block_id] = None


NULL_BLOCK = BlockId(0)
"""A sliding-window pool's block 0, never handed out: the table entry of a block that fell out
of the window (no kernel reads a position before a query's window; see attention.py)."""


class SlidingWindowBlockManager(BlockManager):
    """Block accounting for sliding-window layers: a sequence keeps only what a query can still see.

    After a step with ``c = num_computed_tokens`` the next query is at position >= c and sees the
    keys >= c - W + 1, so block i (positions [iB, (i + 1)B)) goes once (i + 1) * B <= c - W + 1::

        position   0       B      2B      3B      4B      5B
        table     [ NULL  | NULL  |  b7   |  b2   |  b9   ]     c - W + 1 falls in block 2
                   freed, never read   kept: the window and the chunk being computed

    Freed entries stay in the table as :data:`NULL_BLOCK` (block i stays entry i); a freed block
    that carries a hash goes to the free queue still cached, like a finished sequence's. So a
    sequence holds about ceil((W - 1) / B) + 1 blocks here however long it grows.
    """

    def __init__(self, num_blocks: int, block_size: int, root: BlockHash, window: int,
                 enable_prefix_caching: bool = True, group: int = 1) -> None:
        super().__init__(num_blocks + 1, block_size, root, enable_prefix_caching, group)
        assert window > 0
        self.window = window
        del self._free[NULL_BLOCK]
        self.blocks[NULL_BLOCK].ref_count = 1  # held for good: never evicted, never handed out

    @property
    def num_blocks(self) -> int:
        """Blocks sequences can hold (the pool has one more: the NULL block)."""
        return len(self.blocks) - 1

    def num_out_of_window(self, num_computed: int) -> int:
        """Leading blocks that no query at position ``num_computed`` or later sees."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def free_out_of_window(self, seq: Sequence) -> int:
        """Free the blocks that fell out of the window (newest first, back to the last freed);
        returns how many."""
        table = seq.table(self.group)
        i = min(self.num_out_of_window(seq.num_computed_tokens), len(table)) - 1
        num_freed = 0
        while i >= 0 and table[i] != NULL_BLOCK:
            self._release(table[i])
            table[i] = NULL_BLOCK
            i -= 1
            num_freed += 1
        return num_freed

    def get_computed_blocks(self, seq: Sequence) -> list[BlockId]:
        assert not seq.table(self.group), "only for sequences that hold no blocks"
        return self.window_hits(seq, (len(seq) - 1) // self.block_size)

    def window_hits(self, seq: Sequence, max_blocks: int) -> list[BlockId]:
        """The table a prefix hit starts with: for the longest k <= ``max_blocks`` whose window
        blocks (those the query at position kB sees) are all cached, NULL_BLOCK before them and
        them after; [] for no hit. Each block is looked up at most once: a miss at block i rules
        out every k > i, and the next candidate, k = i, needs only blocks before i."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hashes = self.update_hashes(seq)
        k = max_blocks
        while k > 0:
            first = self.num_out_of_window(k * bs)
            hits: list[BlockId] = []
            for i in range(k - 1, first - 1, -1):
                block_id = self.lookup(hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]))
                if block_id is None:
                    k = i
                    break
                hits.append(block_id)
            else:
                return [NULL_BLOCK] * first + hits[::-1]
        return []

    def cache_full_blocks(self, seq: Sequence) -> None:
        """As the base class, over the blocks still held (the rest were registered before they
        were freed), so the cost stays that of the window however long the sequence."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = self.update_hashes(seq)
        table = seq.table(self.group)
        # A bounded replay's first blocks hold inexact KV: a query there missed the keys before
        # the replay start, and passed that on. From replay_until - W + 1 on it is exact, and a
        # block with any exact position is safe to find: a window at a block boundary that
        # reads its inexact positions also reads the block before it, never registered.
        exact_from = seq.replay_until - self.window + 1
        for i in range(min(seq.num_computed_tokens // bs, len(hashes)) - 1, -1, -1):
            if table[i] == NULL_BLOCK or (i + 1) * bs <= exact_from:
                break
            block = self.blocks[table[i]]
            if block.block_hash is None:
                self._register(block, hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]))

    def _touch(self, block_id: BlockId) -> None:
        if block_id != NULL_BLOCK:
            super()._touch(block_id)

    def _release(self, block_id: BlockId) -> None:
        if block_id != NULL_BLOCK:
            super()._release(block_id)
