"""What a request returns, and the per-request text bookkeeping (detokenizing, stop strings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.sampling_params import TokenLogprobs
from services.common.text import TextState
from services.common.tokenizer import Tokenizer
from services.engine.sequence import FinishReason, RequestId, Sequence


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
    text_state: TextState | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @classmethod
    def create(cls, seq: Sequence, prompt: str | None, tokenizer: Tokenizer | None) -> "OutputState":
        text_state = None
        if tokenizer is not None:
            text_state = TextState(tokenizer, seq.prompt_token_ids, seq.params.stop,
                                   skip_special_tokens=seq.params.skip_special_tokens)
        return cls(seq, prompt, text_state)

    @property
    def text(self) -> str:
        return self.text_state.text if self.text_state is not None else ""

    def add_token(self, token_id: int, logprobs: TokenLogprobs | None, has_text: bool = True) -> str | None:
        """Append a token (and its text, unless ``has_text`` is False); returns the stop string
        that matched, if any."""
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if self.text_state is None or not has_text:
            return None
        return self.text_state.add(token_id)

    def add_tokens(self, num_new: int, logprobs: list) -> tuple[int, str] | None:
        """The sequence's last ``num_new`` tokens (one step's: one, or verified drafts and the
        token after them), one at a time until a stop string matches; then how many were taken
        (the rest must be dropped) and the stop string."""
        seq = self.seq
        first = len(seq.token_ids) - num_new
        for i in range(num_new):
            # The EOS or stop token that ended a request is kept in token_ids but not in the text.
            is_stop_token = i == num_new - 1 and seq.is_finished and seq.finish_reason is FinishReason.STOP
            stop = self.add_token(seq.token_ids[first + i], logprobs[i], has_text=not is_stop_token)
            if stop is not None:
                return i + 1, stop
        return None

    def finish(self) -> None:
        if self.text_state is not None:
            self.text_state.finish()

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
