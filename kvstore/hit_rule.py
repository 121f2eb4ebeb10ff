"""How much of a prompt a prefix hit may skip: the hit rule of SPEC.md, for any model.

A plain model may reuse every cached full block but must compute at least one token (its
logits give the first output token). A model with sliding-window layers also needs the window
of KV that ends where the reuse ends::

    L1  = block hits (in tokens), at most L - margin, rounded down to a block boundary
    SWA window [L1 - W + 1, L1) in the SWA tier?   yes -> hit L1
                                                    no  -> hit L1 - replay_tokens, rounded down
                                                           to a block: bounded replay, which
                                                           rebuilds the window from block KV

margin = 1 + look-back (tokens speculative decoding may re-verify; 0 here). The replay is
exact: n_sliding * (W - 1) tokens (ModelConfig.replay_tokens; each sliding-window layer carries
an error from the replay start at most W - 1 positions on), with the full-attention KV of
[start, L1) kept from the cache. The reference's hit of at most L - 134 (window 128 + look-back
6) replays only W tokens, approximately; this rule keeps the output exact instead.

One rule for every place a hit is decided: the engine's admission (kv_groups.KVGroups), the
KV store reads (store_connector.py), the decode hand-over and failover resume (they read
through both), and the simulator's hit accounting (router/sim).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelKVShape:
    """What a model's attention needs from cached KV."""

    sliding_window: int | None = None
    """Tokens of sliding-window attention; None: full attention only."""
    replay_tokens: int = 0
    """Tokens a hit without its window recomputes (ModelConfig.replay_tokens)."""
    lookback: int = 0
    """Extra tokens speculative decoding may re-verify (kept out of the hit)."""

    @property
    def margin(self) -> int:
        return 1 + self.lookback


def block_kv_tokens(num_prompt_tokens: int, block_size: int, num_block_hits: int, shape: ModelKVShape) -> int:
    """L1: the prompt tokens whose block KV a prefill takes from cache, window or not."""
    limit = max(0, num_prompt_tokens - shape.margin)
    return min(num_block_hits * block_size, limit) // block_size * block_size


def hit_tokens(num_prompt_tokens: int, block_size: int, num_block_hits: int, shape: ModelKVShape,
               has_window: Callable[[int], bool] = lambda end: False) -> int:
    """Prompt tokens a prefill skips (it computes from there); ``has_window(end)`` asks the
    SWA tier for the window ending at ``end``."""
    l1 = block_kv_tokens(num_prompt_tokens, block_size, num_block_hits, shape)
    if shape.sliding_window is None or l1 == 0 or has_window(l1):
        return l1
    return max(0, l1 - shape.replay_tokens) // block_size * block_size
