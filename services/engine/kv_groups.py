"""One interface over a model's KV groups, for the scheduler. Torch-free.

A plain model's KV is one group: every layer's KV of a block lies in one pool, one block table
per sequence. A hybrid model (sliding-window layers between full-attention ones, see
``ModelConfig.kv_groups``) has two, as vLLM's hybrid KV cache manager has::

    group 0  full-attention layers   BlockManager                every block of the sequence
    group 1  sliding-window layers   SlidingWindowBlockManager   the window's blocks and the chunk's

Each group has its own pool, block ids, free queue and prefix cache, and each sequence one table
per group (``Sequence.block_tables``); the hashes are shared (same tokens, same chain). Every
operation here is all or nothing across the groups: a sequence gets its slots in every group or
in none (the scheduler then preempts, whichever group ran short), and is freed and trimmed in all.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.hit_rule import ModelKVShape, hit_tokens

from services.engine.block_manager import NULL_BLOCK, BlockManager, SlidingWindowBlockManager
from services.engine.sequence import BlockId, Sequence


@dataclass(frozen=True)
class PrefixHit:
    """A waiting sequence's usable prefix-cache hit: its first ``num_tokens`` tokens' KV is
    there in every group; ``blocks`` is the table each group starts with.

    A bounded replay (``replay_until`` > 0): the full-attention group's blocks cover
    [0, replay_until) but the sliding windows ending there are gone, so the sequence restarts
    at ``num_tokens`` = replay_until - ModelConfig.replay_tokens (rounded down to a block),
    recomputing those positions only to rebuild the windows' KV exactly."""

    num_tokens: int
    blocks: tuple[list[BlockId], ...]
    replay_until: int = 0


def num_window_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Size of a sliding-window pool that never runs short before the full-attention one.

    A sequence at ``c`` computed tokens that computes ``n`` more holds the blocks of positions
    [c - W + 1, c + n): at most 1 + ceil((W - 1) / B) + ceil(n / B) blocks (the first may start
    mid-block). A step has at most ``max_num_seqs`` sequences and ``max_num_batched_tokens`` new
    tokens (drafts included), and sum(ceil(n / B)) <= ceil(T / B) + S, so::

        S * (ceil((W - 1) / B) + 2) + ceil(T / B)

    The rest of the KV memory goes to the full-attention pool, where long contexts live.
    """
    per_seq = -(-(window - 1) // block_size) + 2
    return max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)


class KVGroups:
    def __init__(self, managers: list[BlockManager], replay_tokens: int = 0) -> None:
        """``replay_tokens``: ModelConfig.replay_tokens, 0 for no bounded replay."""
        assert [m.group for m in managers] == list(range(len(managers))), "one manager per group, in order"
        assert 1 <= len(managers) <= 2 and not isinstance(managers[0], SlidingWindowBlockManager)
        self.managers = managers
        self.block_size = managers[0].block_size
        self._windows = [m for m in managers if isinstance(m, SlidingWindowBlockManager)]
        self.shape = ModelKVShape(self._windows[0].window if self._windows else None, replay_tokens)
        """What the hit rule (kvstore/hit_rule.py) needs to know of the model."""

    @property
    def full(self) -> BlockManager:
        """Group 0's manager: every layer's blocks, or a hybrid model's full-attention layers'."""
        return self.managers[0]

    def get_computed_blocks(self, seq: Sequence) -> PrefixHit:
        """The longest block-aligned prefix L usable in every group: the full group holds blocks
        [0, L) and the window group those the query at L sees, [L - W + 1, L). At least one
        token is left to compute (BlockManager.get_computed_blocks).

        Where the full group holds more, up to L1, than any window allows, the hit rule
        (kvstore/hit_rule.py) restarts at L1 - replay_tokens: taken when later than L."""
        full_hits = self.full.get_computed_blocks(seq)
        if not self._windows:
            return PrefixHit(len(full_hits) * self.block_size, (full_hits,))
        bs = self.block_size
        window_table = self._windows[0].window_hits(seq, len(full_hits))
        num_blocks = len(window_table)
        l1 = len(full_hits) * bs
        start = hit_tokens(len(seq), bs, len(full_hits), self.shape, lambda end: end == num_blocks * bs)
        if start < l1 and start > num_blocks * bs:
            return PrefixHit(start, (full_hits, [NULL_BLOCK] * (start // bs)), l1)
        return PrefixHit(num_blocks * bs, (full_hits[:num_blocks], window_table))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       hit: PrefixHit | None = None) -> list[list[BlockId]] | None:
        """Every group's table covers ``num_computed_tokens + num_new_tokens`` tokens (``hit``'s
        blocks first, admission only); the new block ids per group, or None, changing nothing,
        when any group cannot supply them."""
        computed = hit.blocks if hit is not None else ((),) * len(self.managers)
        if len(self.managers) == 1:
            new = self.full.allocate_slots(seq, num_new_tokens, computed[0])
            return None if new is None else [new]
        # A replay's full-attention blocks reach past its start: new ones only past them.
        replayed = hit.replay_until - hit.num_tokens if hit is not None and hit.replay_until else 0
        num_new = [max(0, num_new_tokens - replayed), num_new_tokens]
        if not all(m.can_allocate(seq, n, c) for m, n, c in zip(self.managers, num_new, computed)):
            return None
        return [m.allocate_slots(seq, n, c) for m, n, c in zip(self.managers, num_new, computed)]

    def free(self, seq: Sequence) -> None:
        for m in self.managers:
            m.free(seq)

    def trim(self, seq: Sequence) -> None:
        """Give back every group's blocks past ``seq``'s tokens (rejected drafts' slots)."""
        for m in self.managers:
            m.trim(seq)

    def commit(self, seq: Sequence) -> None:
        """After a step computed more of ``seq``: register its full blocks in every group's
        prefix cache, then free the window blocks no later query sees (registered first, so
        they stay findable until evicted)."""
        for m in self.managers:
            m.cache_full_blocks(seq)
        for m in self._windows:
            m.free_out_of_window(seq)

    def num_used_blocks(self) -> list[int]:
        """Per group, blocks held by sequences (or pinned)."""
        return [m.num_blocks - m.num_free_blocks for m in self.managers]
