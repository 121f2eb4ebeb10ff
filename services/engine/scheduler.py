"""Continuous batching with chunked prefill and preemption by recompute. Torch-free.

Life cycle of a request in the engine::

    add() -> waiting --admit (prefix hit + blocks)--> running --finish--> freed
                 ^                                       |
                 +-------- preempt (free all blocks) ----+

Each step has one token budget. Running sequences go first, in admission order (a decode
costs one token, an unfinished prefill takes the next chunk that fits); then waiting ones are
admitted while budget, sequence slots and free blocks last. When a running sequence needs a
block and none is free, the most recently admitted one is preempted: its blocks are freed and
it is recomputed later (most of it from the prefix cache, if its blocks survive). Blocks are
those of every KV group at once (kv_groups.py): a hybrid model's sliding-window pool can run
short too, and after each step its blocks that fell out of the window are freed (``commit``).

With a time budget (``step_time_budget_s > 0`` and a cost model) a step also has seconds to
spend, priced by :class:`PrefillCost`: the fixed cost of the step and every decode (a sequence
with one token left; it costs like one new token at its context, ``seconds(1, ctx) - a``) are
taken first, then each prefill chunk gets the most tokens the seconds left buy at its context
(``tokens_within``), still capped by the token budget and its remaining tokens. A running
sequence always gets at least one token, so nothing starves; a waiting one is admitted only
while seconds are left (or when the step would otherwise be empty).

With a drafter (speculative.py) a decoding sequence's chunk also carries draft tokens when the
drafter has some, blocks are free for them and the token budget has room; postprocess keeps the
tokens the runner verified, counts only their KV as computed and gives back the blocks of the
rest (a sequence never runs short because of drafts: without room it decodes plainly).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from services.common.cost_model import PrefillCost
from services.engine.block_manager import BlockManager
from services.engine.kv_groups import KVGroups
from services.engine.scheduler_output import NewRequest, ScheduledChunk, SchedulerOutput, TableChange
from services.engine.sequence import BlockId, FinishReason, RequestId, RunnerSync, Sequence, SequenceStatus
from services.engine.speculative import DRAFTERS, DraftState, SpeculativeConfig


class OnlineCost:
    """The prefill cost model, refitted from the engine's own measured steps.

    Each step that computes a prefill chunk (one of more than one token) becomes one sample
    ``(num_new, ctx, seconds)``: ``num_new`` is the step's total of new tokens and ``ctx`` the
    context that makes the model's attention term come out exact for all its chunks together
    (``num_new * ctx + num_new**2 / 2 = sum(n * c + n**2 / 2)``; fractional, and negative for a
    step of many short chunks, which the linear fit does not mind). Decode-only steps are left
    out: they are bound by memory, not by the compute this model describes.

    Prior: none at first (the token budget alone applies). The first prefill step warms up
    kernels and caches, so it is not measured; the second fixes the prior: the reference model
    (``PrefillCost()``, SPEC.md's card) scaled by one factor so that it predicts that step
    exactly. That keeps the reference's shape and takes the speed of this device and model,
    which differ from the reference by orders of magnitude (a CPU is ~1000x slower). Then a
    least-squares fit over the last ``window`` samples replaces it after 2, 4, 8 and 16
    samples, then every ``refit_every``: early fits correct a poor prior fast, later ones track
    drift. A fit that prices tokens at nothing (b = d = 0, from noise) is not taken.
    """

    def __init__(self, window: int = 64, refit_every: int = 16) -> None:
        self.samples: deque[tuple[int, float, float]] = deque(maxlen=window)
        self.refit_every = refit_every
        self.cost: PrefillCost | None = None
        self._is_warm = False
        self._num_since_fit = 0

    def observe(self, output: SchedulerOutput, seconds: float) -> PrefillCost | None:
        """Record one measured step; returns the current model."""
        if not any(len(c.token_ids) > 1 for c in output.chunks) or seconds <= 0:
            return self.cost
        if not self._is_warm:
            self._is_warm = True
            return self.cost
        num_new = output.num_tokens
        pairs = sum(len(c.token_ids) * c.start_position + len(c.token_ids) ** 2 / 2 for c in output.chunks)
        sample = (num_new, (pairs - num_new * num_new / 2) / num_new, seconds)
        self.samples.append(sample)
        self._num_since_fit += 1
        if self.cost is None:
            ref = PrefillCost()
            scale = seconds / ref.seconds(*sample[:2])
            self.cost = PrefillCost(ref.a * scale, ref.b * scale, ref.d * scale)
            self._num_since_fit = 0
        elif self._num_since_fit >= min(self.refit_every, len(self.samples) - self._num_since_fit):
            self._num_since_fit = 0
            fitted = PrefillCost.fit(list(self.samples), prior=self.cost)
            if fitted.b > 0 or fitted.d > 0:
                self.cost = fitted
        return self.cost


@dataclass
class StepBudget:
    """What one step has left to spend: tokens always; seconds too when ``cost`` is set."""

    num_tokens: int
    cost: PrefillCost | None = None
    seconds: float = 0.0
    """Seconds left for new tokens (the step's fixed cost ``a`` is already taken out)."""

    def num_fitting(self, num_left: int, num_ctx: int) -> int:
        """How many of a sequence's ``num_left`` remaining tokens fit, after ``num_ctx``
        computed ones (at least 1 while a token is left in the budget)."""
        n = min(num_left, self.num_tokens)
        if self.cost is not None:
            # tokens_within takes the fixed cost out of what it is given: hand it back.
            n = min(n, self.cost.tokens_within(self.seconds + self.cost.a, num_ctx))
        return n

    def take(self, num_new: int, num_ctx: int, is_priced: bool = True) -> None:
        self.num_tokens -= num_new
        if self.cost is not None and is_priced:
            self.seconds -= self.cost.seconds(num_new, num_ctx) - self.cost.a

    @property
    def is_out_of_time(self) -> bool:
        return self.cost is not None and self.seconds <= 0


class Scheduler:
    def __init__(self, block_manager: BlockManager | KVGroups, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = (), step_time_budget_s: float = 0.0,
                 cost: PrefillCost | None = None, speculative: SpeculativeConfig | None = None) -> None:
        self.kv = block_manager if isinstance(block_manager, KVGroups) else KVGroups([block_manager])
        """The KV groups' blocks (one group for a plain model), allocated all or nothing."""
        self.speculative = speculative
        self._drafter = DRAFTERS[speculative.method]() if speculative is not None else None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.step_time_budget_s = step_time_budget_s
        """Seconds per step for chunked prefill; 0: only the token budget."""
        self.cost = cost
        """The prefill cost model chunks are sized with (the engine refits it as it runs);
        unused without a time budget, and while None the token budget alone applies."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.queue_times_s: list[float] = []
        """Arrival to first admission of each sequence admitted since the engine last took them."""
        self._finished_ids: list[RequestId] = []
        self.num_preemptions = 0
        """Total preemptions so far (a load signal, and what tests assert on)."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        """Drafts verified and drafts kept, in total (the acceptance metrics)."""

    def add(self, seq: Sequence) -> None:
        assert len(seq) < self.max_model_len, "the engine validates prompt length"
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- schedule ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput | None:
        """The next step's work, or None when nothing can run."""
        budget = self._step_budget()
        chunks: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget.num_tokens > 0:
            seq = self.running[i]
            is_decode = seq.num_uncomputed_tokens == 1
            drafts = self._drafts(seq, budget.num_tokens - 1) if is_decode else []
            if drafts:
                budget.take(1 + len(drafts), seq.num_computed_tokens, is_priced=False)
                chunks.append(self._chunk(seq, 1, drafts))
                i += 1
                continue
            num_new = budget.num_fitting(seq.num_uncomputed_tokens, seq.num_computed_tokens)
            while self.kv.allocate_slots(seq, num_new) is None:
                self._preempt(self.running.pop())
                preempted = True
                if seq.status is SequenceStatus.WAITING:
                    break
            if seq.status is SequenceStatus.WAITING:
                break
            budget.take(num_new, seq.num_computed_tokens, is_priced=not is_decode)
            chunks.append(self._chunk(seq, num_new))
            i += 1
        if not preempted:
            self._admit(chunks, budget)
        finished, self._finished_ids = self._finished_ids, []
        if not chunks:
            return None if not finished else SchedulerOutput([], finished)
        return SchedulerOutput(chunks, finished)

    def _step_budget(self) -> StepBudget:
        """A fresh step's budget; with a time budget, the running decodes are paid for first."""
        cost = self.cost if self.step_time_budget_s > 0 else None
        if cost is None:
            return StepBudget(self.max_num_batched_tokens)
        decode_s = sum(cost.seconds(1, seq.num_computed_tokens) - cost.a
                       for seq in self.running if seq.num_uncomputed_tokens == 1)
        return StepBudget(self.max_num_batched_tokens, cost, self.step_time_budget_s - cost.a - decode_s)

    def _admit(self, chunks: list[ScheduledChunk], budget: StepBudget) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            if budget.num_tokens <= 0 or (budget.is_out_of_time and chunks):
                break  # out of time, a new prefill still goes into an otherwise empty step
            seq = self.waiting[0]
            hit = self.kv.get_computed_blocks(seq)
            num_hit_tokens = hit.num_tokens
            num_new = budget.num_fitting(len(seq) - num_hit_tokens, num_hit_tokens)
            if self.kv.allocate_slots(seq, num_new, hit) is None:
                break
            self.waiting.popleft()
            seq.num_computed_tokens = num_hit_tokens
            seq.replay_until = hit.replay_until
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_hit_tokens
                self.queue_times_s.append(time.monotonic() - seq.arrival_time)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, num_new))
            budget.take(num_new, num_hit_tokens)

    def _drafts(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Draft tokens for a decoding sequence, with its blocks allocated for 1 + drafts; []
        (nothing allocated) when it has none or there is no room for them."""
        if self._drafter is None or seq.grammar is not None:
            return []
        if seq.draft is None:
            seq.draft = DraftState(self.speculative)
        params = seq.params
        # Drafts past max_tokens or the context would be verified for nothing; the request may
        # ask for fewer (num_speculative_tokens, 0: none).
        max_tokens = min(max_tokens, params.max_tokens - seq.num_output_tokens - 1,
                         self.max_model_len - len(seq) - 1)
        if params.num_speculative_tokens is not None:
            max_tokens = min(max_tokens, params.num_speculative_tokens)
        drafts = self._drafter.propose(seq.token_ids, seq.draft, max_tokens) if max_tokens > 0 else []
        if not drafts or self.kv.allocate_slots(seq, 1 + len(drafts)) is None:
            return []
        return drafts

    def _chunk(self, seq: Sequence, num_new: int, drafts: list[int] = ()) -> ScheduledChunk:
        start = seq.num_computed_tokens
        new_request = None
        sync, tables = seq.sync, seq.block_tables
        if not sync.is_known:
            new_request = NewRequest(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.grammar,
                                     seq.replay_until)
            sync.is_known, sync.num_tokens, sync.num_blocks = True, len(seq), [0] * len(tables)
        kept = sync.num_blocks
        chunk = ScheduledChunk(
            request_id=seq.request_id,
            token_ids=seq.token_ids[start:start + num_new] + list(drafts),
            start_position=start,
            samples=start + num_new == len(seq),
            new_request=new_request,
            new_token_ids=seq.token_ids[sync.num_tokens:],
            num_kept_blocks=kept[0],
            new_block_ids=tables[0][kept[0]:],
            other_tables=tuple(TableChange(kept[g], tables[g][kept[g]:]) for g in range(1, len(tables))),
            mm_embeds=seq.mm_slices(start, num_new) if seq.mm_inputs else [],
            draft_token_ids=tuple(drafts),
        )
        sync.num_tokens, sync.num_blocks = len(seq), [len(t) for t in tables]
        return chunk

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.sync = RunnerSync()  # recomputed from scratch: the runner hears of it anew
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ----- postprocess -------------------------------------------------------------------
    def postprocess(self, output: SchedulerOutput, sampled: dict[RequestId, list[int]],
                    seqs: dict[RequestId, Sequence]) -> list[tuple[Sequence, int]]:
        """Apply a step's results: ``sampled`` holds each sampling chunk's new tokens (one, or
        the verified drafts and the token after them). Returns each sequence that got tokens,
        with how many it kept (fewer than sampled when a stop condition came first)."""
        updated: list[tuple[Sequence, int]] = []
        for chunk in output.chunks:
            seq = seqs[chunk.request_id]
            if seq.is_finished:  # aborted while the step ran
                continue
            num_drafts = len(chunk.draft_token_ids)
            seq.num_computed_tokens += len(chunk.token_ids) - num_drafts
            if chunk.samples:
                token_ids = sampled[chunk.request_id]
                self._observe_drafts(seq, num_drafts, len(token_ids) - 1)
                num_kept = self._append(seq, token_ids)
                # KV exists for the inputs of the kept tokens: the drafts among them were inputs.
                seq.num_computed_tokens = min(seq.num_computed_tokens + len(token_ids) - 1, len(seq) - 1)
                updated.append((seq, num_kept))
            if num_drafts:
                self.kv.trim(seq)
                seq.sync.num_blocks = [min(n, len(t)) for n, t in zip(seq.sync.num_blocks, seq.block_tables)]
            self.kv.commit(seq)
            if seq.is_finished:
                self._release(seq)
        return updated

    def _append(self, seq: Sequence, token_ids: list[int]) -> int:
        """Append tokens up to the first that finishes the sequence; how many were appended."""
        for n, token_id in enumerate(token_ids, 1):
            seq.token_ids.append(token_id)
            self._check_stop(seq, token_id)
            if seq.is_finished:
                return n
        return len(token_ids)

    def _observe_drafts(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        if seq.draft is None:
            return
        seq.draft.length.observe(num_drafts, num_accepted)
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted

    def _check_stop(self, seq: Sequence, token_id: int) -> None:
        params = seq.params
        can_stop = seq.num_output_tokens >= params.min_tokens
        # Under a grammar EOS is sampled only once the grammar is complete: nothing can follow it.
        ends_grammar = seq.grammar is not None and token_id in self.eos_token_ids
        if ends_grammar or (can_stop and not params.ignore_eos and token_id in self.eos_token_ids):
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
    def detach(self, seq: Sequence) -> list[list[BlockId]]:
        """Take a running sequence out of this engine, keeping its blocks; returns its table in
        each KV group (a window group's has NULL_BLOCK entries: none held for them).

        The caller owns the returned blocks (one reference each) until it frees them.
        """
        self.running.remove(seq)
        blocks, seq.block_tables = seq.block_tables, [[] for _ in seq.block_tables]
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
        self.kv.free(seq)
        self._finished_ids.append(seq.request_id)
