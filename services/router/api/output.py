"""One choice's output as its chunks arrive, the same for every protocol: the text that is safe
to send (stop strings cut, no broken UTF-8), token ids, logprobs, finish and the counts usage is
made of. Each protocol's format (openai_formats, anthropic_api.MessagesFormat,
responses_format) shapes it."""

from __future__ import annotations

from services.common.errors import UnavailableError
from services.common.sampling_params import TokenLogprobs
from services.common.text import TextState
from services.common.tokenizer import Tokenizer
from services.router.cluster.backend import GenerateChunk, GenerateRequest


class OutputText:
    """One request's output as chunks arrive: the text a client may be sent, and the usage.

    The router detokenizes with the same :class:`TextState` the engine uses, so a stop string is
    found here too; the caller then stops reading (and closes the backend iterator).
    """

    def __init__(self, tokenizer: Tokenizer, request: GenerateRequest, index: int = 0) -> None:
        params = request.params
        self.index = index
        """The choice's index (OpenAI's ``n``)."""
        self.tokenizer = tokenizer
        self._state = TextState(tokenizer, request.prompt_token_ids, params.stop, params.skip_special_tokens)
        # The token that ended a request on EOS / a stop token id is counted but not shown.
        self._ending_ids = frozenset((*tokenizer.eos_token_ids, *params.stop_token_ids))
        self.num_sent_chars = 0
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[TokenLogprobs] = []
        """Of the shown tokens (not of a hidden EOS / stop token id), when the request asked."""
        self.num_sent_logprobs = 0
        self.num_sent_token_ids = 0

    @property
    def text(self) -> str:
        return self._state.text

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, chunk: GenerateChunk) -> str:
        """Feed one chunk; returns the text that became safe to send (all of it once finished)."""
        assert not self.is_finished, "a chunk arrived after the request finished"
        if chunk.finish_reason == "abort":
            raise UnavailableError("the backend aborted the request; retry it")
        self.num_prompt_tokens, self.num_cached_tokens = chunk.num_prompt_tokens, chunk.num_cached_tokens
        token_ids = chunk.token_ids
        hide_last = (chunk.finish_reason == "stop" and not isinstance(chunk.stop_reason, str)
                     and token_ids and token_ids[-1] in self._ending_ids)
        for i, token_id in enumerate(token_ids):
            self.num_output_tokens += 1
            self.token_ids.append(token_id)
            if hide_last and i == len(token_ids) - 1:
                break
            if i < len(chunk.logprobs):
                self.logprobs.append(chunk.logprobs[i])
            if (stop := self._state.add(token_id)) is not None:
                self.finish_reason, self.stop_reason = "stop", stop
                return self._take(len(self.text))
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason
            self._state.finish()
            return self._take(len(self.text))
        return self._take(self._state.num_safe_chars)

    def _take(self, end: int) -> str:
        delta = self.text[self.num_sent_chars:end]
        self.num_sent_chars = max(self.num_sent_chars, end)
        return delta

    def take_token_ids(self) -> list[int]:
        """The token ids not handed out yet (``return_token_ids``: each stream chunk carries
        those new since the previous one; all of them add up to ``token_ids``)."""
        new = self.token_ids[self.num_sent_token_ids:]
        self.num_sent_token_ids = len(self.token_ids)
        return new

    def take_logprobs(self) -> list[TokenLogprobs]:
        """The logprobs not handed out yet (a stream sends each token's with the text it came in)."""
        new = self.logprobs[self.num_sent_logprobs:]
        self.num_sent_logprobs = len(self.logprobs)
        return new


def num_request_tokens(outs: list[OutputText]) -> int:
    """What one request costs (the prompt once, every choice's output): its usage's total."""
    return outs[0].num_prompt_tokens + sum(o.num_output_tokens for o in outs)
