"""The Triton kernels (paged decode and prefill attention, RoPE with the K/V store), run on the
CPU by Triton's interpreter, against an explicit fp32 reference and the torch path they replace
on CUDA. Shapes are small: the interpreter runs each program in Python."""

from __future__ import annotations

import os
import random
from collections import Counter

# Before triton is imported anywhere: kernels decorated without it would need a GPU.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (it is pinned in requirements.txt)")

from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.attention import build_metadata, paged_attention, store_kv  # noqa: E402
from services.engine.kernels import cpu  # noqa: E402
from services.engine.kernels import select as kernel_select  # noqa: E402
from services.engine.kernels import triton_attention, triton_rope  # noqa: E402
from services.engine.models.llama import rotate_half  # noqa: E402
from tests.factories import random_paged_step  # noqa: E402

TOLERANCE = 1e-5
CPU = torch.device("cpu")


def _reference(q: torch.Tensor, kv: torch.Tensor, layer: int, chunks: list[tuple[int, int]],
               tables: list[list[int]], scale: float) -> torch.Tensor:
    """Causal attention of each chunk's new tokens over positions 0..its own, read token by
    token from the pool, in float64."""
    num_heads, num_kv_heads = q.shape[1], kv.shape[4]
    block_size = kv.shape[3]
    out, first = torch.empty_like(q), 0
    for (start, n), table in zip(chunks, tables):
        positions = range(start + n)
        keys = torch.stack([kv[table[p // block_size], layer, 0, p % block_size] for p in positions]).double()
        values = torch.stack([kv[table[p // block_size], layer, 1, p % block_size] for p in positions]).double()
        group = num_heads // num_kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [ctx, H, D]
        scores = torch.einsum("thd,chd->htc", q[first:first + n].double(), keys) * scale
        allowed = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[first:first + n] = torch.einsum("htc,chd->thd", probs, values).float()
        first += n
    return out


SHAPES = [  # heads, kv_heads, head_dim, block_size: GQA ratios 1, 2, 4; block sizes 16 and 8
    (4, 4, 64, 16),
    (4, 2, 64, 16),
    (8, 2, 32, 8),
    (6, 3, 32, 16),  # a group of 2 heads among 3 KV heads
]


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", SHAPES)
def test_decode_matches_the_reference(heads, kv_heads, head_dim, block_size):
    rng = random.Random(heads * head_dim + block_size)
    # Context lengths (the new token included) of 1, a block exactly, a block and one, odd, two
    # blocks: several sequences of different lengths in one call.
    lengths = [1, block_size, block_size + 1, 31, 2 * block_size, 17]
    chunks = [(n - 1, 1) for n in lengths]
    kv, q, _, _, tables = random_paged_step(rng, heads, kv_heads, head_dim, block_size, 2, chunks)
    # Built by hand: build_metadata makes a one-token context a fresh prompt, not a decode.
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    rows, out = torch.arange(len(lengths)), torch.zeros_like(q)
    triton_attention.paged_decode(q, out, kv, 1, rows, padded, torch.tensor(lengths), head_dim ** -0.5)
    expected = _reference(q, kv, 1, chunks, tables, head_dim ** -0.5)
    assert (out - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", SHAPES)
def test_prefill_matches_the_reference(heads, kv_heads, head_dim, block_size):
    rng = random.Random(heads * head_dim + block_size)
    # An empty context (a fresh chunk), a continued chunk starting on a block edge, one starting
    # mid-block, chunks ending on an edge or not, one longer than a tile of rows, one token.
    chunks = [(0, 7), (block_size, block_size), (5, 12), (17, 31), (2 * block_size, 70), (31, 1)]
    kv, q, k, v, tables = random_paged_step(rng, heads, kv_heads, head_dim, block_size, 2, chunks)
    step = [(s, n, t) for (s, n), t in zip(chunks, tables)]
    store_kv(k, v, kv, 0, build_metadata(step, block_size, 2, CPU))
    firsts = [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    spans = torch.tensor([[f, n, s] for f, (s, n) in zip(firsts, chunks)])
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = torch.zeros_like(q)
    triton_attention.paged_prefill(q, out, kv, 0, spans, padded, head_dim ** -0.5)
    expected = _reference(q, kv, 0, chunks, tables, head_dim ** -0.5)
    assert (out - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("window", [0, 6], ids=["full", "sliding"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", SHAPES[1:3])
def test_attention_with_the_kernels_matches_the_torch_path(heads, kv_heads, head_dim, block_size, window):
    rng = random.Random(11)
    # Decodes, fresh prompts (SDPA in both) and continued chunks, interleaved in one step.
    chunks = [(0, 1), (block_size - 1, 1), (0, 9), (block_size, 1), (block_size + 3, 20), (30, 1), (8, 8)]
    kv, q, k, v, tables = random_paged_step(rng, heads, kv_heads, head_dim, block_size, 3, chunks)
    step = [(s, n, t) for (s, n), t in zip(chunks, tables)]
    scale = head_dim ** -0.5
    torch_meta = build_metadata(step, block_size, 3, CPU)
    store_kv(k, v, kv, 2, torch_meta)
    expected = paged_attention(q, k, v, kv, 2, torch_meta, scale, window)
    meta = build_metadata(step, block_size, 3, CPU, triton_attention.TritonKernels())
    assert meta.decodes == [] and meta.decode_batch.rows.tolist() == [1, 11, 32]
    assert meta.prefill_batch.spans.tolist() == [[12, 20, block_size + 3], [33, 8, 8]]
    assert [(s.token_start, s.num_tokens) for s in meta.spans] == [(0, 1), (2, 9)]
    got = paged_attention(q, k, v, kv, 2, meta, scale, window)
    assert (got - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(9, 3, 64, 16), (4, 4, 32, 8)])
def test_rope_store_matches_the_torch_lines(heads, kv_heads, head_dim, block_size):
    rng = random.Random(head_dim)
    chunks = [(0, 9), (37, 1), (5, 20)]
    kv, _, _, _, tables = random_paged_step(rng, heads, kv_heads, head_dim, block_size, 3, chunks)
    num_tokens = sum(n for _, n in chunks)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim) * 3
    positions = torch.cat([torch.arange(s, s + n) for s, n in chunks])
    freqs = positions.float()[:, None] * (1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    meta = build_metadata([(s, n, t) for (s, n), t in zip(chunks, tables)], block_size, 3, CPU)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(num_tokens, -1, head_dim) for t in (q, k, v))
    expected_q, expected_k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    expected_kv = kv.clone()
    store_kv(expected_k, v, expected_kv, 2, meta)
    got_q, got_k = triton_rope.rope_store(qkv, cos, sin, kv, meta.slot_rows, *meta.token_row_offsets(2), heads)
    assert (got_q - expected_q).abs().max().item() <= TOLERANCE
    assert (got_k - expected_k).abs().max().item() <= TOLERANCE
    assert (kv - expected_kv).abs().max().item() <= TOLERANCE


def test_the_engine_generates_the_same_tokens_with_the_triton_kernels(tiny_llama_dir, monkeypatch):
    prompts = [[(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate([5, 40])]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    monkeypatch.setenv("EPD_CPU_KERNELS", "0")  # the reference: torch's path
    cpu.kernels.cache_clear()
    try:
        plain = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_num_batched_tokens=16)
    finally:
        cpu.kernels.cache_clear()  # not None for the tests after this one
    assert plain.engine.runner.attention_backend == "torch"
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    # What the selection gives on CUDA, forced here on the CPU (the interpreter runs it).
    monkeypatch.setattr(kernel_select, "attention_backend", lambda device, dtype: "triton")
    calls = Counter()

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    chosen = kernel_select.kernels_for("triton")
    assert isinstance(chosen, triton_attention.TritonKernels)
    spied = triton_attention.TritonKernels(*(counted(f, getattr(chosen, f))
                                             for f in ("paged_decode", "paged_prefill", "rope_store")))
    monkeypatch.setattr(kernel_select, "kernels_for", lambda backend: spied if backend == "triton" else None)
    # A small token budget, so the longer prompt is continued across steps (the prefill kernel).
    fused = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_num_batched_tokens=16)
    assert fused.engine.runner._kernels is spied
    assert [o.token_ids for o in fused.generate(prompts, params)] == expected
    assert min(calls[f] for f in ("paged_decode", "paged_prefill", "rope_store")) > 0
