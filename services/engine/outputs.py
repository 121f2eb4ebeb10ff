"""What a request returns, and the per-request text bookkeeping (detokenizing, stop strings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.sampler import TokenLogprobs
from services.engine.sequence import FinishReason, RequestId, Sequence
from services.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    request_id: RequestId
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """"stop", "length", "abort", or None while running."""
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the request, if one did."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class OutputState:
    """Accumulates one request's output as tokens arrive."""

    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @classmethod
    def create(cls, seq: Sequence, prompt: str | None, tokenizer: Tokenizer | None) -> "OutputState":
        detok = None
        if tokenizer is not None:
            detok = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids,
                                           skip_special_tokens=seq.params.skip_special_tokens)
        return cls(seq, prompt, detok)

    def add_token(self, token_id: int, logprobs: TokenLogprobs | None) -> str | None:
        """Append a token's text; returns the stop string that matched, if any."""
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if self.detokenizer is None:
            return None
        delta = self.detokenizer.add(token_id)
        stops = self.seq.params.stop
        if not stops or not delta:
            self.text += delta
            return None
        # A stop string can straddle the previous text and this delta: search only the tail.
        search_from = max(0, len(self.text) - max(len(s) for s in stops) + 1)
        self.text += delta
        best: tuple[int, str] | None = None
        for stop in stops:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        self.text = self.text[:best[0]]
        return best[1]

    def finish(self) -> None:
        """Take what the detokenizer still holds (bytes that never became a character)."""
        stopped_by_string = isinstance(self.seq.stop_reason, str)  # the text was cut there
        if self.detokenizer is not None and not stopped_by_string:
            self.text += self.detokenizer.flush()

    def to_output(self) -> RequestOutput:
        seq = self.seq
        reason = seq.finish_reason.value if isinstance(seq.finish_reason, FinishReason) else None
        return RequestOutput(
            request_id=seq.request_id,
            prompt=self.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=self.text,
            token_ids=seq.output_token_ids,
            finish_reason=reason,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=list(self.logprobs) if seq.params.logprobs is not None else None,
            stop_reason=seq.stop_reason,
        )
