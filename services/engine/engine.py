"""The engine: one loop of ``schedule -> execute -> postprocess`` over many requests.

It validates requests at the door (clear errors, nothing half-added), owns the request
states, and exposes the seam disaggregation builds on: export the KV of a prompt's full blocks
from one engine and import them into another, which then continues exactly where the first
one stopped (its prefix cache hits the imported blocks).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from kvstore.hashing import BlockHash, block_hashes, root_hash
from services.common.errors import InvalidRequestError, PromptTooLongError
from services.common.sampling_params import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.models.loader import LoadedModel, load_model
from services.engine.model_runner import ModelRunner, kv_block_bytes, resolve_device, resolve_dtype
from services.engine.outputs import OutputState, RequestOutput
from services.engine.scheduler import Scheduler
from services.engine.sequence import BlockId, FinishReason, RequestId, Sequence

logger = logging.getLogger(__name__)


@dataclass
class KVBlock:
    """One full block of KV on its way between engines."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]
    data: torch.Tensor
    """[num_layers, 2, block_size, kv_heads, head_dim]; ``data[l, 0]`` is layer l's K."""


@dataclass
class KVExport:
    """Full blocks of a prompt pinned in the exporting engine until :meth:`LLMEngine.release`."""

    blocks: list[KVBlock]
    block_ids: list[BlockId]

    @property
    def num_tokens(self) -> int:
        return sum(len(b.token_ids) for b in self.blocks)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        self.config = config = config or EngineConfig()
        loaded = loaded or load_model(config.model)
        self.model_config = cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        bs = config.block_size
        num_blocks = config.num_kv_blocks or max(
            1, int(config.kv_cache_gib * 2**30) // kv_block_bytes(cfg, bs, dtype))
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, num_blocks * bs)
        eos = tuple(cfg.eos_token_ids) or (self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.eos_token_ids = eos
        self.root = root_hash(model=cfg.name, block_size=bs, dtype=str(dtype).removeprefix("torch."))
        self.block_manager = BlockManager(num_blocks, bs, self.root, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len, eos)
        self.runner = ModelRunner(cfg, loaded.weights, num_blocks, bs, device, dtype, eos)
        self._states: dict[RequestId, OutputState] = {}
        self._ids = itertools.count()
        logger.info("engine ready: %s on %s/%s, %d KV blocks of %d tokens, max_model_len %d",
                    cfg.name, device, dtype, num_blocks, bs, self.max_model_len)

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
                    request_id: str | None = None) -> RequestId:
        token_ids = self.validate(prompt, params)
        rid = RequestId(request_id if request_id is not None else f"req-{next(self._ids)}")
        if rid in self._states:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        seq = Sequence(rid, token_ids, params)
        self._states[rid] = OutputState.create(seq, prompt if isinstance(prompt, str) else None,
                                               self.tokenizer)
        self.scheduler.add(seq)
        return rid

    def abort_request(self, request_id: str) -> None:
        state = self._states.pop(RequestId(request_id), None)
        if state is not None:
            self.scheduler.finish(state.seq, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that got a token (finished or not)."""
        out = self.scheduler.schedule()
        if out is None:
            if self.scheduler.waiting and not self.scheduler.running:
                # Nothing runs, so nothing will ever free a block: waiting would hang forever.
                raise RuntimeError(
                    f"the KV pool cannot fit request {self.scheduler.waiting[0].request_id!r} even "
                    f"with nothing running ({self.block_manager.num_free_blocks} of "
                    f"{self.block_manager.num_blocks} blocks free; the rest are pinned by exports)")
            return []
        result = self.runner.execute(out)
        seqs = {c.request_id: self._states[c.request_id].seq for c in out.chunks
                if c.request_id in self._states}
        updated = self.scheduler.postprocess(out, result.sampled, seqs)
        outputs: list[RequestOutput] = []
        for seq in updated:
            state = self._states[seq.request_id]
            stop = state.add_token(seq.token_ids[-1], result.logprobs.get(seq.request_id))
            if stop is not None:
                self.scheduler.finish(seq, FinishReason.STOP, stop_reason=stop)
            if seq.is_finished:
                state.finish()
                del self._states[seq.request_id]
            outputs.append(state.to_output())
        return outputs

    def prompt_logits(self, token_ids: list[int]) -> "torch.Tensor":
        """Logits [len, vocab] at every position of one prompt, computed alone (fp32).

        Uses fresh blocks and gives them back; for oracle tests and prompt logprobs.
        """
        token_ids = self.validate(list(token_ids), SamplingParams())
        seq = Sequence(RequestId("score"), token_ids, SamplingParams())
        if self.block_manager.allocate_slots(seq, len(token_ids)) is None:
            raise InvalidRequestError("no free KV blocks to score this prompt now")
        try:
            return self.runner.score(token_ids, seq.block_table)
        finally:
            self.block_manager.free(seq)

    # ----- the disaggregation seam -------------------------------------------------------
    def export_kv(self, token_ids: list[int]) -> KVExport:
        """Pin and expose the cached full blocks covering the longest prefix of ``token_ids``."""
        bm = self.block_manager
        bs = bm.block_size
        hashes = block_hashes(token_ids, bs, self.root)
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
