"""What the scheduler hands the model runner each step (plain Python, no tensors): the chunks
to compute, each carrying only what changed about its request since the runner last heard of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.common.sampling_params import SamplingParams
from services.engine.sequence import BlockId, RequestId


@dataclass(frozen=True)
class NewRequest:
    """What the runner keeps about a request, sent with its first chunk (and again after a
    preemption): later chunks carry only what changed, so a step costs the same at any length."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens already generated (elsewhere, for a request handed over or resumed)."""
    grammar: Any = None
    """The sequence's compiled structured-output grammar, if any (see Sequence.grammar)."""
    replay_until: int = 0
    """Positions before this already hold their full-attention KV (Sequence.replay_until):
    a bounded replay computes them again for the sliding-window layers and does not write it."""


@dataclass(frozen=True)
class TableChange:
    """How one block table changed since the runner last heard: keep ``num_kept`` entries,
    append ``new_block_ids``."""

    num_kept: int
    new_block_ids: list[BlockId]


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's share of a step: which tokens to compute and where their KV goes.

    The runner keeps each request's tokens and block table from step to step, so a chunk holds
    only their changes (as vLLM's scheduler output does): copying a 77K-token request's lists
    every step would cost more than its decode."""

    request_id: RequestId
    token_ids: list[int]
    start_position: int
    samples: bool
    """True when the chunk reaches the sequence's last token, so the step samples a token."""
    new_request: NewRequest | None = None
    """Everything about the request, on its first chunk (replacing what the runner had)."""
    new_token_ids: list[int] = field(default_factory=list)
    """Output tokens appended since the runner last heard of the request."""
    num_kept_blocks: int = 0
    """Leading entries of the runner's block table that still hold (rejected drafts' blocks go)."""
    new_block_ids: list[BlockId] = field(default_factory=list)
    """Blocks appended after those."""
    other_tables: tuple[TableChange, ...] = ()
    """The same for KV groups 1.. (a hybrid model's sliding-window layers). Blocks freed because
    they fell out of the window are not sent: the runner's stale entries lie before every
    query's window, where kernels skip or mask what they find (attention.py)."""
    mm_embeds: list[tuple[int, Any]] = field(default_factory=list)
    """(offset in token_ids, embedding rows) that replace those tokens' input embeddings."""
    draft_token_ids: tuple[int, ...] = ()
    """The last len(draft_token_ids) of token_ids are drafts for the runner to verify."""


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    finished_request_ids: list[RequestId] = field(default_factory=list)
    """Requests finished since the last step (the runner drops their per-request state)."""

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)
