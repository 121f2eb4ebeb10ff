"""How much of a prompt a prefix hit may skip: the hit rule of SPEC.md, for any model.

A plain model may reuse every cached full block but must compute at least one token (its
logits give the first output token). A model with sliding-window layers also needs the window
of KV that ends where the reuse ends, and keeps a margin for speculative look-back::

    L1  = block hits (in tokens), at most L - margin, rounded down to a block boundary
    SWA window [L1 - window, L1] in the SWA tier?   yes -> hit L1
                                                     no  -> hit L1 - window (then rebuilt by
                                                            replaying the last window tokens)

margin = 1 for plain models; window + look-back (128 + 6 at the reference) for SWA models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelKVShape:
    """What a model's attention needs from cached KV."""

    sliding_window: int | None = None
    """Tokens of sliding-window attention; None: full attention only."""
    lookback: int = 0
    """Extra tokens speculative decoding may re-verify (kept out of the hit)."""

    @property
    def margin(self) -> int:
        return 1 if self.sliding_window is None else self.sliding_window + self.lookback


def hit_tokens(num_prompt_tokens: int, block_size: int, num_block_hits: int, shape: ModelKVShape,
               has_window: Callable[[int], bool] = lambda end: False) -> int:
    """Prompt tokens a prefill may take from cache; ``has_window(end)`` asks the SWA tier for
    the window ending at ``end``."""
    limit = max(0, num_prompt_tokens - shape.margin)
    l1 = min(num_block_hits * block_size, limit) // block_size * block_size
    if shape.sliding_window is None or l1 == 0 or has_window(l1):
        return l1
    return max(0, l1 - shape.sliding_window)
