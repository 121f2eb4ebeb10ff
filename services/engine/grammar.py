"""Grammar-constrained decoding: each constrained request's matcher, and the allowed-token mask.

The model runner owns one :class:`GrammarMatchers`, next to its seeded generators and with the
same life cycle per request::

    first sampled step   matcher = compiled.new_matcher(), then the output tokens the request
                         already has are replayed into it (a decode instance resuming after the
                         prefill instance sampled the first token rebuilds the same state)
    every sampled step   bitmask(): one int32 bitmask row per constrained request, all filled by
                         one llguidance call (Rust threads, GIL released) -> the sampler adds
                         -inf to every disallowed logit before penalties, temperature or argmax
                         accept(): each matcher consumes its sampled token
    finished / aborted   drop(): via SchedulerOutput.finished_request_ids
    / detached

Unconstrained rows pay nothing; a batch without a constrained row pays one dict check per row.
When a grammar is complete its mask allows only EOS, so generation ends with "stop".

Bitmask layout (llguidance's, which is also xgrammar's)::

    bits[row, w] bit b (little-endian)  <->  token id 32 * w + b      1: allowed

Applying it: the int32 words are viewed as bytes and looked up in a [256, 8] table of 0 / -inf
(one row per byte value), giving an additive bias of the logits' width. On the CPU that runs in
numpy: single-threaded, so no OpenMP fork and join per op, which on a busy 2-core machine made
the same three torch ops 100x slower (18 ms vs 0.18 ms for 8 rows); on a GPU the same gather
and add run in torch on the device.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from services.engine.sequence import RequestId
from services.engine.structured import CompiledGrammar

logger = logging.getLogger(__name__)
_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool)
_BYTE_BIAS = np.where(_BITS, 0.0, -np.inf).astype(np.float32)
"""[256, 8]: the additive bias of the 8 tokens a mask byte covers (0 allowed, -inf not)."""


@dataclass
class TokenBitmask:
    """The allowed tokens of the constrained rows of one step's batch."""

    rows: list[int]
    """Row of the sampler's batch each bitmask row belongs to."""
    bits: torch.Tensor
    """int32 [len(rows), ceil(vocab / 32)] on the CPU (see the module docstring)."""

    def apply_(self, logits: torch.Tensor) -> None:
        """-inf, in place, at every disallowed token of the constrained rows of ``logits``."""
        num_rows, vocab = len(self.rows), logits.shape[1]
        assert self.bits.shape == (num_rows, (vocab + 31) // 32), (tuple(self.bits.shape), vocab)
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
            byte_ids = self.bits.numpy().view(np.uint8).reshape(-1)
            bias = np.take(_BYTE_BIAS, byte_ids, axis=0).reshape(num_rows, -1)[:, :vocab]
            x = logits.numpy()  # shares memory with logits
            if num_rows == len(x):
                x += bias
            else:
                x[self.rows] += bias
        else:
            self._apply_torch_(logits)

    def _apply_torch_(self, logits: torch.Tensor) -> None:
        num_rows, vocab, device = len(self.rows), logits.shape[1], logits.device
        # A blocking copy: the CPU buffer is refilled next step. On a GPU it waits for the
        # forward, which the sampler waits for anyway.
        byte_ids = self.bits.view(torch.uint8).to(device).view(-1).long()
        bias = _byte_bias(device).index_select(0, byte_ids).view(num_rows, -1)[:, :vocab].to(logits.dtype)
        if num_rows == logits.shape[0]:
            logits.add_(bias)
        else:
            logits.index_add_(0, torch.tensor(self.rows, dtype=torch.long, device=device), bias)


@functools.cache
def _byte_bias(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_BYTE_BIAS).to(device)


class GrammarMatchers:
    def __init__(self, vocab_size: int) -> None:
        self.num_words = (vocab_size + 31) // 32
        self._matchers: dict[RequestId, llguidance.LLMatcher] = {}
        self._executor: llguidance.LLExecutor | None = None
        # Reused across steps, grown by doubling; bitmask() hands out views of its first rows.
        self._buffer = torch.empty((0, self.num_words), dtype=torch.int32)

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, request_id: RequestId) -> bool:
        return request_id in self._matchers

    def drop(self, request_id: RequestId) -> None:
        self._matchers.pop(request_id, None)

    def matcher(self, request_id: RequestId, grammar: CompiledGrammar,
                output_token_ids: Sequence[int]) -> llguidance.LLMatcher:
        """The request's matcher, created (and caught up on ``output_token_ids``) on first use."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            matcher = grammar.new_matcher()
            if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
                # The engine checked these tokens when the request arrived: this is a bug, but one
                # request's; its matcher now allows only EOS, which ends it.
                logger.error("request %s: its output tokens do not match its grammar: %s", request_id,
                             matcher.get_error())
            self._matchers[request_id] = matcher
        return matcher

    def bitmask(self, rows: list[tuple[int, llguidance.LLMatcher]]) -> TokenBitmask | None:
        """The allowed tokens for (batch row, matcher) pairs, all filled in one call."""
        if not rows:
            return None
        if self._buffer.shape[0] < len(rows):
            self._buffer = torch.empty((max(len(rows), 2 * self._buffer.shape[0]), self.num_words),
                                       dtype=torch.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        bits = self._buffer[:len(rows)]
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, (_, m) in enumerate(rows)], bits.data_ptr(),
                                               self.num_words * 4, len(rows))
        return TokenBitmask([row for row, _ in rows], bits)

    def accept(self, request_ids: Sequence[RequestId], token_ids: Sequence[int]) -> None:
        """Each constrained request's matcher consumes the token it was given."""
        for request_id, token_id in zip(request_ids, token_ids):
            matcher = self._matchers.get(request_id)
            if matcher is not None and not matcher.consume_token(token_id):
                # Masks allow only what the grammar accepts (EOS included), so this is a bug; the
                # matcher now allows only EOS, which ends the request rather than the engine.
                logger.error("request %s: token %d was sampled against its grammar: %s", request_id, token_id,
                             matcher.get_error())
