"""What crosses the engine's disaggregation seams: a detached request's blocks (prefill ->
decode), blocks reserved for KV that arrives from elsewhere (decode, KV store reads), and
exported prefix blocks (engine -> engine, KV store writes). See :class:`LLMEngine` and
:class:`~services.engine.prefix_seam.PrefixSeam`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstore.hashing import BlockHash
from services.common.sampling_params import TokenLogprobs
from services.engine.sequence import BlockId, RequestId

@dataclass
class KVBlock:
    """One full block of KV on its way between engines."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]
    data: torch.Tensor
    """[num_layers, 2, block_size, kv_heads, head_dim]; ``data[l, 0]`` is layer l's K."""


@dataclass
class Handoff:
    """A request detached after its first token(s), its prompt's KV blocks still held here.

    ``block_ids`` hold the KV of the prompt (its last block may be partial). They stay allocated until :meth:`LLMEngine.release_handoff`.
    A hybrid model's ``window_block_ids`` hold its sliding-window layers' KV where the next query
    sees it: the window pool's blocks from ``num_out_of_window(len(prompt))`` on, in order.
    """

    request_id: RequestId
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[BlockId]
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    """Of ``output_token_ids``, when the request asked for logprobs."""
    window_block_ids: list[BlockId] = field(default_factory=list)


@dataclass
class KVReservation:
    """Blocks reserved for a request whose prompt KV arrives from another engine.

    ``block_ids`` cover the prompt in order; the first ``num_local_blocks`` already hold the
    right KV (local prefix-cache hits), the rest must be filled before :meth:`LLMEngine.commit_kv`,
    as must a hybrid model's ``window_block_ids`` (as in :class:`Handoff`).
    """

    block_ids: list[BlockId]
    num_local_blocks: int
    window_block_ids: list[BlockId] = field(default_factory=list)


@dataclass
class KVExport:
    """Full blocks of a prompt pinned in the exporting engine until :meth:`LLMEngine.release`."""

    blocks: list[KVBlock]
    block_ids: list[BlockId]

    @property
    def num_tokens(self) -> int:
        return sum(len(b.token_ids) for b in self.blocks)
