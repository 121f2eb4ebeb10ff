"""Sampler: turns one step's logits into one token per sequence.

Every stage runs only over the rows that need it, and is skipped when none does:

    raw logits ──────────────────────────────────────────► logprobs (log_softmax of raw logits)
        │
        ▼
    grammar bitmask (constrained rows) ─► disallowed ids → -inf
        │
        ▼
    logit_bias ─► + bias on the named ids (a disallowed id stays -inf)
        │
        ▼
    penalties (repetition, frequency, presence) ─► suppressed ids → -inf
        │
        ├─ greedy rows ─► argmax
        ▼
    temperature ─► top-k ─► top-p ─► min-p ─► inverse CDF with one uniform per row

Sampling draws exactly one uniform per sampled row per step. A seeded row draws it from its own
generator, so its tokens depend only on its logits and its seed, never on the batch around it,
and the generator's stream advances by the same amount every step. One draw per row (rather than
per-token noise such as an exponential race) also keeps seeded rows cheap when logits live on
the GPU and generators on the CPU: one float per row crosses, not a vocab-sized tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import torch

from services.common.sampling_params import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from services.engine.grammar import TokenBitmask

# For rows without top-p: an exclusive cumsum can round up to 1.0 before the tail and would drop
# tail tokens if compared against exactly 1.0.
_TOP_P_DISABLED = 2.0


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    """Set iff params.seed is not None; created once per request and kept across steps."""
    suppressed_token_ids: tuple[int, ...] = ()
    """Token ids that must not be sampled this step (e.g. EOS before min_tokens)."""


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    """None for rows whose params.logprobs is None."""


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 bitmask: TokenBitmask | None = None) -> SamplerOutput:
        """``bitmask``: the tokens the grammar allows in the constrained rows (None: no row is)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        device = logits.device
        edits = bitmask is not None or any(_has_penalty(r.params) or r.suppressed_token_ids or r.params.logit_bias
                                           for r in rows)
        # Copy only when editing in place: the raw logits are still needed for logprobs.
        x = logits.to(torch.float32, copy=edits)
        if bitmask is not None:
            bitmask.apply_(x)  # first: penalties, greedy and sampling see only what the grammar allows
        _apply_logit_bias(x, rows)
        _apply_penalties(x, rows)
        _apply_suppression(x, rows)

        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        token_ids = torch.empty(len(rows), dtype=torch.long, device=device)
        if greedy:
            # torch.argmax returns the first maximum, so ties go to the lowest id.
            token_ids[_index(greedy, device)] = _take(x, greedy).argmax(dim=-1)
        if sampled:
            token_ids[_index(sampled, device)] = _sample(_take(x, sampled), [rows[i] for i in sampled])

        ids = token_ids.tolist()
        return SamplerOutput(token_ids=ids, logprobs=_logprobs(logits, rows, token_ids, ids))


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _take(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if len(rows) == x.shape[0]:
        return x
    return x.index_select(0, _index(rows, x.device))


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _count_tokens(seqs: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), vocab] float counts of each token id per sequence, via one bincount."""
    num_rows = len(seqs)
    ids = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long, device=device)
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long, device=device)
    row = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths)
    # Prompt ids can lie outside the logits' vocab (multimodal placeholders); they would land
    # in a neighbouring row's slots.
    in_vocab = (ids >= 0) & (ids < vocab)
    flat = row[in_vocab] * vocab + ids[in_vocab]
    counts = torch.bincount(flat, minlength=num_rows * vocab)
    return counts.view(num_rows, vocab).to(torch.float32)


def _apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    picked = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
    if not picked:
        return
    device, vocab = x.device, x.shape[1]
    params = [rows[i].params for i in picked]
    sub = x.index_select(0, _index(picked, device))
    output_counts = _count_tokens([rows[i].output_token_ids for i in picked], vocab, device)

    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_counts = _count_tokens([rows[i].prompt_token_ids for i in picked], vocab, device)
        is_seen = (prompt_counts + output_counts) > 0
        penalty = _column([p.repetition_penalty for p in params], device)
        sub = torch.where(is_seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    if any(p.frequency_penalty != 0.0 for p in params):
        sub -= _column([p.frequency_penalty for p in params], device) * output_counts
    if any(p.presence_penalty != 0.0 for p in params):
        sub -= _column([p.presence_penalty for p in params], device) * (output_counts > 0)
    x[_index(picked, device)] = sub


def _apply_logit_bias(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = x.shape[1]
    triples = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias if t < vocab]
    if not triples:
        return
    row_ids, token_ids, biases = zip(*triples)
    index = (_index(list(row_ids), x.device), _index(list(token_ids), x.device))
    x[index] += torch.tensor(biases, dtype=x.dtype, device=x.device)


def _apply_suppression(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = x.shape[1]
    pairs = [(i, t) for i, r in enumerate(rows) for t in r.suppressed_token_ids if 0 <= t < vocab]
    if not pairs:
        return
    row_ids, token_ids = zip(*pairs)
    x[_index(list(row_ids), x.device), _index(list(token_ids), x.device)] = float("-inf")


def _sample(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Token per row of x (non-greedy rows only); x is not modified."""
    params = [r.params for r in rows]
    x = x / _column([p.temperature for p in params], x.device)
    _truncate(x, params)
    probs = torch.softmax(x, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        threshold = _column([p.min_p for p in params], x.device) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return _inverse_cdf(probs, _uniforms(rows, x.device))


def _truncate(x: torch.Tensor, params: list[SamplingParams]) -> None:
    """Top-k, then top-p over what top-k kept, in place; dropped tokens get -inf.

    A row with top-k only needs its k best tokens (topk, cheap); only rows with top-p and no
    top-k pay for a full sort.
    """
    vocab = x.shape[1]
    has_top_k = [0 < p.top_k < vocab for p in params]
    k_rows = [i for i, p in enumerate(params) if has_top_k[i]]
    p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0 and not has_top_k[i]]
    for picked, use_sort in ((k_rows, False), (p_rows, True)):
        if not picked:
            continue
        sub_params = [params[i] for i in picked]
        index = _index(picked, x.device)
        sub = x.index_select(0, index)
        if use_sort:
            values, order = sub.sort(dim=-1, descending=True)
        else:
            values, order = sub.topk(max(p.top_k for p in sub_params), dim=-1)
            top_k = torch.tensor([p.top_k for p in sub_params], device=x.device).unsqueeze(1)
            rank = torch.arange(values.shape[1], device=x.device)
            values.masked_fill_(rank >= top_k, float("-inf"))
        if any(p.top_p < 1.0 for p in sub_params):
            _top_p_sorted(values, sub_params)
        x[index] = torch.full_like(sub, float("-inf")).scatter_(1, order, values)


def _top_p_sorted(values: torch.Tensor, params: list[SamplingParams]) -> None:
    """Top-p in place on logits sorted descending (a prefix of the row is enough)."""
    probs = torch.softmax(values, dim=-1)
    # Mass of the strictly more likely tokens; the top token's is 0, so it is always kept.
    mass_before = probs.cumsum(dim=-1) - probs
    top_p = _column([p.top_p if p.top_p < 1.0 else _TOP_P_DISABLED for p in params], values.device)
    values.masked_fill_(mass_before >= top_p, float("-inf"))


def _uniforms(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    """One U[0, 1) draw per row: seeded rows from their own generator, the rest batched."""
    u = torch.empty(len(rows), device=device)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        u[_index(unseeded, device)] = torch.rand(len(unseeded), device=device)
    seeded = [i for i, r in enumerate(rows) if r.generator is not None]
    if seeded:
        draws = [torch.rand(1, generator=g, device=g.device).to(device)
                 for g in (rows[i].generator for i in seeded)]
        u[_index(seeded, device)] = torch.cat(draws)
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose slice of the (unnormalised) cumulative mass holds u * total.

    With right=True token i is picked iff cdf[i-1] <= target < cdf[i], so a zero-probability
    token (cdf[i] == cdf[i-1]) never is. u < 1 keeps target < total even after rounding (a
    product with a factor below 1 never rounds up to the other factor), so the index stays in
    the vocab.
    """
    cdf = probs.cumsum(dim=-1)
    target = u.unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _logprobs(logits: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor,
              ids: list[int]) -> list[TokenLogprobs | None]:
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return out
    device = logits.device
    index = _index(wanted, device)
    logprobs = torch.log_softmax(logits.index_select(0, index).to(torch.float32), dim=-1)
    chosen = logprobs.gather(1, token_ids[index].unsqueeze(1)).squeeze(1).tolist()
    num_top = max(rows[i].params.logprobs for i in wanted)
    top_values: list[list[float]] = [[] for _ in wanted]
    top_ids: list[list[int]] = [[] for _ in wanted]
    if num_top > 0:
        values, indices = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
        top_values, top_ids = values.tolist(), indices.tolist()
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs
        top = tuple(zip(top_ids[j][:n], top_values[j][:n]))
        out[i] = TokenLogprobs(token_id=ids[i], logprob=chosen[j], top=top)
    return out
