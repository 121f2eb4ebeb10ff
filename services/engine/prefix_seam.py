"""The prefix half of the engine's disaggregation seam: full blocks of KV by hash, between this
engine's pool and other engines or the KV store. The request half (a prompt's blocks handed over
with its request: detach, reserve_kv, commit_kv) is the engine's own (engine.py).

    prompt_hashes   a prompt's block hashes and how many lead in the local prefix cache
    reserve_prefix  blocks for a prompt's first n blocks (local hits pinned), filled from elsewhere,
    fill_prefix     then made findable; every reserved block unpinned
    export_kv       the cached full blocks of a prompt, pinned until release
    import_kv       blocks copied into the pool and its prefix cache
    block_buffer    one block's bytes, what a transfer reads or writes

A hybrid model's sliding windows (the SWA tier, serving/swa_tier.py) by the position they end at:

    window_positions  the blocks of the window that the query at ``end`` sees
    export_window     those blocks, pinned in the window pool until release_window; None if any
                      was evicted
    reserve_window    window-pool blocks for a window arriving from elsewhere, then
    fill_window       made findable (when it arrived) and unpinned
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Sequence_

import torch

from kvstore.hashing import BlockHash, block_hashes
from services.common.sampling_params import SamplingParams
from services.engine.block_manager import BlockManager, SlidingWindowBlockManager
from services.engine.model_runner import ModelRunner
from services.engine.seams import KVBlock, KVExport, KVReservation
from services.engine.sequence import BlockId, MultiModalInput, RequestId, Sequence


class PrefixSeam:
    def __init__(self, block_manager: BlockManager, runner: ModelRunner, root_for: Callable[[str], BlockHash],
                 window_manager: SlidingWindowBlockManager | None = None) -> None:
        """``block_manager``: the pool's (a hybrid model's full-attention pool: its prefixes are
        full-attention blocks only; a hit without the sliding windows is a bounded replay,
        kv_groups.PrefixHit); ``window_manager``: a hybrid model's window pool; ``root_for``: the
        first block's parent hash for a cache salt."""
        self.block_manager = block_manager
        self.runner = runner
        self.root_for = root_for
        self.window_manager = window_manager

    def block_buffer(self, block_id: BlockId, group: int = 0) -> torch.Tensor:
        """One block's KV bytes in a group's pool (contiguous), what a transfer reads or writes."""
        return self.runner.block_view(block_id, group).view(torch.uint8).view(-1)

    def prompt_hashes(self, token_ids: list[int], mm_inputs: Sequence_[MultiModalInput] = (),
                      cache_salt: str = "") -> tuple[list[BlockHash], int]:
        """The hashes of a token sequence's full blocks, exactly as a request would have them,
        and how many leading ones this engine's prefix cache holds."""
        seq = Sequence(RequestId("probe"), list(token_ids), SamplingParams(), mm_inputs=tuple(mm_inputs),
                       root=self.root_for(cache_salt))
        hashes = self.block_manager.update_hashes(seq)
        return hashes, len(self.block_manager.cached_prefix(seq.token_ids, hashes))

    def reserve_prefix(self, token_ids: list[int], hashes: list[BlockHash], num_blocks: int) -> KVReservation | None:
        """Blocks for the first ``num_blocks`` blocks of a prompt whose KV will be read in
        (e.g. from the KV store): local prefix hits first, pinned so nothing evicts them
        meanwhile. Give them back with :meth:`fill_prefix`; None: no room now."""
        bm = self.block_manager
        local = bm.cached_prefix(token_ids, hashes[:num_blocks])
        bm.pin(local)
        new = bm.allocate_blocks(num_blocks - len(local))
        if new is None:
            bm.unpin(local)
            return None
        return KVReservation(local + new, len(local))

    def fill_prefix(self, reservation: KVReservation, token_ids: list[int], hashes: list[BlockHash],
                    filled: Sequence_[int]) -> None:
        """Blocks ``filled`` (positions in the prompt, each past the reservation's local hits)
        now hold their KV: the prefix cache finds them from now on. Every reserved block is
        unpinned. A block's KV depends only on the tokens its hash chains over, so a filled
        block is right under its hash even when an earlier one did not arrive."""
        bs, first = self.block_manager.block_size, reservation.num_local_blocks
        assert all(first <= i < len(reservation.block_ids) for i in filled), (filled, first)
        self.block_manager.register([reservation.block_ids[i] for i in filled],
                                    [(hashes[i], tuple(token_ids[i * bs:(i + 1) * bs])) for i in filled])
        self.block_manager.unpin(reservation.block_ids)
        reservation.block_ids = []

    def export_kv(self, token_ids: list[int], hashes: list[BlockHash] | None = None) -> KVExport:
        """Pin and expose the cached full blocks covering the longest prefix of ``token_ids``
        (``hashes``: theirs from :meth:`prompt_hashes`; default: unsalted, without images)."""
        bm = self.block_manager
        bs = bm.block_size
        hashes = block_hashes(token_ids, bs, self.root_for("")) if hashes is None else hashes
        ids = bm.cached_prefix(token_ids, hashes)
        bm.pin(ids)
        blocks = [KVBlock(hashes[i], tuple(token_ids[i * bs:(i + 1) * bs]), self.runner.block_view(block_id))
                  for i, block_id in enumerate(ids)]
        return KVExport(blocks, ids)

    def release(self, export: KVExport) -> None:
        self.block_manager.unpin(export.block_ids)
        export.block_ids = []

    def import_kv(self, blocks: list[KVBlock]) -> int | None:
        """Copy blocks into this engine's pool and prefix cache; None if there is no room."""
        slots = self.block_manager.allocate_cached([(b.block_hash, b.token_ids) for b in blocks])
        if slots is None:
            return None
        written = [(b, s) for b, s in zip(blocks, slots) if s is not None]
        for block, block_id in written:
            self.runner.write_block(block_id, block.data)
        self.block_manager.unpin([s for _, s in written])
        return len(written)

    # ----- a hybrid model's sliding windows --------------------------------------------------
    def window_positions(self, end: int) -> range:
        """Blocks of a prompt whose window-pool KV the query at ``end`` (block-aligned) sees."""
        return range(self.window_manager.num_out_of_window(end), end // self.block_manager.block_size)

    def _cached_window(self, token_ids: list[int], hashes: list[BlockHash], end: int) -> list[BlockId] | None:
        bs, window = self.block_manager.block_size, self.window_manager
        found = [window.lookup(hashes[i], tuple(token_ids[i * bs:(i + 1) * bs])) for i in self.window_positions(end)]
        return None if None in found else found

    def has_window(self, token_ids: list[int], hashes: list[BlockHash], end: int) -> bool:
        return self._cached_window(token_ids, hashes, end) is not None

    def export_window(self, token_ids: list[int], hashes: list[BlockHash], end: int) -> KVExport | None:
        """Pin and expose the window pool's blocks of the window ending at ``end``; None (nothing
        pinned) when one of them is no longer cached."""
        ids = self._cached_window(token_ids, hashes, end)
        if ids is None:
            return None
        self.window_manager.pin(ids)
        bs = self.block_manager.block_size
        return KVExport([KVBlock(hashes[i], tuple(token_ids[i * bs:(i + 1) * bs]), self.runner.block_view(b, 1))
                         for i, b in zip(self.window_positions(end), ids)], ids)

    def release_window(self, export: KVExport) -> None:
        self.window_manager.unpin(export.block_ids)
        export.block_ids = []

    def reserve_window(self, end: int) -> KVReservation | None:
        """Window-pool blocks, pinned, for the window ending at ``end`` (its ``window_block_ids``);
        None: no room now."""
        ids = self.window_manager.allocate_blocks(len(self.window_positions(end)))
        return None if ids is None else KVReservation([], 0, ids)

    def fill_window(self, reservation: KVReservation, token_ids: list[int], hashes: list[BlockHash], end: int,
                    arrived: bool) -> None:
        """The reserved window blocks hold the window's KV (``arrived``): the prefix cache finds
        them from now on; either way every one is unpinned."""
        ids, bs = reservation.window_block_ids, self.block_manager.block_size
        if arrived:
            self.window_manager.register(ids, [(hashes[i], tuple(token_ids[i * bs:(i + 1) * bs]))
                                               for i in self.window_positions(end)])
        self.window_manager.unpin(ids)
        reservation.window_block_ids = []
