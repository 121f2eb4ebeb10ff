"""The engine: one loop of ``schedule -> execute -> postprocess`` over many requests.

It validates requests at the door (clear errors, nothing half-added), owns the request
states, and exposes the seams disaggregation builds on: a request handed over with its prompt's
KV (detach here, reserve_kv / commit_kv there), and, through ``engine.prefix``
(prefix_seam.py), full blocks by hash exported from one engine and imported into another, which
then continues exactly where the first one stopped (its prefix cache hits the imported blocks).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass

import torch

from kvstore.hashing import BlockHash, root_hash
from services.common import metrics
from services.common.cost_model import PrefillCost
from services.common.errors import InvalidRequestError, PromptTooLongError
from services.common.sampling_params import SamplingParams, StructuredOutput
from services.engine.block_manager import NULL_BLOCK, BlockManager, SlidingWindowBlockManager
from services.engine.config import EngineConfig
from services.engine.kv_groups import KVGroups, num_window_blocks
from services.engine.models.loader import LoadedModel, load_model
from services.engine.model_runner import ModelRunner, kv_block_bytes, pools_bytes, resolve_device, resolve_dtype
from services.engine.outputs import OutputState, RequestOutput
from services.engine.scheduler import OnlineCost, Scheduler
from services.engine.prefix_seam import PrefixSeam
from services.engine.seams import Handoff, KVReservation
from services.engine.structured import CompiledGrammar, GrammarCompiler
from services.engine.threads import parse_cpus
from services.engine.sequence import FinishReason, MultiModalInput, RequestId, Sequence, SequenceStatus

logger = logging.getLogger(__name__)
SPEC_DRAFT_TOKENS = metrics.counter("epd_spec_decode_draft_tokens_total",
                                    "Draft tokens verified by speculative decoding.")
SPEC_ACCEPTED_TOKENS = metrics.counter("epd_spec_decode_accepted_tokens_total",
                                       "Draft tokens speculative decoding verified and kept.")
QUEUE_TIME = metrics.histogram("epd_engine_queue_time_seconds", "From a request's arrival in the engine to its "
                               "first scheduled step.", buckets=metrics.TTFT_BUCKETS_S)


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot of an engine's load (what load reports carry)."""

    num_running: int
    num_waiting: int
    num_held: int
    num_queued_prefill_tokens: int
    num_kv_tokens_in_use: int
    num_free_blocks: int
    num_total_blocks: int
    queued_prefill_compute_s: float = 0.0
    """The queued prefill tokens priced by the fitted cost model (0 before it has one)."""
    num_used_window_blocks: int = 0
    num_total_window_blocks: int = 0
    """A hybrid model's sliding-window pool (0 for other models); the fields above count the
    full-attention pool."""


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 kv_allocator: Callable[[int], object] | None = None) -> None:
        """``kv_allocator(num_bytes)`` returns a writable host buffer for the KV pools (a memory
        region the transfer engine registers; a hybrid model's two pools lie one after the
        other, ``runner.pool_offsets``); by default the pools are private memory."""
        self.config = config = config or EngineConfig()
        loaded = loaded or load_model(config.model)
        self.model_config = cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device, cfg.dtype, config.exact_prefill)
        bs = config.block_size
        # A hybrid model's window pool is sized for max_num_seqs full chunks (kv_groups.py); the
        # full-attention pool, num_kv_blocks, gets the rest of the memory.
        num_window = (num_window_blocks(cfg.sliding_window, bs, config.max_num_seqs, config.max_num_batched_tokens)
                      if cfg.has_window_pool else 0)
        window_bytes = (num_window + 1) * kv_block_bytes(cfg, bs, dtype, 1) if num_window else 0
        num_blocks = config.num_kv_blocks or max(
            1, (int(config.kv_cache_gib * 2**30) - window_bytes) // kv_block_bytes(cfg, bs, dtype))
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, num_blocks * bs)
        eos = tuple(cfg.eos_token_ids) or (self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.eos_token_ids = eos
        self._root_keys = dict(model=cfg.name, block_size=bs, dtype=str(dtype).removeprefix("torch."))
        self.root = root_hash(**self._root_keys)
        self.block_manager = BlockManager(num_blocks, bs, self.root, config.enable_prefix_caching)
        """The full-attention pool's blocks (every layer's, for a plain model): what the seams move."""
        self.kv = KVGroups([self.block_manager] + ([SlidingWindowBlockManager(
            num_window, bs, self.root, cfg.sliding_window, config.enable_prefix_caching)] if num_window else []),
            cfg.replay_tokens)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, eos, config.step_time_budget_s,
                                   speculative=config.speculative)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        """Speculative decoding's drafts verified and kept, in total (acceptance = their ratio)."""
        self._online_cost = OnlineCost()
        self.kv_block_bytes = kv_block_bytes(cfg, bs, dtype)
        self.window_block_bytes = kv_block_bytes(cfg, bs, dtype, 1) if num_window else 0
        """A hybrid model's window pool's block (its sliding-window layers), what a hand-over moves too."""
        num_window_total = num_window and len(self.kv.managers[1].blocks)  # its NULL block included
        kv_buffer = (kv_allocator(sum(pools_bytes(cfg, num_blocks, num_window_total, bs, dtype)))
                     if kv_allocator else None)
        self.runner = ModelRunner(cfg, loaded.weights, num_blocks, bs, device, dtype, eos, kv_buffer,
                                  batch_invariant=config.batch_invariant,
                                  cpu_threads=parse_cpus(config.cpu_threads), nice=config.nice,
                                  num_window_blocks=num_window_total, exact_prefill=config.exact_prefill)
        self.prefix = PrefixSeam(self.block_manager, self.runner, self.root_for,
                                 self.kv.managers[1] if num_window else None)
        """Full blocks by hash between this pool and other engines or the KV store."""
        self.grammar_compiler = GrammarCompiler(self.tokenizer, cfg.vocab_size, eos) if self.tokenizer else None
        self._states: dict[RequestId, OutputState] = {}
        self.last_step_num_tokens = 0
        self._num_handoff_blocks = 0
        self._held: dict[RequestId, Sequence] = {}
        """Requests added with ``hold_for_kv``: not scheduled until their KV is committed."""
        self._ids = itertools.count()
        runner = self.runner
        logger.info("engine ready: %s on %s/%s (dtype %s), %d KV blocks of %d tokens (+%d for sliding windows), "
                    "max_model_len %d; products: prompt steps %s, decode steps %s; attention %s; batch-invariant %s",
                    cfg.name, device, str(dtype).removeprefix("torch."), config.dtype, num_blocks, bs, num_window,
                    self.max_model_len, *runner.product_kernels, runner.attention_backend,
                    "yes" if runner.is_batch_invariant else "no (the same request batched alike only)")

    # ----- requests ----------------------------------------------------------------------
    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Token ids for ``prompt``, or an :class:`InvalidRequestError` saying what is wrong."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids, not text")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise InvalidRequestError("a token-id prompt must be a list of integers")
            token_ids = list(prompt)
            bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token id {bad[0]} is outside the vocabulary [0, {self.model_config.vocab_size})")
        else:
            raise InvalidRequestError(f"a prompt must be a string or a list of token ids, not {type(prompt).__name__}")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens but the context is {self.max_model_len} "
                f"tokens, which must also hold at least one output token")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; use stop_token_ids")
        return token_ids

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, output_token_ids: Sequence_[int] = (),
                    hold_for_kv: bool = False, mm_inputs: Sequence_[MultiModalInput] = (),
                    cache_salt: str = "", grammar: CompiledGrammar | None = None) -> RequestId:
        """Queue a request. ``output_token_ids``: tokens another engine already generated for
        it (this engine continues after them). ``hold_for_kv``: its prompt KV will arrive from
        another engine (:meth:`reserve_kv`, :meth:`commit_kv`), so it is not scheduled yet.
        ``cache_salt``: only requests with the same salt share cached KV. ``grammar``:
        ``params.structured`` compiled (:meth:`compile_grammar`); None: compiled here, now."""
        token_ids = self.validate(prompt, params)
        rid = RequestId(request_id if request_id is not None else f"req-{next(self._ids)}")
        if rid in self._states:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        outputs = list(output_token_ids)
        if not all(isinstance(t, int) and 0 <= t < self.model_config.vocab_size for t in outputs):
            raise InvalidRequestError("output token ids must be integers inside the vocabulary")
        if len(token_ids) + len(outputs) >= self.max_model_len or len(outputs) >= params.max_tokens:
            raise InvalidRequestError(
                f"{len(outputs)} output tokens already exist: nothing is left to generate")
        self._check_mm_inputs(mm_inputs, len(token_ids))
        if params.structured is None:
            grammar = None
        else:
            grammar = grammar or self.compile_grammar(params.structured)
            grammar.check_prefix(outputs)
        seq = Sequence(rid, token_ids, params, mm_inputs=tuple(mm_inputs), root=self.root_for(cache_salt))
        seq.grammar = grammar
        state = OutputState.create(seq, prompt if isinstance(prompt, str) else None, self.tokenizer)
        for token_id in outputs:
            seq.token_ids.append(token_id)
            state.add_token(token_id, None)
        self._states[rid] = state
        if hold_for_kv:
            self._held[rid] = seq
        else:
            self.scheduler.add(seq)
        return rid

    def compile_grammar(self, structured: StructuredOutput) -> CompiledGrammar:
        """``structured`` compiled for this engine's tokenizer (cached; thread-safe, so the async
        engine runs it off the engine thread), or InvalidRequestError saying what is wrong."""
        if self.grammar_compiler is None:
            raise InvalidRequestError("structured output needs a tokenizer, and this model has none")
        return self.grammar_compiler.compile(structured)

    def root_for(self, cache_salt: str) -> BlockHash:
        return self.root if not cache_salt else root_hash(**self._root_keys, salt=cache_salt)

    def _check_mm_inputs(self, mm_inputs: Sequence_[MultiModalInput], num_prompt_tokens: int) -> None:
        hidden = self.model_config.hidden_size
        for i, m in enumerate(mm_inputs):
            shape = tuple(getattr(m.embeddings, "shape", ()))
            if len(shape) != 2 or shape[1] != hidden:
                raise InvalidRequestError(f"image {i}: embeddings of shape {shape} do not fit the "
                                          f"model (expected [rows, {hidden}])")
            if not 0 <= m.position <= num_prompt_tokens - m.num_tokens:
                raise InvalidRequestError(f"image {i}: positions [{m.position}, {m.position + m.num_tokens})"
                                          f" fall outside the {num_prompt_tokens}-token prompt")

    def abort_request(self, request_id: str) -> None:
        state = self._states.pop(RequestId(request_id), None)
        if state is None:
            return
        held = self._held.pop(state.seq.request_id, None)
        if held is not None:
            self.kv.free(held)
            held.status = SequenceStatus.FINISHED
            held.finish_reason = FinishReason.ABORT
        else:
            self.scheduler.finish(state.seq, FinishReason.ABORT)
        self._flush_finished()

    def stats(self) -> EngineStats:
        sched, bm = self.scheduler, self.block_manager
        prefilling = [*sched.waiting, *(s for s in sched.running if s.num_uncomputed_tokens > 1)]
        cost = self.prefill_cost
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_held=len(self._held),
            num_queued_prefill_tokens=sum(s.num_uncomputed_tokens for s in prefilling),
            num_kv_tokens_in_use=sum(s.num_computed_tokens for s in sched.running),
            num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
            queued_prefill_compute_s=0.0 if cost is None else sum(
                cost.prompt_seconds(len(s), s.num_computed_tokens, self.config.max_num_batched_tokens)
                for s in prefilling),
            num_used_window_blocks=sum(self.kv.num_used_blocks()[1:]),
            num_total_window_blocks=sum(m.num_blocks for m in self.kv.managers[1:]))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that got a token (finished or not)."""
        out = self.scheduler.schedule()
        for seconds in self.scheduler.queue_times_s:
            QUEUE_TIME.observe(seconds)
        self.scheduler.queue_times_s.clear()
        if out is None:
            self.last_step_num_tokens = 0
            if self.scheduler.waiting and not self.scheduler.running and not self._has_lent_blocks():
                # Nothing runs and nothing is lent out, so nothing will ever free a block:
                # waiting would hang forever.
                raise RuntimeError(
                    f"the KV pool cannot fit request {self.scheduler.waiting[0].request_id!r} even "
                    f"with nothing running ({self.block_manager.num_free_blocks} of "
                    f"{self.block_manager.num_blocks} blocks free; the rest are pinned by exports)")
            return []  # blocks lent to another engine come back when it releases them
        self.last_step_num_tokens = out.num_tokens
        start = time.perf_counter()
        result = self.runner.execute(out)
        if not result.sampled and self.runner.device.type == "cuda":
            # Sampling waits for the device; a step that samples nothing must wait to be timed.
            torch.cuda.synchronize(self.runner.device)
        self.scheduler.cost = self._online_cost.observe(out, time.perf_counter() - start)
        seqs = {c.request_id: self._states[c.request_id].seq for c in out.chunks
                if c.request_id in self._states}
        updated = self.scheduler.postprocess(out, result.sampled, seqs)
        self._count_drafts()
        outputs: list[RequestOutput] = []
        for seq, num_new in updated:
            state = self._states[seq.request_id]
            self._add_tokens(seq, state, num_new, result.logprobs.get(seq.request_id) or [None] * num_new)
            if seq.is_finished:
                state.finish()
                del self._states[seq.request_id]
            outputs.append(state.to_output())
        self._flush_finished()
        return outputs

    def _add_tokens(self, seq: Sequence, state: OutputState, num_new: int, logprobs: list) -> None:
        """The step's new tokens into the output; a stop string ends the request at its token."""
        if (hit := state.add_tokens(num_new, logprobs)) is None:
            return
        num_taken, stop = hit
        del seq.token_ids[len(seq.token_ids) - num_new + num_taken:]  # verified drafts after it
        if seq.is_finished:  # by a later token of the same step (EOS), already released
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
        else:
            self.scheduler.finish(seq, FinishReason.STOP, stop_reason=stop)

    def _count_drafts(self) -> None:
        sched = self.scheduler
        if sched.num_draft_tokens:
            SPEC_DRAFT_TOKENS.inc(sched.num_draft_tokens)
            SPEC_ACCEPTED_TOKENS.inc(sched.num_accepted_tokens)
            self.num_draft_tokens += sched.num_draft_tokens
            self.num_accepted_tokens += sched.num_accepted_tokens
            sched.num_draft_tokens = sched.num_accepted_tokens = 0

    def _flush_finished(self) -> None:
        """With nothing left to run no step follows: hand the runner the finished requests now,
        so their per-request state (seeded generators, grammar matchers) goes with them."""
        if not self.scheduler.has_unfinished and (out := self.scheduler.schedule()) is not None:
            self.runner.execute(out)

    @property
    def prefill_cost(self) -> PrefillCost | None:
        """The prefill cost model fitted from this engine's measured steps (None before its
        first measured prefill step); what sizes chunks under ``step_time_budget_s``."""
        return self._online_cost.cost

    def _has_lent_blocks(self) -> bool:
        """Blocks held outside the scheduler that a release will give back: hand-offs not yet
        released, requests holding blocks for KV that is still arriving."""
        return self._num_handoff_blocks > 0 or any(seq.block_table for seq in self._held.values())

    def prompt_logits(self, token_ids: list[int], chunk_size: int | None = None,
                      mm_inputs: Sequence_[MultiModalInput] = ()) -> "torch.Tensor":
        """Logits [len, vocab] at every position of one prompt, computed alone (fp32), in one step
        or in chunks of ``chunk_size`` tokens (the continued chunks' path), with ``mm_inputs``'
        embeddings spliced in.

        Uses fresh blocks and gives them back; for oracle tests and prompt logprobs.
        """
        token_ids = self.validate(list(token_ids), SamplingParams())
        self._check_mm_inputs(mm_inputs, len(token_ids))
        seq = Sequence(RequestId("score"), token_ids, SamplingParams(), mm_inputs=tuple(mm_inputs))
        if self.kv.allocate_slots(seq, len(token_ids)) is None:
            raise InvalidRequestError("no free KV blocks to score this prompt now")
        try:
            return self.runner.score(token_ids, seq.block_tables, chunk_size, seq.mm_slices)
        finally:
            self.kv.free(seq)

    # ----- the disaggregation seam -------------------------------------------------------
    def detach(self, request_id: str) -> Handoff:
        """Take a running request that has sampled its first token out of this engine, keeping
        its prompt KV for another engine to read; free it with :meth:`release_handoff`. A hybrid
        model's hand-over holds the window blocks the next query sees too (window_block_ids)."""
        state = self._states.pop(RequestId(request_id))
        seq = state.seq
        assert seq.num_computed_tokens == seq.num_prompt_tokens and seq.num_output_tokens >= 1, seq
        tables = self.scheduler.detach(seq)
        self._num_handoff_blocks += len(tables[0])
        self._flush_finished()
        window = [b for b in tables[1] if b != NULL_BLOCK] if len(tables) > 1 else []
        return Handoff(seq.request_id, seq.prompt_token_ids, seq.output_token_ids, tables[0],
                       seq.num_cached_tokens, state.to_output().logprobs, window)

    def release_handoff(self, handoff: Handoff) -> None:
        self._num_handoff_blocks -= len(handoff.block_ids)
        self.block_manager.unpin(handoff.block_ids)
        if handoff.window_block_ids:
            self.kv.managers[1].unpin(handoff.window_block_ids)
        handoff.block_ids, handoff.window_block_ids = [], []

    def reserve_kv(self, request_id: str) -> KVReservation | None:
        """Blocks for a held request's prompt KV (local prefix hits first; a hybrid model's
        window blocks, those its next query sees, always arrive); None: no room now."""
        seq = self._held[RequestId(request_id)]
        assert not any(seq.block_tables)
        full, *windows = self.kv.managers
        hits = full.get_computed_blocks(seq)
        num_new = seq.num_prompt_tokens - len(hits) * self.block_manager.block_size
        if not windows:
            if full.allocate_slots(seq, num_new, hits) is None:
                return None
            return KVReservation(list(seq.block_table), len(hits))
        window = windows[0]
        skipped = [NULL_BLOCK] * window.num_out_of_window(seq.num_prompt_tokens)
        num_in_window = seq.num_prompt_tokens - len(skipped) * window.block_size
        if not (full.can_allocate(seq, num_new, hits) and window.can_allocate(seq, num_in_window, skipped)):
            return None
        full.allocate_slots(seq, num_new, hits)
        window.allocate_slots(seq, num_in_window, skipped)
        return KVReservation(list(seq.block_table), len(hits), seq.table(1)[len(skipped):])

    def commit_kv(self, request_id: str, num_cached_tokens: int = 0) -> None:
        """The reserved blocks now hold the prompt's KV: start generating."""
        seq = self._held.pop(RequestId(request_id))
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_cached_tokens = num_cached_tokens
        self.kv.commit(seq)
        self.scheduler.add_computed(seq)

    def recompute_kv(self, request_id: str) -> None:
        """The prompt's KV could not be read: compute it here instead (same tokens, slower)."""
        seq = self._held.pop(RequestId(request_id))
        self.kv.free(seq)
        self.scheduler.add(seq)
