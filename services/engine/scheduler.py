"""Continuous batching with chunked prefill and preemption by recompute. Torch-free.

Life cycle of a request in the engine::

    add() -> waiting --admit (prefix hit + blocks)--> running --finish--> freed
                 ^                                       |
                 +-------- preempt (free all blocks) ----+

Each step has one token budget. Running sequences go first, in admission order (a decode
costs one token, an unfinished prefill takes the next chunk that fits); then waiting ones are
admitted while budget, sequence slots and free blocks last. When a running sequence needs a
block and none is free, the most recently admitted one is preempted: its blocks are freed and
it is recomputed later (most of it from the prefix cache, if its blocks survive).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from services.common.sampling_params import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.sequence import BlockId, FinishReason, RequestId, Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's share of a step: which tokens to compute and where their KV goes."""

    request_id: RequestId
    token_ids: list[int]
    start_position: int
    block_table: list[BlockId]
    samples: bool
    """True when the chunk reaches the sequence's last token, so the step samples a token."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    mm_embeds: list[tuple[int, Any]] = field(default_factory=list)
    """(offset in token_ids, embedding rows) that replace those tokens' input embeddings."""


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    finished_request_ids: list[RequestId] = field(default_factory=list)
    """Requests finished since the last step (the runner drops their per-request state)."""

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._finished_ids: list[RequestId] = []
        self.num_preemptions = 0
        """Total preemptions so far (a load signal, and what tests assert on)."""

    def add(self, seq: Sequence) -> None:
        assert len(seq) < self.max_model_len, "the engine validates prompt length"
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- schedule ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput | None:
        """The next step's work, or None when nothing can run."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while self.block_manager.allocate_slots(seq, num_new) is None:
                self._preempt(self.running.pop())
                preempted = True
                if seq.status is SequenceStatus.WAITING:
                    break
            if seq.status is SequenceStatus.WAITING:
                break
            chunks.append(self._chunk(seq, num_new))
            budget -= num_new
            i += 1
        if not preempted:
            budget = self._admit(chunks, budget)
        finished, self._finished_ids = self._finished_ids, []
        if not chunks:
            return None if not finished else SchedulerOutput([], finished)
        return SchedulerOutput(chunks, finished)

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> int:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = bm.get_computed_blocks(seq)
            num_hit_tokens = len(hits) * bm.block_size
            num_new = min(len(seq) - num_hit_tokens, budget)
            if bm.allocate_slots(seq, num_new, hits) is None:
                break
            self.waiting.popleft()
            seq.num_computed_tokens = num_hit_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_hit_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, num_new))
            budget -= num_new
        return budget

    def _chunk(self, seq: Sequence, num_new: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(
            request_id=seq.request_id,
            token_ids=seq.token_ids[start:start + num_new],
            start_position=start,
            block_table=list(seq.block_table),
            samples=start + num_new == len(seq),
            params=seq.params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            mm_embeds=seq.mm_slices(start, num_new) if seq.mm_inputs else [],
        )

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ----- postprocess -------------------------------------------------------------------
    def postprocess(self, output: SchedulerOutput, sampled: dict[RequestId, int],
                    seqs: dict[RequestId, Sequence]) -> list[Sequence]:
        """Apply a step's results; returns the sequences that got a new token."""
        updated: list[Sequence] = []
        for chunk in output.chunks:
            seq = seqs[chunk.request_id]
            if seq.is_finished:  # aborted while the step ran
                continue
            seq.num_computed_tokens += len(chunk.token_ids)
            if chunk.samples:
                token_id = sampled[chunk.request_id]
                seq.token_ids.append(token_id)
                self._check_stop(seq, token_id)
                updated.append(seq)
            self.block_manager.cache_full_blocks(seq)
            if seq.is_finished:
                self._release(seq)
        return updated

    def _check_stop(self, seq: Sequence, token_id: int) -> None:
        params = seq.params
        can_stop = seq.num_output_tokens >= params.min_tokens
        if can_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            self.finish(seq, FinishReason.STOP, release=False)
        elif can_stop and token_id in params.stop_token_ids:
            self.finish(seq, FinishReason.STOP, release=False, stop_reason=token_id)
        elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            self.finish(seq, FinishReason.LENGTH, release=False)

    def finish(self, seq: Sequence, reason: FinishReason, release: bool = True,
               stop_reason: str | int | None = None) -> None:
        """Mark finished (stop string, abort, ...); ``release`` frees its blocks now."""
        if seq.is_finished:
            return
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if release:
            self._release(seq)
        seq.status = SequenceStatus.FINISHED

    # ----- the disaggregation seam -------------------------------------------------------
    def detach(self, seq: Sequence) -> list[BlockId]:
        """Take a running sequence out of this engine, keeping its blocks; returns them.

        The caller owns the returned blocks (one reference each) until it frees them.
        """
        self.running.remove(seq)
        blocks, seq.block_table = seq.block_table, []
        seq.status = SequenceStatus.FINISHED
        self._finished_ids.append(seq.request_id)
        return blocks

    def add_computed(self, seq: Sequence) -> None:
        """Run a sequence whose blocks already hold the KV of its first num_computed_tokens."""
        assert seq.block_table and seq.num_computed_tokens < len(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self._finished_ids.append(seq.request_id)
