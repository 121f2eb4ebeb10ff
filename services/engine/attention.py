"""Paged attention over the block-major KV pool: torch (CPU and CUDA) and the CPU's kernels.

A pool is one tensor, block-major so that a block's KV for every layer is one contiguous
byte range (what the transfer engine registers and moves)::

    kv_cache[num_blocks, num_layers, 2 (k|v), block_size, num_kv_heads, head_dim]

A plain model has one pool of every layer; a hybrid one a pool per KV group (full-attention
layers, sliding-window layers: model_runner.py), each with its own tables and metadata, and a
layer is given its group's pool and its index ``l`` inside it (``L`` below: the group's layers).

Two flat views of it are used, both indexed by arithmetic computed once per step:

    token rows  [num_blocks * L * 2 * B, kv_heads, head_dim]
                row of (position p, layer l, c = k|v) = (table[p // B] * 2L + 2l + c) * B + p % B
    block rows  [num_blocks * L * 2, B, kv_heads, head_dim]
                row of (block b, layer l, c)           = b * 2L + 2l + c

New K/V are written per token (``index_copy_`` on token rows, or the CPU's ``rope_store``);
torch reads contexts per block (``index_select`` on block rows, 4x faster than per token), and
positions past a sequence's length inside its last block are masked out.

* a chunk that starts at position 0 attends to its own fresh K/V (torch's SDPA, causal,
  nothing to gather);
* a chunk that continues a sequence (chunked prefill, prefix hit) reads its context blocks
  where they lie, given the CPU's kernels (:mod:`services.engine.kernels.cpu`: one call a
  layer for all such chunks, causal from each chunk's start) or, on CUDA, the Triton ones
  (:mod:`services.engine.kernels.triton_attention`, same calls); otherwise it gathers them and
  uses SDPA with an explicit causal mask offset by its start;
* single-token decodes all go to the CPU's decode kernel in one call, which reads each
  context's blocks in place; otherwise they are sorted by context length and run in a few
  batches of similar length, each gathered and padded to its longest (padding costs memory
  bandwidth, the decode bottleneck).

A sliding-window layer's table entries before a query's window may name a freed block (the NULL
block, or another sequence's block by now: the window pool frees what no query sees again). The
C kernels start each query's keys at its window and never read them; the Triton kernel (whose
key tiles start at a multiple of 64) and the torch path read some and mask them to -inf, where
any finite KV adds exactly zero, so results are the same bits as with the blocks still there.
A bounded replay (kv_groups.PrefixHit) is the one reader of such entries: its first queries'
windows reach before the replay start, into the NULL block; what they compute there is wrong
by design and rebuilt exactly before anything is kept (ModelConfig.replay_tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from services.engine.kernels.cpu import CpuKernels

if TYPE_CHECKING:  # imports triton: only where chosen (services.engine.kernels.select)
    from services.engine.kernels.triton_attention import TritonKernels


class BlockTable:
    """A request's block ids, kept by the runner from step to step: a list (per-token slots)
    and a tensor mirror (the kernels' padded tables), both changed only where the scheduler
    says they changed, so a step's tables cost nothing per block of a long context."""

    def __init__(self, block_ids: Sequence[int] = ()) -> None:
        self.ids: list[int] = list(block_ids)
        self._mirror = torch.tensor(self.ids or [0], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.ids)

    def update(self, num_kept: int, new_ids: Sequence[int]) -> None:
        """Keep the first ``num_kept`` entries, then append ``new_ids``."""
        del self.ids[num_kept:]
        self.ids.extend(new_ids)
        if len(self.ids) > len(self._mirror):
            grown = torch.empty(max(len(self.ids), 2 * len(self._mirror)), dtype=torch.long)
            grown[:num_kept] = self._mirror[:num_kept]
            self._mirror = grown
        if new_ids:
            self._mirror[num_kept:len(self.ids)] = torch.tensor(new_ids, dtype=torch.long)

    def tensor(self, num_blocks: int) -> torch.Tensor:
        """The first ``num_blocks`` ids (a CPU view: read it before the next update)."""
        return self._mirror[:num_blocks]


@dataclass
class Span:
    """A chunk with more than one new token, attended alone."""

    token_start: int
    num_tokens: int
    context_blocks: torch.Tensor | None  # [num_ctx_blocks] block row (layer 0, k); None if fresh
    mask: torch.Tensor | None            # [n, num_ctx_blocks * B] True where attention is allowed


@dataclass
class DecodeGroup:
    """Single-token decodes of similar context length, attended as one padded batch."""

    token_index: torch.Tensor  # [Bd] rows of the flat batch
    blocks: torch.Tensor       # [Bd * max_blocks] block rows (layer 0, k), padded
    mask: torch.Tensor         # [Bd, 1, 1, max_blocks * B]


@dataclass
class DecodeBatch:
    """Every single-token decode of the step, for the kernel that reads blocks in place."""

    rows: torch.Tensor     # [N] rows of the flat batch
    tables: torch.Tensor   # [N, max_blocks] block ids, padded with 0
    lengths: torch.Tensor  # [N] context length, the new token included


@dataclass
class PrefillBatch:
    """Every chunk of the step that continues a sequence with more than one new token (chunked
    prefill, prefix hits), for the kernel that reads blocks in place."""

    spans: torch.Tensor   # [N, 3] first row in the flat batch, number of new tokens, start position
    tables: torch.Tensor  # [N, max_blocks] block ids, padded with 0


@dataclass
class AttentionMetadata:
    num_layers: int
    block_size: int
    slot_rows: torch.Tensor  # [T] token row (layer 0, k) of each new token
    spans: list[Span]
    decodes: list[DecodeGroup]
    kernels: CpuKernels | TritonKernels | None = None
    """The CPU's kernels or the Triton ones (CUDA): then decodes and continued chunks are in the
    two batches, not in decodes and spans, and the model stores K/V with their ``rope_store``."""
    decode_batch: DecodeBatch | None = None
    prefill_batch: PrefillBatch | None = None
    workspace: torch.Tensor | None = None
    """[2, max_gather_blocks, B, kv_heads, head_dim] reused by every gather of the step: a
    fresh tensor per gather costs more in page faults than the copy itself on the CPU."""
    is_verify_step: bool = False
    """Every chunk is a decode: one token, or one and its speculative drafts (set by the runner)."""

    @property
    def decode_only(self) -> bool:
        """Every token of the step is a single-token decode (no prompt tokens)."""
        return not self.spans and self.prefill_batch is None

    @property
    def packed_products(self) -> bool:
        """Linear layers use the packed product (a row's result does not depend on the other
        rows) even where the model keeps torch's products for prompt tokens (``EPD_CPU_BLAS=mkl``,
        the exact mode): steps that only decode (drafts included: a few rows each), for speed.
        (Where the model packs every step, as by default, every step uses it anyway.)"""
        return self.decode_only or self.is_verify_step

    @property
    def max_gather_blocks(self) -> int:
        sizes = [s.context_blocks.shape[0] for s in self.spans if s.context_blocks is not None]
        return max(sizes + [g.blocks.shape[0] for g in self.decodes], default=0)

    def layer_offset(self, layer: int, kv: int) -> int:
        """Offset of (layer, k|v) in block rows; times block_size in token rows."""
        return 2 * layer + kv

    def token_row_offsets(self, layer: int) -> tuple[int, int]:
        """Offsets of layer's K and V in token rows: ``slot_rows + offset`` are where they go."""
        return self.layer_offset(layer, 0) * self.block_size, self.layer_offset(layer, 1) * self.block_size


def build_metadata(chunks: list[tuple[int, int, BlockTable | Sequence[int]]], block_size: int,
                   num_layers: int, device: torch.device, kernels: CpuKernels | TritonKernels | None = None,
                   kept_until: Sequence[int] = (), discard_block: int = -1, fresh_in_kernel: bool = False,
                   decode_from: Sequence[int] = ()) -> AttentionMetadata:
    """``chunks``: (start_position, num_new_tokens, block table) per sequence, in batch order.
    With ``kernels`` (the CPU's or the Triton ones), single-token decodes go to them as one
    :class:`DecodeBatch` and continued chunks as one :class:`PrefillBatch`; fresh prompts stay
    spans for torch's SDPA (transformers' own arithmetic) unless ``fresh_in_kernel``: then they
    join the prefill batch (the CPU's kernel runs them at 1.5-1.8x SDPA's speed, ~5e-7 from it).

    ``kept_until`` (per chunk, where given): positions before it keep the KV their blocks hold
    (a bounded replay's full-attention layers); their new K/V go to ``discard_block``, a block
    nothing reads, and attention reads the kept KV.

    ``decode_from`` (per chunk, where given; the runner gives each request's prompt length): a
    token at a position before it is a prompt token, from it on an output token. A token's
    attention is computed by its role's kernel, whatever chunk it came in: a prompt token by
    the prefill kernel (fresh and continued chunks alike, where ``fresh_in_kernel``), which
    computes each query alone over its context's keys in the same order however the prompt was
    chunked (keys past a query add exact zeros); an output token as a single-token decode over
    the context up to itself: in a decode step, with its speculative drafts, or computed again
    (a preempted or migrated request recomputes its output, a bounded replay its window). So a
    position's bits are the same however the request was batched, chunked, cached or moved
    (the two kernels sum in other orders: ~1e-4 apart in fp32's logits, whole units in bf16's,
    enough to flip a token). Not given (tests, prompt scoring): a one-token chunk after position
    0 is a decode, any other chunk prompt tokens."""
    stride = 2 * num_layers  # block rows per block
    slot_rows: list[int] = []
    spans: list[Span] = []
    continued: list[tuple[int, int, int, BlockTable, int]] = []  # token_start, n, start, table, context blocks
    dec_index: list[int] = []
    dec_tables: list[tuple[BlockTable, int]] = []
    dec_lengths: list[int] = []
    token_start = 0
    for i, (start, n, table) in enumerate(chunks):
        table = table if isinstance(table, BlockTable) else BlockTable(table)
        ids = table.ids
        kept = kept_until[i] if kept_until else 0
        slot_rows.extend((ids[p // block_size] if p >= kept else discard_block) * stride * block_size + p % block_size
                         for p in range(start, start + n))
        first_output = decode_from[i] if decode_from else (start if n == 1 and start > 0 else start + n)
        num_prompt = min(n, max(0, first_output - start))  # the chunk's prompt tokens come first
        if num_prompt and start == 0 and not (fresh_in_kernel and kernels is not None):
            spans.append(Span(token_start, num_prompt, None, None))
        elif num_prompt:
            continued.append((token_start, num_prompt, start, table, -(-(start + num_prompt) // block_size)))
        for j in range(num_prompt, n):
            dec_index.append(token_start + j)
            dec_tables.append((table, -(-(start + j + 1) // block_size)))
            dec_lengths.append(start + j + 1)
        token_start += n

    def long(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    def padded(tables: list[tuple[BlockTable, int]]) -> torch.Tensor:
        out = torch.zeros(len(tables), max(n for _, n in tables), dtype=torch.long)
        for row, (table, n) in zip(out, tables):
            row[:n] = table.tensor(n)
        return out.to(device)

    if kernels is not None:
        decode_batch = prefill_batch = None
        if dec_index:
            decode_batch = DecodeBatch(long(dec_index), padded(dec_tables), long(dec_lengths))
        if continued:
            prefill_batch = PrefillBatch(long([c[:3] for c in continued]), padded([c[3:] for c in continued]))
        return AttentionMetadata(num_layers, block_size, long(slot_rows), spans, [], kernels, decode_batch,
                                 prefill_batch)
    spans += [_continued_span(token_start, n, start, padded([(table, blocks)])[0], block_size, stride, device)
              for token_start, n, start, table, blocks in continued]
    groups = []
    for members in _group_by_length(dec_lengths):
        # Padding reads block row 0 (a real block) and is masked out.
        tables = padded([dec_tables[i] for i in members])
        positions = torch.arange(tables.shape[1] * block_size, device=device)
        mask = positions[None, :] < long([dec_lengths[i] for i in members])[:, None]
        groups.append(DecodeGroup(long([dec_index[i] for i in members]), (tables * stride).view(-1),
                                  mask[:, None, None, :]))
    return AttentionMetadata(num_layers, block_size, long(slot_rows), spans, groups)


def _continued_span(token_start: int, n: int, start: int, blocks: torch.Tensor, block_size: int,
                    stride: int, device: torch.device) -> Span:
    q_pos = torch.arange(start, start + n, device=device)
    mask = torch.arange(len(blocks) * block_size, device=device)[None, :] <= q_pos[:, None]
    return Span(token_start, n, blocks * stride, mask)


def _group_by_length(lengths: list[int], max_ratio: float = 1.3, max_groups: int = 6) -> list[list[int]]:
    """Indices sorted by length, split where a length exceeds its group's shortest by max_ratio."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and (lengths[i] <= max_ratio * lengths[groups[-1][0]] or len(groups) == max_groups):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
             meta: AttentionMetadata) -> None:
    """Write the new tokens' K/V [T, Hkv, D] into the pool (before attention reads it)."""
    token_rows = kv_cache.view(-1, *kv_cache.shape[4:])
    k_offset, v_offset = meta.token_row_offsets(layer)
    token_rows.index_copy_(0, meta.slot_rows + k_offset, k)
    token_rows.index_copy_(0, meta.slot_rows + v_offset, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    layer: int, meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] for the new tokens -> attention output [T, H, D].

    The new K/V are already in the pool (:func:`store_kv`, or the CPU's ``rope_store``); fresh
    prompts attend to k/v directly, everything else reads the pool. ``window`` > 0: a
    sliding-window layer, each query sees only the last ``window`` positions (itself included).
    """
    num_kv_heads, head_dim, bs = kv_cache.shape[4], kv_cache.shape[5], meta.block_size
    block_rows = kv_cache.view(-1, bs, num_kv_heads, head_dim)
    k_off, v_off = meta.layer_offset(layer, 0), meta.layer_offset(layer, 1)

    def gather(blocks: torch.Tensor, kv: int, num_seqs: int) -> torch.Tensor:
        # [num_seqs, kv_heads, ctx, head_dim]
        index = blocks + (k_off if kv == 0 else v_off)
        if meta.workspace is None:
            out = block_rows.index_select(0, index)
        else:
            out = torch.index_select(block_rows, 0, index, out=meta.workspace[kv, :index.shape[0]])
        return out.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)

    out = torch.empty_like(q)
    for span in meta.spans:
        sl = slice(span.token_start, span.token_start + span.num_tokens)
        if span.context_blocks is None:
            ks, vs = k[sl].transpose(0, 1).unsqueeze(0), v[sl].transpose(0, 1).unsqueeze(0)
        else:
            ks, vs = gather(span.context_blocks, 0, 1), gather(span.context_blocks, 1, 1)
        mask = windowed(span.mask, span.num_tokens, window, q.device)
        o = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1).unsqueeze(0), ks, vs, attn_mask=mask,
            is_causal=mask is None, scale=scale, enable_gqa=True)
        out[sl] = o.squeeze(0).transpose(0, 1)
    if meta.prefill_batch is not None:
        pre = meta.prefill_batch
        meta.kernels.paged_prefill(q, out, kv_cache, layer, pre.spans, pre.tables, scale, window)
    if meta.decode_batch is not None:
        dec = meta.decode_batch
        meta.kernels.paged_decode(q, out, kv_cache, layer, dec.rows, dec.tables, dec.lengths, scale, window)
    for group in meta.decodes:
        num_dec = group.token_index.shape[0]
        kd, vd = gather(group.blocks, 0, num_dec), gather(group.blocks, 1, num_dec)
        qd = q[group.token_index].unsqueeze(2)  # [Bd, H, 1, D]
        mask = group.mask
        if window:  # positions before the last `window` of each context are out too
            lengths = mask.sum(-1, keepdim=True)
            mask = mask & (torch.arange(mask.shape[-1], device=mask.device) >= lengths - window)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=True)
        out[group.token_index] = o.squeeze(2)
    return out


def windowed(mask: torch.Tensor | None, num_tokens: int, window: int,
             device: torch.device) -> torch.Tensor | None:
    """A span's attention mask ([n, ctx] allowed keys; None: causal over its own n tokens) with
    the keys before each query's window taken out too; unchanged where no window cuts."""
    if not window or (mask.shape[1] if mask is not None else num_tokens) <= window:
        return mask
    if mask is None:
        mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril()
    position = mask.sum(-1, keepdim=True) - 1  # each query's: its last allowed key
    return mask & (torch.arange(mask.shape[1], device=device)[None, :] > position - window)
