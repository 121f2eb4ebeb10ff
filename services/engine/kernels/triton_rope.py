"""RoPE on q and k and the store of k and v in the paged KV pool, fused, in Triton: one pass
over the fused q/k/v projection's output, the CUDA counterpart of ``rope_store.c``.

Imported only on CUDA and by its tests (``TRITON_INTERPRET=1`` on the CPU).

The rotate-half layout, per head, with halves x1 = x[:D/2], x2 = x[D/2:]::

    y[:D/2] = x1 * cos[:D/2] + (-x2) * sin[:D/2]
    y[D/2:] = x2 * cos[D/2:] +   x1  * sin[D/2:]

computed in fp32 and rounded once to the pool's dtype. Token t's K goes to token row
``slot_rows[t] + k_offset`` of the pool, its V to ``slot_rows[t] + v_offset`` (rows of
``num_kv_heads * head_dim`` elements, see :mod:`services.engine.attention`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(src_ptr, dst_ptr, c1, c2, s1, s2, h, i, mask, HEAD_DIM: tl.constexpr):
    half = HEAD_DIM // 2
    at = (h * HEAD_DIM)[:, None] + i[None, :]
    x1 = tl.load(src_ptr + at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + at + half, mask=mask, other=0.0).to(tl.float32)
    ty = dst_ptr.dtype.element_ty
    tl.store(dst_ptr + at, (x1 * c1 + (-x2) * s1).to(ty), mask=mask)
    tl.store(dst_ptr + at + half, (x2 * c2 + x1 * s2).to(ty), mask=mask)


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, kv_ptr, slot_rows_ptr,
                       k_offset, v_offset, qkv_stride,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    half = HEAD_DIM // 2
    i = tl.arange(0, HALF_PAD)
    h = tl.arange(0, HEADS_PAD)
    c1 = tl.load(cos_ptr + t * HEAD_DIM + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * HEAD_DIM + half + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * HEAD_DIM + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * HEAD_DIM + half + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
    q_size = NUM_HEADS * HEAD_DIM
    kv_size = NUM_KV_HEADS * HEAD_DIM
    x = qkv_ptr + t * qkv_stride
    slot = tl.load(slot_rows_ptr + t)
    k_dst = kv_ptr + (slot + k_offset) * kv_size
    _rotate(x, q_ptr + t * q_size, c1, c2, s1, s2, h, i,
            (h < NUM_HEADS)[:, None] & (i < half)[None, :], HEAD_DIM)
    kv_mask = (h < NUM_KV_HEADS)[:, None] & (i < half)[None, :]
    _rotate(x + q_size, k_dst, c1, c2, s1, s2, h, i, kv_mask, HEAD_DIM)
    _rotate(x + q_size, k_ptr + t * kv_size, c1, c2, s1, s2, h, i, kv_mask, HEAD_DIM)
    d = tl.arange(0, DIM_PAD)
    at = (h * HEAD_DIM)[:, None] + d[None, :]
    v_mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    v = tl.load(x + q_size + kv_size + at, mask=v_mask, other=0.0)
    tl.store(kv_ptr + (slot + v_offset) * kv_size + at, v, mask=v_mask)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
               slot_rows: torch.Tensor, k_offset: int, v_offset: int,
               num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``CpuKernels.rope_store``'s contract: q and k of ``qkv`` [T, (H + 2 Hkv) D] rotated by
    ``cos``/``sin`` (T * D elements each), k and v stored; returns (q [T, H, D], k [T, Hkv, D])."""
    num_kv_heads, head_dim = kv_cache.shape[4:]
    num_tokens = qkv.shape[0]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert cos.numel() == sin.numel() == num_tokens * head_dim and cos.is_contiguous() and sin.is_contiguous()
    assert kv_cache.is_contiguous() and slot_rows.dtype == torch.int64 and slot_rows.is_contiguous()
    assert head_dim % 2 == 0
    q = qkv.new_empty(num_tokens, num_heads, head_dim)
    k = qkv.new_empty(num_tokens, num_kv_heads, head_dim)
    if num_tokens == 0:
        return q, k
    _rope_store_kernel[(num_tokens,)](
        qkv, cos, sin, q, k, kv_cache, slot_rows, k_offset, v_offset, qkv.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(max(num_heads, num_kv_heads)),
        HALF_PAD=triton.next_power_of_2(head_dim // 2), DIM_PAD=triton.next_power_of_2(head_dim))
    return q, k
