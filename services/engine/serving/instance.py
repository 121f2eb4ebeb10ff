"""What a prefill or decode instance is made of: the engine thread, its KV pool registered as a
memory region (or, for a pool peers cannot reach, a host staging region registered instead), the
transfer engine that lets peers read (or write) that memory one-sided, and the
:class:`EngineSeam` its worker and store connector reach the engine through.

Shared by the prefill and decode services so both register their pool the same way.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import math
import sys
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore.swa import DEFAULT_SWA_TTL_S
from kvstore.transfer.engine import TRANSPORT_CHOICES, TransferEngine
from kvstore.transfer.memory import MemoryRegion
from services.common.config import check
from services.common.instance_rpcs import ReportNow
from services.common.metrics import restart_count
from services.common.server import ServerOptions, serve
from services.common.tokenizer import read_tokenizer_config
from services.common.errors import InvalidRequestError
from services.common.wire import LoadReport, ModelInfo, RequestSpec, TensorBytes
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.models.loader import load_model
from services.engine.sequence import MultiModalInput
from services.engine.serving.async_engine import AsyncEngine
from services.engine.serving.seam import EngineSeam
from services.engine.serving.staging import StagingArea
from services.engine.serving.store_connector import StoreConnector
from services.engine.serving.swa_tier import SWATier

logger = logging.getLogger(__name__)
KV_STAGING_CHOICES = ("auto", "on", "off")
ENGINE_CHOICES = ("epd", "vllm")
"""Engines a prefill or decode instance can run (each service's ``WORKERS`` names their workers)."""


@dataclass(frozen=True)
class ServingConfig(EngineConfig, ServerOptions):
    """Settings every engine service (prefill, decode) has: the engine's, the server's, the
    transfer engine's. Each service subclasses it with its own default ports."""

    instance_id: str = ""
    """Name in load reports and logs; empty: the role and a random suffix."""
    engine: str = "epd"
    """What computes: epd (this project's engine, the default) or vllm (vLLM's engine with epd's KV
    connector, for the models it runs: MoE, quantized, LoRA...; it runs in vLLM's own venv: make
    setup-vllm, then this service under .venv-vllm/bin/python). The gRPC contract, load reports
    and drain are the same either way."""
    engine_args: str = ""
    """For --engine vllm: a JSON object of vLLM's engine arguments (AsyncEngineArgs), over those
    the other flags set: {"quantization": "fp8", "enable_lora": true, "max_loras": 4, ...}."""
    transfer_port: int = 0
    """TCP port of the KV data server peers on other hosts read from; 0 picks a free one."""
    kv_transport: str = "auto"
    """How this instance reads KV from peers and the store: auto (shared memory on one host, TCP
    across hosts), or one transport always: shm, tcp, or nixl (NIXL over UCX, where installed)."""
    advertise_host: str = ""
    """Host name peers use to reach this instance; empty: the bind host."""
    image_token_id: int = 0
    """Token id of image placeholder positions (their embeddings come from the encoder)."""
    kvstore: tuple[str, ...] = ()
    """gRPC addresses of KV store nodes (with a shared Redis index, any one is enough); none:
    no store, only this instance's own prefix cache."""
    kvstore_replicas: int = 1
    """Store nodes each written block goes to (2 survives the loss of a node)."""
    kvstore_timeout_s: float = 1.0
    """Deadline of a store lookup or acquire (on a request's path: a frozen store node costs at
    most this, then is skipped for a back-off)."""
    kv_staging: str = "auto"
    """Move KV through a host staging region: auto (exactly when the pool is device memory, which
    the transports cannot reach), on (always: on the CPU the pool is then a plain tensor, as on
    CUDA; a test mode), off (never: a device pool hands over no KV and decode recomputes)."""
    kv_staging_mib: int = 256
    """Size of the staging region (at most the pool's size): KV of hand-overs not yet read and of
    store reads and writes in flight; when it is full they fall back to recompute."""
    swa_capacity_mib: int = 256
    """Host memory for the sliding windows this instance keeps for other instances to read (a
    hybrid model with a KV store: the SWA tier, swa_tier.py): at least one window and at most
    1,024; when full, the expired ones go first, then the least recently used."""
    swa_ttl_s: float = DEFAULT_SWA_TTL_S
    """How long this instance keeps a window unless evicted (the store's --swa-ttl-s names it
    for as long as its own)."""

    def __post_init__(self) -> None:
        EngineConfig.__post_init__(self)
        ServerOptions.__post_init__(self)
        check(0 <= self.transfer_port <= 65535, "transfer_port", "must be in 0..65535 (0: a free port)")
        check(self.kv_transport in TRANSPORT_CHOICES, "kv_transport", f"must be one of {', '.join(TRANSPORT_CHOICES)}")
        check(self.kvstore_replicas >= 1, "kvstore_replicas", "must be >= 1")
        check(self.kvstore_timeout_s > 0, "kvstore_timeout_s", "must be > 0")
        check(self.kv_staging in KV_STAGING_CHOICES, "kv_staging", f"must be one of {', '.join(KV_STAGING_CHOICES)}")
        check(self.kv_staging_mib >= 1, "kv_staging_mib", "must be >= 1")
        check(self.engine in ENGINE_CHOICES, "engine", f"must be one of {', '.join(ENGINE_CHOICES)}")
        check(self.engine != "vllm" or importlib.util.find_spec("vllm") is not None, "engine",
              f"vllm: this Python ({sys.executable}) has no vLLM; it lives in a venv of its own: run "
              "`make setup-vllm`, then start this service with .venv-vllm/bin/python")
        check(not self.engine_args or self.engine == "vllm", "engine_args", "is for --engine vllm only")
        check(self.swa_capacity_mib >= 1, "swa_capacity_mib", "must be >= 1")
        check(self.swa_ttl_s > 0, "swa_ttl_s", "must be > 0")


class EngineInstance:
    def __init__(self, config: ServingConfig, role: str) -> None:
        engine_config = config
        self.role = role
        self.instance_id = config.instance_id or f"{role}-{uuid.uuid4().hex[:8]}"
        self.report_now = ReportNow()
        """Sends the load watches a report at once (the drain's start)."""
        loaded = load_model(engine_config.model)
        # A vision-language checkpoint names its own placeholder (issue 20); the flag is for others.
        self.image_token_id = (config.image_token_id if loaded.config.image_token_id is None
                               else loaded.config.image_token_id)
        self.model_path = Path(loaded.path)
        self.region: MemoryRegion | None = None
        self.staging: StagingArea | None = None
        # A CUDA pool lives in device memory, which shared memory and sockets cannot reach
        # directly; such an instance moves KV through a host staging region, or (staging off)
        # falls back to recompute on the decode side (see docs).
        on_cuda = engine_config.device.startswith("cuda") or _cuda_auto(engine_config)
        is_staged = config.kv_staging == "on" or (config.kv_staging == "auto" and on_cuda)
        allocator = self._allocate_region if not on_cuda and not is_staged else None
        self.llm = LLMEngine(engine_config, loaded, kv_allocator=allocator)
        self.engine = AsyncEngine(self.llm)
        self.transfer = TransferEngine(host=config.host, port=config.transfer_port,
                                       transports=TRANSPORT_CHOICES[config.kv_transport],
                                       advertise_host=config.advertise_host)
        if self.region is not None:
            self.transfer.register(self.region)
        if is_staged:
            pool_bytes = self.llm.kv_block_bytes * self.llm.block_manager.num_blocks
            self.staging = StagingArea.allocate(min(config.kv_staging_mib * 2**20, pool_bytes), self.llm.kv_block_bytes,
                                                region_id=f"{self.instance_id}-staging", pin=on_cuda)
            self.transfer.register(self.staging.region)
            logger.info("KV moves through a host staging region of %d blocks", self.staging.slots.num_slots)
        self.seam = EngineSeam(self.engine, self.transfer, self.region.region_id if self.region else None,
                               self.staging)
        self.store: StoreConnector | None = None
        if config.kvstore:
            from services.kvstore.client import StoreClient

            client = StoreClient(config.kvstore, config.kvstore_replicas, timeout_s=config.kvstore_timeout_s)
            swa = None
            if self.seam.sliding_window is not None and self.region is not None:
                swa = SWATier(self.seam, self.transfer, client, self.instance_id,
                              SWATier.windows_in(self.seam, config.swa_capacity_mib << 20), config.swa_ttl_s)
            self.store = StoreConnector(self.seam, client, swa)

    def _allocate_region(self, num_bytes: int):
        self.region = MemoryRegion.allocate(num_bytes, region_id=f"{self.instance_id}-kv")
        return self.region.buffer

    def start(self) -> None:
        self.engine.start()

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()
        await self.engine.stop()
        self.transfer.close()
        if self.region is not None:
            self.region.close()
        if self.staging is not None:
            self.staging.close()

    async def watch_engine(self, period_s: float = 0.2) -> None:
        """Returns only when the engine thread has died (the server then exits non-zero)."""
        while self.engine.error is None:
            await asyncio.sleep(period_s)
        logger.error("the engine died: %r", self.engine.error)

    def model_info(self) -> ModelInfo:
        cfg, path = self.llm.model_config, self.model_path
        tokenizer_json = path / "tokenizer.json"
        return ModelInfo(
            model_name=cfg.name, max_model_len=self.llm.max_model_len, vocab_size=cfg.vocab_size,
            block_size=self.llm.config.block_size, eos_token_ids=tuple(self.llm.eos_token_ids),
            tokenizer_json=tokenizer_json.read_text() if tokenizer_json.exists() else "",
            # The router's tokenizer is built from these (the chat template included), so it reads
            # the directory as the engine's loader does.
            tokenizer_config_json=json.dumps(read_tokenizer_config(path)),
            image_token_id=self.image_token_id, hidden_size=cfg.hidden_size)

    def load_report(self, **extra) -> LoadReport:
        stats = self.engine.stats
        samples = tuple(seconds for _, seconds in self.engine.step_time_samples)
        return LoadReport(
            instance_id=self.instance_id, role=self.role, num_running=stats.num_running + stats.num_held,
            num_waiting=stats.num_waiting, num_queued_prefill_tokens=stats.num_queued_prefill_tokens,
            num_kv_tokens_in_use=stats.num_kv_tokens_in_use, num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks, step_time_samples_s=samples,
            queued_prefill_compute_s=stats.queued_prefill_compute_s, num_restarts=restart_count(), **extra)


async def serve_instance(instance: EngineInstance, config: ServingConfig, worker,
                         add_servicers: Callable[[Any], None], service_name: str,
                         background: tuple[Coroutine, ...] = (),
                         until_settled: Callable[[], Awaitable[None]] | None = None) -> int:
    """Run an engine service until it is told to stop: the engine thread, the gRPC server (on
    drain the worker stops taking requests, and ``until_settled`` waits for what it lent), and
    the watch that exits when the engine dies."""
    instance.start()

    async def on_drain() -> None:
        worker.is_draining = True
        instance.report_now()  # the routers stop sending here now, not up to an interval later

    try:
        return await serve(add_servicers, ServerOptions.from_config(config), service_name, on_drain=on_drain,
                           until_settled=until_settled, background=[*background, instance.watch_engine()])
    finally:
        await instance.close()


def mm_inputs(spec: RequestSpec) -> tuple[MultiModalInput, ...]:
    """The spec's image embeddings as tensors the engine splices in."""
    return tuple(MultiModalInput(image.position, tensor_from_bytes(image.embeddings), image.image_hash.hex())
                 for image in spec.images)


def tensor_from_bytes(t: TensorBytes) -> torch.Tensor:
    dtype = getattr(torch, t.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequestError(f"unknown tensor dtype {t.dtype!r}")
    expected = math.prod(t.shape) * dtype.itemsize
    if len(t.data) != expected:
        raise InvalidRequestError(f"a tensor of shape {list(t.shape)} and dtype {t.dtype} needs "
                                  f"{expected} bytes, not {len(t.data)}")
    return torch.frombuffer(bytearray(t.data), dtype=dtype).view(t.shape)


def _cuda_auto(config: EngineConfig) -> bool:
    return config.device == "auto" and torch.cuda.is_available()
