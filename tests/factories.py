"""Test factories: tiny random Hugging Face models saved the way users ship them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvstore.transfer import KVHandle, MemoryRegion, TransferEngine

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False, initializer_range=0.05)


def make_tiny_model_dir(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random Llama, Qwen2 or Qwen3-MoE checkpoint (config.json + model.safetensors) under ``path``."""
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        # a mixture of experts (epd's engine does not run it; vLLM does: --engine vllm)
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[arch]
    cfg = cfg_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    if arch == "qwen2":  # random init leaves biases at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.05)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_chat_model_dir(path: Path, tokenizer_dir: Path, seed: int = 0, arch: str = "llama",
                             **overrides) -> Path:
    """A tiny random Llama (or ``arch``, with config ``overrides``) that speaks through a real
    tokenizer (copied from ``tokenizer_dir``): its vocabulary is the tokenizer's, so chat
    templates, text and stop strings all work."""
    import json
    import shutil

    tokenizer_dir = Path(tokenizer_dir)
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    make_tiny_model_dir(path, arch, seed=seed, vocab_size=vocab, tie_word_embeddings=True, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


TINY_MOE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256,
                moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
"""A tiny Qwen3-MoE (4 experts, 2 a token) whose heads vLLM's CPU attention takes (head_dim 64)."""


class ManualClock:
    """A clock tests move by hand (``clock.now += 10``), for the code that takes one."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def random_prompts(n: int, lengths: list[int], vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ids from 3 up: 0-2 are special (pad/bos/eos) in the tiny configs.
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths[:n]]


BLOCK = 4096
"""Block size of the KV store tests' blocks (real engines' are bigger; the store does not care)."""


class KVWriter:
    """An engine-like owner of blocks: a registered region and handles over its blocks."""

    def __init__(self, transfer: TransferEngine, num_blocks: int = 64) -> None:
        self.transfer = transfer
        self.region = MemoryRegion.allocate(num_blocks * BLOCK)
        transfer.register(self.region)
        rng = np.random.default_rng(0)
        self.region.buffer[:] = rng.integers(0, 256, num_blocks * BLOCK, dtype=np.uint8)

    def block(self, i: int) -> np.ndarray:
        return self.region.buffer[i * BLOCK:(i + 1) * BLOCK]

    def handle(self, blocks: range) -> KVHandle:
        return self.transfer.export(self.region.region_id, [(i * BLOCK, BLOCK) for i in blocks], "put")


def random_paged_step(rng, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, num_layers: int,
                      chunks: list[tuple[int, int]]):
    """(kv pool, q, k, v, block tables) for ``chunks`` of (start, num_new_tokens): a pool
    ``[blocks, layers, 2, block_size, kv_heads, head_dim]`` with shuffled block tables, every
    tensor drawn from a generator seeded by ``rng`` (a random.Random)."""
    need = [-(-(start + n) // block_size) for start, n in chunks]
    ids = list(range(1, sum(need) + 4))
    rng.shuffle(ids)
    tables, at = [], 0
    for k in need:
        tables.append(ids[at:at + k])
        at += k
    gen = torch.Generator().manual_seed(rng.randint(0, 1 << 30))
    kv = torch.randn(max(ids) + 1, num_layers, 2, block_size, num_kv_heads, head_dim, generator=gen)
    total = sum(n for _, n in chunks)
    q = torch.randn(total, num_heads, head_dim, generator=gen)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    return kv, q, k, v, tables


def machine_dtypes() -> list[str]:
    """The precisions a test of a guarantee runs in on this machine: float32 always, and
    bfloat16 wherever the CPU computes it natively (the kernels' packed bf16 product built:
    AVX512_BF16, on AMX's tiles where the CPU has them). What ``--dtype auto`` picks on the CPU
    is one of the two, so it is covered wherever it is chosen."""
    from services.engine.kernels import cpu

    kernels = cpu.kernels()
    return ["float32"] + (["bfloat16"] if kernels is not None and kernels.packs_bf16 else [])
