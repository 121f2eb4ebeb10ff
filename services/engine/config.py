"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import check
from services.common.errors import InvalidRequestError
from services.engine.speculative import SpeculativeConfig
from services.engine.threads import parse_cpus


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    """Model name, GGUF file or Hugging Face directory; None is SmolLM2-135M-Instruct."""
    block_size: int = 16
    """Tokens per KV block (and per block hash)."""
    kv_cache_gib: float = 2.0
    """Memory for the KV block pool (pre-allocated and touched at start)."""
    num_kv_blocks: int | None = None
    """Exact pool size in blocks; overrides kv_cache_gib (tests). For a hybrid model, the
    full-attention pool's: its sliding-window pool is sized by rule (kv_groups.num_window_blocks)."""
    max_num_seqs: int = 64
    """Most sequences running at once."""
    max_num_batched_tokens: int = 2048
    """Per-step token budget shared by decodes and prefill chunks."""
    step_time_budget_s: float = 0.0
    """Per-step time budget of chunked prefill; 0: a fixed token budget (max_num_batched_tokens)
    as before. Chunks are sized by the prefill cost model the engine fits from its own steps,
    still capped by max_num_batched_tokens."""
    max_model_len: int | None = None
    """Context limit; defaults to the model's, capped by the pool's capacity."""
    enable_prefix_caching: bool = True
    device: str = "auto"
    """"cpu", "cuda" or "auto" (CUDA when present)."""
    dtype: str = "auto"
    """"float32", "bfloat16", "float16" or "auto": bf16 on CUDA; on the CPU bf16 for a model
    published in 16 bits where the CPU computes bf16 natively and faster than fp32 (AMX, or AMD's
    AVX512_BF16; the C kernels built), else fp32 (model_runner.resolve_dtype)."""
    cpu_threads: str = "off"
    """A CPU engine's compute threads: "auto" (one per CPU of this process's affinity mask, each
    bound to its CPU: for CPUs the engine has to itself, such as a pod's dedicated cpuset), "off"
    (torch's default, unbound: measured no slower on this project's machines, and faster where
    other processes share the cores) or a CPU list such as "0-3,8" (threads.py). In the library
    binding also pins the caller's own thread, and every process it starts later."""
    nice: int = 0
    """Unix priority (nice, 0-19) of the thread that runs the model and of its compute threads;
    the server's threads keep theirs. On CPUs an engine shares, the higher yields (threads.py)."""
    batch_invariant: bool = False
    """Require what the CPU's kernels give by default: every step's arithmetic for a request
    independent of the batch around it, of how its prompt was chunked or cached, and of
    preemption or migration, so the same request gives bit-identical logits alone or in any
    batch, on any instance (model_runner.ModelRunner.is_batch_invariant). Set, the packed
    product runs every step even where ``EPD_CPU_BLAS=mkl`` asks otherwise, and an engine that
    cannot hold it refuses to start (CUDA, torch's path without the C kernels, a bfloat16 the
    CPU does not compute natively, exact_prefill). For evaluation and RL rollouts that must
    replay exactly; free where the default already holds it (benchmarks/engine_throughput.py)."""
    exact_prefill: bool = False
    """Prompts go through exactly the arithmetic transformers runs (MKL's products, torch's SDPA,
    RMSNorm and SiLU), so fp32 prompt logits equal transformers' bit for bit (the oracle tests;
    a one-token prompt to 1e-6 where MKL's one-row product depends on the weight's address).
    Off, where the CPU's kernels run: fresh prompts attend through the kernel that continued
    chunks use and each RMSNorm is one fused pass (~10% faster prefill; logits as far from a
    float64 reference as transformers' own, tests/integration/test_smollm2.py). Within a
    cluster both give the same output everywhere as long as every engine uses the same setting."""
    speculative_config: str = ""
    """Speculative decoding as JSON, vLLM's fields: ``{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``; '' is off.
    Greedy and seeded outputs are the same with and without it (speculative.py)."""

    def __post_init__(self) -> None:
        check(self.block_size > 0, "block_size", "must be > 0")
        check(self.kv_cache_gib > 0, "kv_cache_gib", "must be > 0")
        check(self.num_kv_blocks is None or self.num_kv_blocks > 0, "num_kv_blocks", "must be > 0")
        check(self.max_num_seqs > 0, "max_num_seqs", "must be > 0")
        check(self.max_num_batched_tokens > 0, "max_num_batched_tokens", "must be > 0")
        check(self.step_time_budget_s >= 0, "step_time_budget_s", "must be >= 0 (0: no time budget)")
        check(self.max_model_len is None or self.max_model_len > 1, "max_model_len", "must be > 1")
        check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device",
              "must be auto, cpu or cuda[:N]")
        check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
              "must be auto, float32, bfloat16 or float16")
        check(0 <= self.nice <= 19, "nice", "must be in 0..19 (a higher value yields the CPU to others)")
        try:
            parse_cpus(self.cpu_threads)
        except InvalidRequestError as exc:
            check(False, "cpu_threads", str(exc))
        try:
            SpeculativeConfig.parse(self.speculative_config)
        except InvalidRequestError as exc:
            check(False, "speculative_config", str(exc))

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)
