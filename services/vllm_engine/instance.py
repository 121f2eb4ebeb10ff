"""What a prefill or decode instance with vLLM as its engine is made of: vLLM's AsyncLLM (its
engine core and worker run as child processes), the staging region its KV blocks move through
(shared memory, one slot per vLLM block, mapped by the KV connector inside vLLM's worker), and
the transfer engine that lets peers read (or write) that region one-sided, exactly as an epd
engine's instance lends its pool (services/engine/serving/instance.py).

The instance answers the same RPCs as an epd engine's (model info, load reports, drain), so the
router, planner and admin API do not see which engine runs behind it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from pathlib import Path

from kvstore.transfer.engine import TRANSPORT_CHOICES, TransferEngine
from services.common.config import ConfigError, check
from services.common.instance_rpcs import ReportNow
from services.common.metrics import restart_count
from services.common.tokenizer import read_tokenizer_config
from services.common.wire import LoadReport, ModelInfo
from services.engine.models.loader import resolve_model_dir
from services.engine.serving.instance import ServingConfig
from services.engine.serving.staging import StagingArea

logger = logging.getLogger(__name__)
CONNECTOR_MODULE = "services.vllm_engine.connector"


class SchedulerLoad:
    """vLLM's stat logger that keeps the engine core's latest scheduler figures for load reports."""

    latest = None
    """The last SchedulerStats any engine core of this process reported (one engine core here)."""

    def __init__(self, vllm_config, engine_index: int = 0) -> None:
        pass

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            SchedulerLoad.latest = scheduler_stats

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def engine_args(config: ServingConfig, model_dir: str):
    """vLLM's AsyncEngineArgs for an instance: epd's engine fields where vLLM has them (the
    device is vLLM's platform: its CPU build on the CPU, its CUDA build on a GPU), then
    ``--engine-args`` (JSON of AsyncEngineArgs fields: tensor_parallel_size, quantization,
    enable_lora, ...), which win."""
    from vllm import AsyncEngineArgs

    try:
        extra = json.loads(config.engine_args) if config.engine_args else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"engine_args (--engine-args, EPD_*_ENGINE_ARGS): not JSON: {exc}") from None
    check(isinstance(extra, dict), "engine_args", "must be a JSON object of vLLM's engine arguments")
    from vllm.config import KVTransferConfig

    # The connector's staging region is set once the region exists (VllmInstance), in this dict.
    connector = KVTransferConfig(kv_connector="EpdConnector", kv_connector_module_path=CONNECTOR_MODULE,
                                 kv_role="kv_both", kv_connector_extra_config={})
    fields = dict(model=model_dir, tokenizer=model_dir, dtype=config.dtype, block_size=config.block_size,
                  max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                  enable_prefix_caching=config.enable_prefix_caching, seed=0,
                  kv_cache_memory_bytes=int(config.kv_cache_gib * 2**30), kv_transfer_config=connector)
    if config.max_model_len is not None:
        fields["max_model_len"] = config.max_model_len
    try:
        return AsyncEngineArgs(**{**fields, **extra})
    except TypeError as exc:
        raise ConfigError(f"engine_args (--engine-args): {exc}") from None


def block_bytes(model_config, block_size: int) -> int:
    """One vLLM block of every attention layer's K and V, as the connector copies it (one worker
    holds every KV head: the connector refuses a layout that differs)."""
    return (model_config.hf_text_config.num_hidden_layers * 2 * block_size * model_config.get_total_num_kv_heads()
            * model_config.get_head_size() * model_config.dtype.itemsize)


class VllmInstance:
    def __init__(self, config: ServingConfig, role: str) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self.role = role
        self.config = config
        self.instance_id = config.instance_id or f"{role}-{uuid.uuid4().hex[:8]}"
        self.report_now = ReportNow()
        path, self.model_name = resolve_model_dir(config.model or None)
        self.model_path = Path(path)
        args = engine_args(config, str(self.model_path))
        vllm_config = args.create_engine_config()
        if args.max_model_len is None:
            # As epd's engine does: the model's context, capped by what the pool holds (vLLM
            # refuses to start with a pool shorter than the model's context).
            size = vllm_config.cache_config.block_size
            num_blocks = int(config.kv_cache_gib * 2**30) // block_bytes(vllm_config.model_config, size)
            fits = (num_blocks - 1) * size  # vLLM keeps one block back (its null block)
            if fits < vllm_config.model_config.max_model_len:
                args.max_model_len = fits
                vllm_config = args.create_engine_config()
        check(vllm_config.parallel_config.world_size == 1, "engine_args",
              f"tensor / pipeline parallel vLLM instances ({vllm_config.parallel_config.world_size} workers) "
              "cannot hand KV over through epd's connector yet: one worker per instance")
        self.block_size = vllm_config.cache_config.block_size
        self.block_bytes = block_bytes(vllm_config.model_config, self.block_size)
        self.staging = StagingArea.allocate(config.kv_staging_mib * 2**20, self.block_bytes,
                                            region_id=f"{self.instance_id}-vllm-staging")
        self.transfer = TransferEngine(host=config.host, port=config.transfer_port,
                                       transports=TRANSPORT_CHOICES[config.kv_transport],
                                       advertise_host=config.advertise_host)
        self.transfer.register(self.staging.region)
        vllm_config.kv_transfer_config.kv_connector_extra_config.update(
            staging_path=self.staging.region.desc.shm_path, block_bytes=self.block_bytes)
        self.vllm_config = vllm_config
        self.llm = AsyncLLM.from_vllm_config(vllm_config, stat_loggers=[SchedulerLoad])
        self.num_blocks = vllm_config.cache_config.num_gpu_blocks or 0
        self.num_in_flight = 0
        """Requests this instance has given vLLM and not seen finish."""
        logger.info("vLLM engine ready: %s, %s, block size %d (%d bytes, every layer), %d KV blocks, staging "
                    "%d slots", self.model_path.name, vllm_config.model_config.dtype, self.block_size,
                    self.block_bytes, self.num_blocks, self.staging.slots.num_slots)

    def start(self) -> None:
        pass  # AsyncLLM runs from its construction

    async def close(self) -> None:
        self.llm.shutdown()
        self.transfer.close()
        self.staging.close()

    async def watch_engine(self, period_s: float = 0.5) -> None:
        """Returns only when vLLM's engine has died (the server then exits non-zero)."""
        while not self.llm.errored:
            await asyncio.sleep(period_s)
        logger.error("vLLM's engine died: %r", self.llm.dead_error)

    def model_info(self) -> ModelInfo:
        model = self.vllm_config.model_config
        path = self.model_path
        tokenizer_json = path / "tokenizer.json"
        eos = model.hf_config.eos_token_id if hasattr(model.hf_config, "eos_token_id") else None
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return ModelInfo(
            model_name=self.model_name,
            max_model_len=model.max_model_len, vocab_size=model.get_vocab_size(), block_size=self.block_size,
            eos_token_ids=eos_ids, tokenizer_json=tokenizer_json.read_text() if tokenizer_json.exists() else "",
            tokenizer_config_json=json.dumps(read_tokenizer_config(path)), image_token_id=None,
            hidden_size=model.get_hidden_size())

    def load_report(self, **extra) -> LoadReport:
        stats = SchedulerLoad.latest
        usage = stats.kv_cache_usage if stats is not None else 0.0
        used = round(usage * self.num_blocks)
        return LoadReport(
            instance_id=self.instance_id, role=self.role,
            num_running=stats.num_running_reqs if stats is not None else self.num_in_flight,
            num_waiting=stats.num_waiting_reqs if stats is not None else 0,
            num_kv_tokens_in_use=used * self.block_size, num_free_blocks=self.num_blocks - used,
            num_total_blocks=self.num_blocks, num_restarts=restart_count(), **extra)
