"""Paged attention over the block-major KV pool, in plain torch (CPU and CUDA).

The pool is one tensor, block-major so that a block's KV for every layer is one contiguous
byte range (what the transfer engine registers and moves)::

    kv_cache[num_blocks, num_layers, 2 (k|v), block_size, num_kv_heads, head_dim]

Seen as rows of [num_kv_heads, head_dim], token position p of a sequence, layer l, k|v = c is
row ``((block_table[p // B] * L + l) * 2 + c) * B + p % B``. :func:`build_metadata` computes
``block_table[p // B] * L * 2 * B + p % B`` (the layer-0 K row) once per step; every layer adds
``(2l + c) * B``. Reads and writes are then ``index_select`` / ``index_copy_`` on rows, which
are far cheaper than multi-dimensional advanced indexing.

* a chunk that starts at position 0 attends to its own fresh K/V (causal, nothing to gather);
* a chunk that continues a sequence (chunked prefill, prefix hit) gathers its context from
  the pool and uses an explicit causal mask offset by its start;
* single-token decodes are gathered together, padded to the longest, and run as one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Span:
    """A chunk with more than one new token, attended alone."""

    token_start: int
    num_tokens: int
    context_rows: torch.Tensor | None  # [ctx] layer-0 K row per context position; None if fresh
    mask: torch.Tensor | None          # [n, ctx] True where attention is allowed


@dataclass
class AttentionMetadata:
    num_layers: int
    block_size: int
    slot_rows: torch.Tensor  # [T] layer-0 K row of each new token
    spans: list[Span]
    decode_token_index: torch.Tensor | None = None  # [Bd] decode rows of the flat batch
    decode_rows: torch.Tensor | None = None         # [Bd * max_ctx] layer-0 K rows, padded
    decode_mask: torch.Tensor | None = None         # [Bd, 1, 1, max_ctx]
    decode_max_ctx: int = 0

    def layer_offset(self, layer: int, kv: int) -> int:
        return (2 * layer + kv) * self.block_size


def _rows(block_table: list[int], start: int, end: int, block_size: int, stride: int) -> list[int]:
    return [block_table[p // block_size] * stride + p % block_size for p in range(start, end)]


def build_metadata(chunks: list[tuple[int, int, list[int]]], block_size: int, num_layers: int,
                   device: torch.device) -> AttentionMetadata:
    """``chunks``: (start_position, num_new_tokens, block_table) per sequence, in batch order."""
    stride = num_layers * 2 * block_size  # rows per block
    slot_rows: list[int] = []
    spans: list[Span] = []
    dec_index: list[int] = []
    dec_rows: list[list[int]] = []
    token_start = 0
    for start, n, table in chunks:
        slot_rows.extend(_rows(table, start, start + n, block_size, stride))
        if n == 1 and start > 0:
            dec_index.append(token_start)
            dec_rows.append(_rows(table, 0, start + 1, block_size, stride))
        elif start == 0:
            spans.append(Span(token_start, n, None, None))
        else:
            q_pos = torch.arange(start, start + n, device=device)
            mask = torch.arange(start + n, device=device)[None, :] <= q_pos[:, None]
            rows = torch.tensor(_rows(table, 0, start + n, block_size, stride), device=device)
            spans.append(Span(token_start, n, rows, mask))
        token_start += n

    def long(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    meta = AttentionMetadata(num_layers, block_size, long(slot_rows), spans)
    if dec_index:
        max_ctx = max(map(len, dec_rows))
        # Padding points at row 0 (a real row) and is masked out.
        meta.decode_rows = long([r + [0] * (max_ctx - len(r)) for r in dec_rows]).view(-1)
        lengths = long([len(r) for r in dec_rows])
        meta.decode_mask = (torch.arange(max_ctx, device=device)[None, :] < lengths[:, None])[:, None, None, :]
        meta.decode_token_index = long(dec_index)
        meta.decode_max_ctx = max_ctx
    return meta


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] for the new tokens -> attention output [T, H, D].

    Writes the new K/V into the pool first, so gathered contexts include them.
    """
    rows = kv_cache.view(-1, k.shape[1], k.shape[2])
    k_off, v_off = meta.layer_offset(layer, 0), meta.layer_offset(layer, 1)
    rows.index_copy_(0, meta.slot_rows + k_off, k)
    rows.index_copy_(0, meta.slot_rows + v_off, v)
    out = torch.empty_like(q)
    for span in meta.spans:
        sl = slice(span.token_start, span.token_start + span.num_tokens)
        if span.context_rows is None:
            ks, vs, causal = k[sl], v[sl], True
        else:
            ks = rows.index_select(0, span.context_rows + k_off)
            vs = rows.index_select(0, span.context_rows + v_off)
            causal = False
        o = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0),
            vs.transpose(0, 1).unsqueeze(0), attn_mask=span.mask, is_causal=causal, scale=scale,
            enable_gqa=True)
        out[sl] = o.squeeze(0).transpose(0, 1)
    if meta.decode_token_index is not None:
        shape = (-1, meta.decode_max_ctx, k.shape[1], k.shape[2])
        kd = rows.index_select(0, meta.decode_rows + k_off).view(shape).transpose(1, 2)
        vd = rows.index_select(0, meta.decode_rows + v_off).view(shape).transpose(1, 2)
        qd = q[meta.decode_token_index].unsqueeze(2)  # [Bd, H, 1, D]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                           enable_gqa=True)
        out[meta.decode_token_index] = o.squeeze(2)
    return out
