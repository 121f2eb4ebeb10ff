"""epd's KV connector for vLLM: moves whole KV blocks between vLLM's paged KV cache and the
service's staging region, as the service's requests ask.

It runs inside vLLM's own processes, named by ``kv_connector_module_path``: its scheduler side in
the engine core (which blocks, when) and its worker side in the worker that owns the KV cache
(the copies). Everything that crosses a network (the transfer engine's one-sided reads, the KV
store) stays in the epd service, which owns the staging region: a shared-memory file
(kvstore/transfer/memory.py) of fixed-size slots, one vLLM block (every layer's K and V) each,
that the worker maps by its path::

    prefill   request's kv_transfer_params {"epd_save": {"slots": [s0, s1, ...]}}
              the step that completes its prompt ends with its full blocks copied out:
              block i --> slot s_i, every layer (wait_for_save)
    decode    {"epd_load": {"slots": [s0, s1, ...]}}: slot i holds block i of the prompt
              get_num_new_matched_tokens: the full blocks past the local prefix hits that the
              slots cover (at least one token is left to compute: it yields the next logits)
              the request's first step starts with them copied in (start_load_kv)

    slot s (block_bytes bytes):  | layer 0's block | layer 1's block | ... |   in vLLM's layout

The copies are synchronous, inside the step: a prefill's reply (its first token) comes back only
after its blocks are in the slots, and a load lands before the step's forward reads the blocks.
Blocks move as bytes in the layout the worker holds them, so both ends run the same model,
dtype, block size and attention backend (the service checks the block size it was told).
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

logger = logging.getLogger(__name__)

LOAD_KEY, SAVE_KEY = "epd_load", "epd_save"
"""The keys of a request's ``kv_transfer_params`` this connector reads."""


@dataclass
class EpdConnectorMetadata(KVConnectorMetadata):
    """One step's copies: (vLLM block ids, staging slots) pairs, aligned."""

    loads: list[tuple[list[int], list[int]]] = field(default_factory=list)
    saves: list[tuple[list[int], list[int]]] = field(default_factory=list)


@dataclass
class _Save:
    slots: list[int]
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)


class EpdConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = self._kv_transfer_config
        self.block_size = vllm_config.cache_config.block_size
        self.staging_path: str = config.get_from_extra_config("staging_path", "")
        self.block_bytes: int = int(config.get_from_extra_config("block_bytes", 0))
        # scheduler side
        self._loads: dict[str, tuple[list[int], int]] = {}
        """Request id -> (slots to load, first block index): planned, not yet scheduled."""
        self._saves: dict[str, _Save] = {}
        # worker side
        self._blocks: list[tuple[torch.Tensor, int]] = []
        """Each distinct layer's KV cache and the dimension its blocks are indexed by."""
        self._staging: torch.Tensor | None = None

    # ----- scheduler side ----------------------------------------------------------------
    def on_new_request(self, request) -> None:
        params = request.kv_transfer_params or {}
        if SAVE_KEY in params:
            self._saves[request.request_id] = _Save(list(params[SAVE_KEY]["slots"]), request.num_prompt_tokens)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        load = (request.kv_transfer_params or {}).get(LOAD_KEY)
        if not load:
            return 0, False
        slots = list(load["slots"])
        num_full = min(len(slots), (request.num_tokens - 1) // self.block_size)
        first = num_computed_tokens // self.block_size
        if num_full <= first:
            return 0, False
        self._loads[request.request_id] = (slots[first:num_full], first)
        return (num_full - first) * self.block_size, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            self._loads.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = EpdConnectorMetadata()
        steps = [(new.req_id, new.block_ids[0], True, new.num_computed_tokens)
                 for new in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            steps.append((req_id, new_ids[0] if new_ids is not None else [],
                          req_id in cached.resumed_req_ids, cached.num_computed_tokens[i]))
        for req_id, block_ids, replaces, num_computed in steps:
            if (load := self._loads.pop(req_id, None)) is not None:
                slots, first = load
                meta.loads.append((list(block_ids[first:first + len(slots)]), slots))
            if (save := self._saves.get(req_id)) is None:
                continue
            save.block_ids = list(block_ids) if replaces else save.block_ids + list(block_ids)
            if num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0) >= save.num_prompt_tokens:
                del self._saves[req_id]
                num = min(len(save.slots), save.num_prompt_tokens // self.block_size, len(save.block_ids))
                meta.saves.append((save.block_ids[:num], save.slots[:num]))
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._loads.pop(request.request_id, None)
        self._saves.pop(request.request_id, None)
        return False, None

    # ----- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        seen = set()
        for tensor in kv_caches.values():
            if tensor.data_ptr() in seen:  # layers that share another's KV
                continue
            seen.add(tensor.data_ptr())
            dim = next(d for d, size in enumerate(tensor.shape) if size == num_blocks)
            self._blocks.append((tensor, dim))
        layer_bytes = sum(t.select(d, 0).numel() * t.element_size() for t, d in self._blocks)
        if layer_bytes != self.block_bytes:
            raise RuntimeError(f"epd's staging slots hold {self.block_bytes} bytes a block, vLLM's blocks take "
                               f"{layer_bytes} (every layer): the service sized them for another layout")
        fd = os.open(self.staging_path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self._staging = torch.frombuffer(mapping, dtype=torch.uint8)
        logger.info("epd connector: %d KV tensors, %d bytes a block, staging %s", len(self._blocks),
                    layer_bytes, self.staging_path)

    def _slot_views(self, slot: int) -> list[torch.Tensor]:
        """Each layer's part of a staging slot, as a flat byte view."""
        views, offset = [], slot * self.block_bytes
        for tensor, dim in self._blocks:
            size = tensor.select(dim, 0).numel() * tensor.element_size()
            views.append(self._staging[offset:offset + size])
            offset += size
        return views

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for block_ids, slots in meta.loads:
            for block_id, slot in zip(block_ids, slots):
                for (tensor, dim), view in zip(self._blocks, self._slot_views(slot)):
                    block = tensor.select(dim, block_id)
                    block.copy_(view.view(tensor.dtype).view(block.shape))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # the loads are done before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # saved whole, once the step's forward is done

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for block_ids, slots in meta.saves:
            for block_id, slot in zip(block_ids, slots):
                for (tensor, dim), view in zip(self._blocks, self._slot_views(slot)):
                    block = tensor.select(dim, block_id)
                    view.view(tensor.dtype).view(block.shape).copy_(block)
