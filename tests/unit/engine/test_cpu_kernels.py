"""The CPU kernels (decode and prefill attention, RoPE with the K/V store, the residual add with
RMSNorm) against the torch path they replace (their reference)."""

from __future__ import annotations

import platform
import random

import pytest
import torch
import torch.nn.functional as F

from services.engine import LLM, SamplingParams
from services.engine.attention import build_metadata, paged_attention, store_kv
from services.engine.kernels import cpu
from services.engine.models.llama import RMSNorm, rotate_half
from tests.factories import random_paged_step

pytestmark = pytest.mark.skipif(cpu._compiler() is None, reason="no C compiler: the torch path is used, tested elsewhere")


def _random_step(rng: random.Random, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, num_layers: int, chunks: list[tuple[int, int]]):
    """A random pool and q/k/v for ``chunks``, with the step as (start, num_new_tokens, table)."""
    kv, q, k, v, tables = random_paged_step(rng, num_heads, num_kv_heads, head_dim, block_size, num_layers, chunks)
    return kv, q, k, v, [(start, n, t) for (start, n), t in zip(chunks, tables)]


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size, window", [
    (9, 3, 64, 16, 0),   # SmolLM2's shape: the specialised head_dim 64
    (8, 2, 128, 16, 0),  # the specialised head_dim 128
    (4, 4, 16, 4, 0),    # no grouping, the generic entry point
    (6, 2, 24, 8, 0),    # a head_dim that is no multiple of the vector width
    (9, 3, 64, 16, 21),  # sliding-window layers: windows across block edges, shorter and
    (4, 4, 16, 4, 5),    # longer than chunks and tiles
])
def test_kernels_match_the_torch_path(kernels, heads, kv_heads, head_dim, block_size, window):
    rng = random.Random(heads * head_dim)
    # Decodes of every kind of length (one token, exact multiples of the block, long); prompts
    # fresh and continued, of one token, of less than a tile, of many tiles, ending on a block
    # edge or not; all in one step.
    decodes = [(1, 1), (block_size - 1, 1), (block_size, 1), (3 * block_size - 1, 1),
               (rng.randint(50, 400), 1)]
    prefills = [(0, 7), (2 * block_size + 3, 5), (0, 1), (0, 4 * block_size), (block_size, 1 + 2 * block_size),
                (rng.randint(20, 200), rng.randint(100, 300))]
    chunks = decodes[:3] + prefills[:3] + decodes[3:] + prefills[3:]
    kv, q, k, v, step = _random_step(rng, heads, kv_heads, head_dim, block_size, 3, chunks)
    scale = head_dim ** -0.5
    firsts = [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    for layer in range(3):
        torch_meta = build_metadata(step, block_size, 3, torch.device("cpu"))
        store_kv(k, v, kv, layer, torch_meta)
        expected = paged_attention(q, k, v, kv, layer, torch_meta, scale, window)
        fused_meta = build_metadata(step, block_size, 3, torch.device("cpu"), kernels)
        assert fused_meta.decodes == [] and not fused_meta.decode_only
        assert fused_meta.decode_batch.rows.tolist() == [firsts[i] for i in (0, 1, 2, 6, 7)]
        # Fresh prompts stay on SDPA (transformers' own sums); continued chunks go to the kernel.
        assert [(s.token_start, s.num_tokens) for s in fused_meta.spans] == [
            (firsts[i], n) for i, (start, n) in enumerate(chunks) if (start, n) in prefills and start == 0]
        assert fused_meta.prefill_batch.spans.tolist() == [
            [firsts[i], n, start] for i, (start, n) in enumerate(chunks) if (start, n) in prefills and start > 0]
        got = paged_attention(q, k, v, kv, layer, fused_meta, scale, window)
        assert (got - expected).abs().max().item() < 1e-5
        # Unless asked to send fresh prompts to the kernel too (the default outside exact_prefill).
        all_meta = build_metadata(step, block_size, 3, torch.device("cpu"), kernels, fresh_in_kernel=True)
        assert all_meta.spans == [] and all_meta.prefill_batch.spans.tolist() == [
            [firsts[i], n, start] for i, (start, n) in enumerate(chunks) if (start, n) in prefills]
        got = paged_attention(q, k, v, kv, layer, all_meta, scale, window)
        assert (got - expected).abs().max().item() < 1e-5



@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(9, 3, 64, 16), (6, 2, 24, 8)])
def test_bf16_kernels_round_the_fp32_result_on_the_same_values(kernels, heads, kv_heads, head_dim, block_size):
    """bfloat16 in and out, float inside: each kernel row is the float32 path's result on the
    same (bfloat16) values, rounded once (within half a bfloat16 ulp, and ~1e-6 of sums)."""
    rng = random.Random(head_dim + 1)
    chunks = [(1, 1), (block_size, 1), (rng.randint(50, 300), 1), (0, 7), (2 * block_size + 3, 5),
              (block_size, 1 + 2 * block_size)]
    kv, q, k, v, step = _random_step(rng, heads, kv_heads, head_dim, block_size, 3, chunks)
    kv, q, k, v = (t.bfloat16() for t in (kv, q, k, v))
    scale, cpu_ = head_dim ** -0.5, torch.device("cpu")
    fresh = torch.zeros(q.shape[0], dtype=torch.bool)
    fresh[3:10] = True  # the fresh prompt's rows: torch's SDPA in bfloat16, not a kernel
    for layer in range(3):
        kv32 = kv.float()
        reference = build_metadata(step, block_size, 3, cpu_)
        store_kv(k.float(), v.float(), kv32, layer, reference)
        expected = paged_attention(q.float(), k.float(), v.float(), kv32, layer, reference, scale)
        meta = build_metadata(step, block_size, 3, cpu_, kernels)
        store_kv(k, v, kv, layer, meta)
        got = paged_attention(q, k, v, kv, layer, meta, scale)
        assert got.dtype == torch.bfloat16 and torch.equal(kv.float(), kv32)
        error = (got.float() - expected).abs()
        assert (error[~fresh] <= expected[~fresh].abs() * 2 ** -8 + 1e-5).all()
        assert (error[fresh] <= expected[fresh].abs() * 2 ** -6 + 1e-2).all()

def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(kernels):
    rng = random.Random(7)
    chunks = [(rng.randint(20, 300), 1) for _ in range(10)] + [(160, 150), (40, 77), (9, 5)]
    kv, q, k, v, step = _random_step(rng, 9, 3, 64, 16, 2, chunks)
    cpu_ = torch.device("cpu")
    meta = build_metadata(step, 16, 2, cpu_, kernels)
    store_kv(k, v, kv, 1, meta)
    batch = paged_attention(q, k, v, kv, 1, meta, 0.125)
    first = 0
    for i, (_, n) in enumerate(chunks):
        rows = slice(first, first + n)
        alone = paged_attention(q[rows], k[rows], v[rows], kv, 1, build_metadata([step[i]], 16, 2, cpu_, kernels),
                                0.125)
        assert torch.equal(alone, batch[rows])
        first += n


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 16), (6, 2, 24)])
def test_rope_store_gives_the_torch_lines_bits(kernels, heads, kv_heads, head_dim):
    rng = random.Random(head_dim)
    chunks = [(0, 9), (37, 1), (5, 20)]
    kv, _, _, _, step = _random_step(rng, heads, kv_heads, head_dim, 4, 3, chunks)
    num_tokens = sum(n for _, n in chunks)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim) * 3
    positions = torch.cat([torch.arange(s, s + n) for s, n in chunks])
    freqs = positions.float()[:, None] * (1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    meta = build_metadata(step, 4, 3, torch.device("cpu"), kernels)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(num_tokens, -1, head_dim) for t in (q, k, v))
    expected_q = q * cos + rotate_half(q) * sin
    expected_kv = kv.clone()
    store_kv(k * cos + rotate_half(k) * sin, v, expected_kv, 2, meta)
    got_q, got_k = kernels.rope_store(qkv, cos, sin, kv, meta.slot_rows, *meta.token_row_offsets(2), heads)
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, k * cos + rotate_half(k) * sin)
    assert torch.equal(kv, expected_kv)



def test_bf16_rope_store_rounds_the_fp32_lines_once(kernels):
    heads, kv_heads, head_dim = 9, 3, 64
    rng = random.Random(3)
    chunks = [(0, 9), (37, 1), (5, 20)]
    kv, _, _, _, step = _random_step(rng, heads, kv_heads, head_dim, 4, 3, chunks)
    kv = kv.bfloat16()
    num_tokens = sum(n for _, n in chunks)
    qkv = (torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim) * 3).bfloat16()
    positions = torch.cat([torch.arange(s, s + n) for s, n in chunks])
    freqs = positions.float()[:, None] * (1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :].bfloat16(), emb.sin()[:, None, :].bfloat16()
    meta = build_metadata(step, 4, 3, torch.device("cpu"), kernels)
    q, k, v = qkv.float().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(num_tokens, -1, head_dim) for t in (q, k, v))
    c, s = cos.float(), sin.float()
    expected_q, expected_k = ((x * c + rotate_half(x) * s).bfloat16() for x in (q, k))
    expected_kv = kv.clone()
    store_kv(expected_k, v.bfloat16(), expected_kv, 2, meta)
    got_q, got_k = kernels.rope_store(qkv, cos, sin, kv, meta.slot_rows, *meta.token_row_offsets(2), heads)
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k) and torch.equal(kv, expected_kv)

def test_engine_outputs_are_the_same_with_and_without_the_kernel(tiny_llama_dir, monkeypatch):
    prompts = [[(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate([5, 40, 130, 300])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # A small token budget, so prompts are also continued across steps.
    fused = LLM(str(tiny_llama_dir), num_kv_blocks=256, max_num_batched_tokens=96)
    assert fused.engine.runner._kernels is not None
    with_kernel = [o.token_ids for o in fused.generate(prompts, params)]
    monkeypatch.setenv("EPD_CPU_KERNELS", "0")
    cpu.kernels.cache_clear()
    try:
        plain = LLM(str(tiny_llama_dir), num_kv_blocks=256, max_num_batched_tokens=96)
        assert plain.engine.runner._kernels is None
        assert [o.token_ids for o in plain.generate(prompts, params)] == with_kernel
    finally:
        cpu.kernels.cache_clear()


def test_a_failed_build_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    assert cpu._library() is None
    assert "CPU kernels unavailable" in caplog.text


@pytest.mark.parametrize("target, says", [
    ("sapphirerapids", "which this CPU lacks"),  # AVX-512 with FP16 and AMX: more than most CPUs have
    ("no-such-cpu", "no-such-cpu"),              # the compiler's own words
])
def test_a_target_this_cpu_cannot_run_falls_back_with_a_warning(tmp_path, monkeypatch, caplog, target, says):
    """EPD_CPU_MARCH naming extensions this CPU lacks would kill the engine with an illegal
    instruction at its first kernel: nothing is built, the torch path is used, the log says why."""
    if platform.machine() != "x86_64":
        pytest.skip("the targets are x86's")
    if target == "sapphirerapids" and not cpu._missing_features(cpu._compiler(), target):
        pytest.skip(f"this CPU runs {target}'s instructions")
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(cpu.MARCH_ENV, target)
    assert cpu._library() is None
    assert f"{cpu.MARCH_ENV}={target}" in caplog.text and says in caplog.text
    assert not (tmp_path / "kernels").exists()


def test_the_build_is_cached_and_leaves_floating_point_modes_alone(tmp_path, kernels):
    first = cpu.build(cache_dir=tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu.build(cache_dir=tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind
    # Linking with -ffast-math would have turned on flush-to-zero for the whole process.
    assert (torch.tensor([1e-38]) * torch.tensor([1e-3])).item() != 0.0


@pytest.mark.parametrize("window", [0, 21, 40])
def test_a_querys_bits_do_not_depend_on_how_its_prompt_was_chunked(kernels, window):
    """What batch-invariant mode rests on: the same query over the same context, in chunks
    that start elsewhere (so its tile holds other queries), gives the same bits, windowed or not."""
    rng = random.Random(11)
    kv, q, k, v, step = _random_step(rng, 9, 3, 64, 16, 2, [(100, 40)])
    cpu_ = torch.device("cpu")
    meta = build_metadata(step, 16, 2, cpu_, kernels)
    store_kv(k, v, kv, 1, meta)
    whole = paged_attention(q, k, v, kv, 1, meta, 0.125, window)
    table = step[0][2]
    for skip in (1, 7, 10, 23):
        part = build_metadata([(100 + skip, 40 - skip, table)], 16, 2, cpu_, kernels)
        got = paged_attention(q[skip:], k[skip:], v[skip:], kv, 1, part, 0.125, window)
        assert torch.equal(got, whole[skip:]), (window, skip)


def test_prefill_kernel_is_as_close_to_float64_as_sdpa_over_a_long_context(kernels):
    """The weighted values of each chunk of keys are summed from zero and then added to the
    running output, as flash attention adds a block's product. One running sum over 2,048
    values of one sign (a model's often are) was 4x further from float64 than SDPA's fp32, and
    SmolLM2's logits 2.4x further than transformers' (AMD Zen 4); with the chunks 1.4x here."""
    torch.manual_seed(0)
    tokens, block, head_dim = 2048, 16, 64
    blocks = tokens // block
    q = torch.randn(tokens, 2, head_dim)
    k, v = torch.randn(tokens, 1, head_dim), torch.randn(tokens, 1, head_dim) + 2.0
    kv = torch.stack([k, v]).view(2, blocks, block, 1, head_dim).transpose(0, 1).unsqueeze(1).contiguous()
    out = torch.empty_like(q)
    kernels.paged_prefill(q, out, kv, 0, torch.tensor([[0, tokens, 0]]), torch.arange(blocks)[None], head_dim ** -0.5)
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    truth = F.scaled_dot_product_attention(qt.double(), kt.double(), vt.double(), is_causal=True, enable_gqa=True)
    sdpa = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    ours, theirs = out.transpose(0, 1).double() - truth, sdpa.double() - truth
    assert ours.pow(2).mean().sqrt() <= 2 * theirs.pow(2).mean().sqrt()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [576, 24])  # SmolLM2's; one that is no multiple of the vector width
def test_add_rms_norm_matches_torch_and_a_row_does_not_depend_on_the_batch(kernels, dtype, dim):
    gen = torch.Generator().manual_seed(dim)
    x, residual = (torch.randn(37, dim, generator=gen).to(dtype) * 3 for _ in range(2))
    norm = RMSNorm(dim, 1e-5).to(dtype).requires_grad_(False)
    norm.weight.copy_(torch.randn(dim, generator=gen))
    expected, expected_sum = norm(x, residual)  # torch: Hugging Face's arithmetic
    assert torch.equal(expected_sum, x + residual)
    norm.fuse(kernels)
    fresh = x.clone()
    got, got_sum = norm(fresh, residual)
    assert got_sum is fresh and torch.equal(fresh, x + residual)  # the stream updated in place
    one_ulp = 2 ** -23 if dtype == torch.float32 else 2 ** -8
    assert ((got.float() - expected.float()).abs() <= 4 * one_ulp * expected.float().abs() + 1e-6).all()
    alone = norm(x + residual)[0]  # no residual: the norm of x, x untouched
    assert torch.equal(alone, got)
    for i in (0, 5, 36):  # a row alone, at another address: the same bits
        assert torch.equal(norm(x[i:i + 1].clone(), residual[i:i + 1].clone())[0][0], got[i])
