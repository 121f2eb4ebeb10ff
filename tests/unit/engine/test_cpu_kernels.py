"""The CPU decode-attention kernel against the torch path it replaces (its reference)."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.attention import build_metadata, paged_attention
from services.engine.kernels import cpu

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the torch path is used, tested elsewhere")


@pytest.fixture
def kernel():
    k = cpu.paged_decode()
    assert k is not None, "a C compiler is present but the kernel did not build (see the log)"
    return k


def _random_step(rng: random.Random, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, num_layers: int, chunks: list[tuple[int, int]]):
    """A pool with shuffled block tables and q/k/v for ``chunks`` of (start, num_new_tokens)."""
    need = [-(-(start + n) // block_size) for start, n in chunks]
    ids = list(range(1, sum(need) + 4))
    rng.shuffle(ids)
    tables, at = [], 0
    for k in need:
        tables.append(ids[at:at + k])
        at += k
    kv = torch.randn(max(ids) + 1, num_layers, 2, block_size, num_kv_heads, head_dim)
    total = sum(n for _, n in chunks)
    q = torch.randn(total, num_heads, head_dim)
    k, v = torch.randn(total, num_kv_heads, head_dim), torch.randn(total, num_kv_heads, head_dim)
    return kv, q, k, v, [(start, n, t) for (start, n), t in zip(chunks, tables)]


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (9, 3, 64, 16),   # SmolLM2's shape: the specialised head_dim 64
    (8, 2, 128, 16),  # the specialised head_dim 128
    (4, 4, 16, 4),    # no grouping, the generic entry point
    (6, 2, 24, 8),    # a head_dim that is no multiple of the vector width
])
def test_kernel_matches_the_torch_path(kernel, heads, kv_heads, head_dim, block_size):
    rng = random.Random(heads * head_dim)
    # Decodes of every kind of length (one token, exact multiples of the block, long), plus a
    # fresh prefill and a continued chunk in the same step, which keep their torch path.
    chunks = [(1, 1), (block_size - 1, 1), (block_size, 1), (3 * block_size - 1, 1),
              (rng.randint(50, 400), 1), (0, 7), (2 * block_size + 3, 5), (rng.randint(50, 400), 1)]
    kv, q, k, v, step = _random_step(rng, heads, kv_heads, head_dim, block_size, 3, chunks)
    scale = head_dim ** -0.5
    for layer in range(3):
        torch_meta = build_metadata(step, block_size, 3, torch.device("cpu"))
        expected = paged_attention(q, k, v, kv, layer, torch_meta, scale)
        fused_meta = build_metadata(step, block_size, 3, torch.device("cpu"), kernel)
        assert fused_meta.decodes == [] and fused_meta.decode_batch.rows.tolist() == [0, 1, 2, 3, 4, 17]
        got = paged_attention(q, k, v, kv, layer, fused_meta, scale)
        assert (got - expected).abs().max().item() < 1e-5


def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(kernel):
    rng = random.Random(7)
    chunks = [(rng.randint(20, 300), 1) for _ in range(12)]
    kv, q, k, v, step = _random_step(rng, 9, 3, 64, 16, 2, chunks)
    batch = paged_attention(q, k, v, kv, 1, build_metadata(step, 16, 2, torch.device("cpu"), kernel), 0.125)
    for i in (0, 5, 11):
        alone = paged_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], kv, 1,
                                build_metadata([step[i]], 16, 2, torch.device("cpu"), kernel), 0.125)
        assert torch.equal(alone[0], batch[i])


def test_engine_outputs_are_the_same_with_and_without_the_kernel(tiny_llama_dir, monkeypatch):
    prompts = [[(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate([5, 40, 130, 300])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fused = LLM(str(tiny_llama_dir), num_kv_blocks=256)
    assert fused.engine.runner._decode_kernel is not None
    with_kernel = [o.token_ids for o in fused.generate(prompts, params)]
    monkeypatch.setenv("EPD_CPU_KERNELS", "0")
    cpu.paged_decode.cache_clear()
    try:
        plain = LLM(str(tiny_llama_dir), num_kv_blocks=256)
        assert plain.engine.runner._decode_kernel is None
        assert [o.token_ids for o in plain.generate(prompts, params)] == with_kernel
    finally:
        cpu.paged_decode.cache_clear()


def test_a_failed_build_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    assert cpu._library() is None
    assert "CPU attention kernel unavailable" in caplog.text


def test_the_build_is_cached_and_leaves_floating_point_modes_alone(tmp_path, kernel):
    first = cpu.build(cache_dir=tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu.build(cache_dir=tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind
    # Linking with -ffast-math would have turned on flush-to-zero for the whole process.
    assert (torch.tensor([1e-38]) * torch.tensor([1e-3])).item() != 0.0
