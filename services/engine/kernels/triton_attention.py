"""Paged attention in Triton for the CUDA engine: decodes and continued chunks read their
context blocks where they lie in the pool, grouped-query, with an online softmax.

Imported only on CUDA (see :mod:`services.engine.kernels.select`) and by its tests, which run
it on the CPU under ``TRITON_INTERPRET=1``; the engine imports without triton.

One kernel serves both batches. A program takes one sequence, one KV head and a tile of
``BLOCK_M`` new tokens; its rows are (token, query head of the group) pairs, so the group's
heads share every K/V load::

    row r  ->  token = tile * BLOCK_M + r // GROUP_PAD,  q head = kv_head * GROUP + r % GROUP_PAD
    key p  ->  pool element  table[p // B] * block_stride + layer_offset + (p % B) * Hkv * D + kv_head * D

Keys are visited ``BLOCK_N`` positions at a time, each position finding its block through the
table (so ``BLOCK_N`` need not be the block size); a query at position s sees keys 0..s.
Rows are padded to at least 16 (what ``tl.dot`` takes): padding rows are masked on store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from services.engine.kernels.triton_rope import rope_store

BLOCK_N = 64
"""Key positions per step of the online softmax."""
ROWS = 64
"""Query rows (tokens x group heads) per prefill program."""


@triton.jit
def _paged_attention_kernel(
        q_ptr, out_ptr, kv_ptr, rows_ptr, lengths_ptr, spans_ptr, tables_ptr,
        q_stride_t, q_stride_h, out_stride_t, out_stride_h, table_stride,
        layer_offset, v_offset, block_stride, scale, window,
        IS_DECODE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, NUM_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile_start = tl.program_id(2) * BLOCK_M
    if IS_DECODE:
        first_row = tl.load(rows_ptr + seq)
        start = tl.load(lengths_ptr + seq) - 1
        num_new = start * 0 + 1
    else:
        first_row = tl.load(spans_ptr + seq * 3)
        num_new = tl.load(spans_ptr + seq * 3 + 1)
        start = tl.load(spans_ptr + seq * 3 + 2)
    if tile_start < num_new:
        r = tl.arange(0, NUM_ROWS)
        token = tile_start + r // GROUP_PAD
        g = r % GROUP_PAD
        is_row = (r // GROUP_PAD < BLOCK_M) & (token < num_new) & (g < GROUP)
        head = kv_head * GROUP + g
        d = tl.arange(0, HEAD_DIM_PAD)
        is_dim = d < HEAD_DIM
        q_rows = (first_row + token).to(tl.int64)
        q = tl.load(q_ptr + (q_rows * q_stride_t + head * q_stride_h)[:, None] + d[None, :],
                    mask=is_row[:, None] & is_dim[None, :], other=0.0)
        q_pos = start + token
        kv_len = start + tl.minimum(num_new, tile_start + BLOCK_M)
        m_i = tl.full([NUM_ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([NUM_ROWS], tl.float32)
        acc = tl.zeros([NUM_ROWS, HEAD_DIM_PAD], tl.float32)
        table = tables_ptr + seq.to(tl.int64) * table_stride
        # window > 0 (a sliding-window layer): a query sees only its last `window` positions, so
        # keys before the tile's first query's window are skipped.
        key_lo = tl.where(window > 0, tl.maximum(start + tile_start + 1 - window, 0), 0) // BLOCK_N * BLOCK_N
        for key_start in range(key_lo, kv_len, BLOCK_N):
            pos = key_start + tl.arange(0, BLOCK_N)
            is_key = pos < kv_len
            block = tl.load(table + pos // BLOCK_SIZE, mask=is_key, other=0).to(tl.int64)
            base = (block * block_stride + layer_offset + (pos % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM)
                    + kv_head * HEAD_DIM)
            kv_mask = is_key[:, None] & is_dim[None, :]
            k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            is_seen = is_key[None, :] & (pos[None, :] <= q_pos[:, None])
            is_seen &= (window <= 0) | (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(is_seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no key yet (its window starts later) keeps m = -inf: exp from 0.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(kv_ptr + v_offset + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        # Padding rows (past the chunk, or past the group) may have seen no key in their window.
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_rows * out_stride_t + head * out_stride_h)[:, None] + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & is_dim[None, :])


def _launch(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, layer: int, tables: torch.Tensor,
            scale: float, grid_seqs: int, num_tiles: int, block_m: int, is_decode: bool,
            rows: torch.Tensor, lengths: torch.Tensor, spans: torch.Tensor, window: int) -> None:
    num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    num_heads = q.shape[1]
    assert kv_cache.is_contiguous() and q.stride(2) == 1 and out.stride(2) == 1
    assert num_heads % num_kv_heads == 0 and q.dtype == out.dtype == kv_cache.dtype
    assert all(t.dtype == torch.int64 and t.is_contiguous() for t in (rows, lengths, spans, tables))
    if grid_seqs == 0:
        return
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    num_rows = max(16, block_m * group_pad)
    kv_size = block_size * num_kv_heads * head_dim  # one (layer, k|v) of one block
    _paged_attention_kernel[(grid_seqs, num_kv_heads, num_tiles)](
        q, out, kv_cache, rows, lengths, spans, tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        2 * layer * kv_size, kv_size, num_layers * 2 * kv_size, scale, window,
        IS_DECODE=is_decode, GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, NUM_ROWS=num_rows,
        BLOCK_N=BLOCK_N, BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        # fp32 stays fp32 on the GPU (tl.dot's default would round its inputs to TF32).
        PRECISION="ieee" if q.dtype == torch.float32 else None)


def paged_decode(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                 rows: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, scale: float,
                 window: int = 0) -> None:
    """Single-token decodes: ``out[rows[i]]`` = attention of ``q[rows[i]]`` [H, D] over the first
    ``lengths[i]`` positions of block table ``tables[i]`` (the new token's K/V already stored;
    ``window`` > 0: only the last ``window`` of them)."""
    _launch(q, out, kv_cache, layer, tables, scale, rows.shape[0], 1, 1, True, rows, lengths, rows, window)


def paged_prefill(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                  spans: torch.Tensor, tables: torch.Tensor, scale: float, window: int = 0) -> None:
    """Chunks of new tokens, causal from each chunk's start: ``spans[i]`` = (first row of the flat
    batch, number of new tokens, start position), over block table ``tables[i]``."""
    group_pad = triton.next_power_of_2(q.shape[1] // kv_cache.shape[4])
    block_m = max(1, ROWS // group_pad)
    # A bound on any chunk's length that needs no device sync: programs past a chunk's end exit.
    longest = min(q.shape[0], tables.shape[1] * kv_cache.shape[3])
    _launch(q, out, kv_cache, layer, tables, scale, spans.shape[0], triton.cdiv(longest, block_m), block_m,
            False, spans, spans, spans, window)


@dataclass(frozen=True)
class TritonKernels:
    """The subset of :class:`services.engine.kernels.cpu.CpuKernels` that attention and the model
    call, with the same signatures."""

    paged_decode: Callable[..., None] = paged_decode
    paged_prefill: Callable[..., None] = paged_prefill
    rope_store: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rope_store
