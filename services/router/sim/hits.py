"""The simulated KV store: which prefix a prefill finds cached, and how much of it it may skip.

One store for the whole cluster (any prefill instance hits any prefix), on the simulation clock:

- **block KV**: the store's own ``kvstore.index.EmbeddedIndex`` of the trace's block ids
  (capacity in blocks, LRU beyond it; a prefill's computed blocks live the chat TTL);
- **SWA KV** (a hybrid model only: ``ModelKVShape.sliding_window`` set): a
  ``kvstore.swa.SWAPool``, as the live cluster runs it. A prefill publishes the window ending
  at its own L1 when it ends; a later prefill whose block hit reaches some L1 > 0 takes the
  window ending there if it is still live, else replays (``kvstore.hit_rule.hit_tokens``)::

      hash_ids   | b0 | b1 | b2 | b3 ...          (512 tokens each)
      L1 = 3 blocks          ^ window [L1 - W + 1, L1) keyed (b2, 1536): the block before L1
                               names the prefix, the end says where the window stops

A plain model keeps the trace's own rule (``TraceRequest.cached_tokens``: every hit block, the
last one possibly partial, less the one token a prefill must compute), so the simulator's
figures for plain models are what they were before SWA came in.

:class:`HitCounts` tallies the lookups a caller counts (the simulator counts the one that
decides each prefill's hit, not the router's look at arrival when the prefill looks again).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.hit_rule import ModelKVShape, block_kv_tokens, hit_tokens
from kvstore.index import Clock, EmbeddedIndex
from kvstore.swa import DEFAULT_SWA_TTL_S, SWAPool
from services.router.sim.trace import BLOCK_TOKENS, TraceRequest
from services.router.sim.work import CHAT_TTL_S

DEFAULT_SWA_CAPACITY_ENTRIES = 4096
"""Windows the SWA tier holds (a store node's default, ``kvstore.store.NodeLayout``): at the
Mooncake trace's ~4 requests a second, more than a 180 s TTL keeps live, so the TTL decides."""


@dataclass
class HitCounts:
    num_lookups: int = 0
    num_prompt_tokens: int = 0
    num_block_tokens: int = 0
    """L1 summed: what the hits would skip if every window were live (plain: the hit tokens)."""
    num_hit_tokens: int = 0
    num_window_asks: int = 0
    """Lookups with L1 > 0 on a hybrid model: those that needed a window."""
    num_window_hits: int = 0

    @property
    def swa_hit_rate(self) -> float | None:
        """Of the lookups that needed a window, the share that found it live (None: none did)."""
        return self.num_window_hits / self.num_window_asks if self.num_window_asks else None

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.num_block_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


class PrefixHits:
    def __init__(self, capacity_blocks: int, clock: Clock, shape: ModelKVShape = ModelKVShape(),
                 swa_ttl_s: float = DEFAULT_SWA_TTL_S,
                 swa_capacity_entries: int = DEFAULT_SWA_CAPACITY_ENTRIES) -> None:
        if not swa_ttl_s > 0:
            raise ValueError(f"swa_ttl_s must be > 0 (got {swa_ttl_s!r})")
        self.shape = shape
        self.index = EmbeddedIndex(capacity_blocks, clock)
        self.swa: SWAPool[None] | None = None
        if shape.sliding_window is not None:
            self.swa = SWAPool(swa_capacity_entries, swa_ttl_s, clock)
        self.counts = HitCounts()

    def lookup(self, request: TraceRequest, is_counted: bool = True) -> tuple[int, int]:
        """(block hits, prompt tokens the prefill skips) now; renews what it hits. Only a
        counted lookup goes into ``counts``."""
        num_hit_blocks = self.index.lookup(request.hash_ids)
        asked: list[bool] = []  # whether the window was live, when one was looked up
        if self.swa is None:
            num_cached = num_block_tokens = request.cached_tokens(num_hit_blocks)
        else:
            swa = self.swa
            num_block_tokens = block_kv_tokens(request.input_length, BLOCK_TOKENS, num_hit_blocks, self.shape)

            def has_window(end: int) -> bool:
                asked.append(swa.lookup(request.hash_ids[end // BLOCK_TOKENS - 1], end))
                return asked[-1]

            num_cached = hit_tokens(request.input_length, BLOCK_TOKENS, num_hit_blocks, self.shape, has_window)
        if is_counted:
            counts = self.counts
            counts.num_lookups += 1
            counts.num_prompt_tokens += request.input_length
            counts.num_block_tokens += num_block_tokens
            counts.num_hit_tokens += num_cached
            counts.num_window_asks += len(asked)
            counts.num_window_hits += sum(asked)
        return num_hit_blocks, num_cached

    def store(self, request: TraceRequest, num_hit_blocks: int) -> None:
        """A prefill ended: the blocks it computed go to the store (the hit ones were renewed by
        its lookup), and on a hybrid model the window ending at its own L1 to the SWA tier."""
        for block_id in request.hash_ids[num_hit_blocks:]:
            self.index.insert(block_id, CHAT_TTL_S)
        if self.swa is not None:
            end = block_kv_tokens(request.input_length, BLOCK_TOKENS, len(request.hash_ids), self.shape)
            if end > 0:
                self.swa.put(request.hash_ids[end // BLOCK_TOKENS - 1], end, None)
