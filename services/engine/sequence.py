"""A request's mutable state inside one engine.

The wire type is the immutable prompt + :class:`SamplingParams`; this object adds what
scheduling needs (STYLE rule 1) and is the one thing that flows through
``schedule -> run -> postprocess``. Torch-free.

Token accounting, for a sequence of ``len(token_ids)`` tokens::

    token_ids:  [ p0 p1 ... p(P-1) | o0 o1 ... ]      P = num_prompt_tokens
                |<- num_computed_tokens ->|            KV of these is in the pool
                                          |<- next chunk ->|

A step computes the next chunk; when that chunk reaches the last token the step also samples.
Prefill, chunked prefill, decode and recompute after preemption are the same rule.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, NewType

from kvstore.hashing import BlockHash
from services.common.sampling_params import SamplingParams

RequestId = NewType("RequestId", str)
BlockId = NewType("BlockId", int)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"      # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"    # the caller cancelled


@dataclass(frozen=True)
class MultiModalInput:
    """Embeddings that replace the input embeddings of prompt positions [position, position + rows)."""

    position: int
    embeddings: Any
    """[rows, hidden_size] embeddings (any tensor type: this module is framework-free)."""
    image_hash: str
    """Hex content hash: an extra key of every block the image touches, so cached prefixes
    never mix images."""

    @property
    def num_tokens(self) -> int:
        return len(self.embeddings)


@dataclass
class RunnerSync:
    """How much of a sequence the model runner already holds (the scheduler sends the rest)."""

    is_known: bool = False
    num_tokens: int = 0
    """Leading tokens of ``token_ids`` the runner has."""
    num_blocks: list[int] = field(default_factory=list)
    """Per KV group, the leading entries of that group's block table the runner has."""


class Sequence:
    def __init__(self, request_id: RequestId, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, mm_inputs: tuple[MultiModalInput, ...] = (),
                 root: BlockHash | None = None) -> None:
        self.request_id = request_id
        self.params = params
        self.mm_inputs = mm_inputs
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache at first admission (usage reporting)."""
        self.replay_until = 0
        """A bounded replay's end (kv_groups.PrefixHit): positions from its admission's hit up
        to here are computed again only to rebuild the sliding-window layers' KV; their
        full-attention KV came from the cache and is kept, not written."""
        self.block_tables: list[list[BlockId]] = [[]]
        """One block table per KV group (models.config.ModelConfig.kv_groups); a plain model has one."""
        self.root = root
        """Parent of the first block's hash (it carries the cache salt); None: the engine's."""
        self.block_hashes: list[BlockHash] = []
        """Hashes of the full blocks of ``token_ids`` computed so far (grows with the sequence)."""
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        self.draft: Any = None
        """Speculative decoding's per-sequence state (speculative.DraftState), once it drafts."""
        self.grammar: Any = None
        """The compiled grammar of ``params.structured`` (opaque here: the runner's matchers use it)."""
        self.sync = RunnerSync()
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, len={len(self)}, computed={self.num_computed_tokens}, "
                f"status={self.status.value})")

    @property
    def block_table(self) -> list[BlockId]:
        """The block table of KV group 0 (every layer's, or a hybrid model's full-attention layers')."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[BlockId]) -> None:
        self.block_tables[0] = table

    def table(self, group: int) -> list[BlockId]:
        """The block table of KV group ``group`` (made empty on first use)."""
        while len(self.block_tables) <= group:
            self.block_tables.append([])
        return self.block_tables[group]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_extra_keys(self, block_size: int) -> list[tuple[str, ...]] | None:
        """Per full block, the hashes of the images whose positions fall into it (None: no images)."""
        if not self.mm_inputs:
            return None
        keys: list[tuple[str, ...]] = []
        for i in range(len(self.token_ids) // block_size):
            start, end = i * block_size, (i + 1) * block_size
            keys.append(tuple(m.image_hash for m in self.mm_inputs
                              if m.position < end and m.position + m.num_tokens > start))
        return keys

    def mm_slices(self, start: int, num_tokens: int) -> list[tuple[int, Any]]:
        """(offset in the chunk, embedding rows) of every image overlapping [start, start + num_tokens)."""
        pieces = []
        for m in self.mm_inputs:
            lo, hi = max(start, m.position), min(start + num_tokens, m.position + m.num_tokens)
            if lo < hi:
                pieces.append((lo - start, m.embeddings[lo - m.position:hi - m.position]))
        return pieces
