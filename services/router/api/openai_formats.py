"""The OpenAI endpoints' responses: JSON built by one small class per endpoint (chat completions,
completions) with the methods every protocol's format has (see generation.Format), so the HTTP core
drives each protocol with one loop.

Both carry ``n`` choices, each token's logprobs when asked (chat: ``logprobs.content``; completions:
the legacy ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` lists), and chat
turns the text into ``tool_calls`` when the request offered tools; a stream sends them as
``tool_calls`` deltas (id and name, then the arguments in pieces) as tools.ToolStream finds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from services.common.sampling_params import TokenLogprobs
from services.router.api.openai_models import usage_body
from services.router.api.output import OutputText
from services.router.api.tools import CallStart, StreamEvent, TextPiece, ToolPlan, ToolStream

Event = tuple[str | None, dict]


@dataclass(frozen=True)
class _OpenAIFormat:
    """Data-only events (no SSE event names), an error as one more data event, ``data: [DONE]``
    last, after an error too."""

    id: str
    model: str
    created: int
    include_usage: bool = False
    """``stream_options.include_usage``: a last chunk carries the usage."""
    return_token_ids: bool = False
    n: int = 1
    logprobs: bool = False
    """Each choice carries its tokens' logprobs."""
    system_fingerprint: str | None = None
    """In every object and chunk (openai_api.system_fingerprint)."""
    terminator: ClassVar[bytes] = b"data: [DONE]\n\n"

    def start_events(self, outs: list[OutputText]) -> list[Event]:
        return [(None, chunk) for out in outs if (chunk := self.first_chunk(out)) is not None]

    def text_events(self, out: OutputText, text: str) -> list[Event]:
        return [(None, self.text_chunk(out, text))]

    def choice_end_events(self, out: OutputText) -> list[Event]:
        return [(None, self.finish_chunk(out))]

    def end_events(self, outs: list[OutputText]) -> list[Event]:
        return [(None, self.body([], usage=usage_of(outs)))] if self.include_usage else []

    def error_event(self, body: dict) -> Event:
        return None, body

    def response(self, outs: list[OutputText]) -> dict:
        choices = [self.full_choice(out) for out in outs]
        if self.return_token_ids:
            for choice, out in zip(choices, outs):
                choice["token_ids"] = out.token_ids
        return self.body(choices, usage=usage_of(outs), final=True)

    def with_token_ids(self, out: OutputText, choice: dict) -> dict:
        """A stream chunk's choice, with the ids of the tokens new since the last one when the
        request asked for them (vLLM's ``return_token_ids``)."""
        if self.return_token_ids:
            choice["token_ids"] = out.take_token_ids()
        return choice

    def body(self, choices: list[dict], usage: dict | None = None, final: bool = False) -> dict:
        body = {"id": self.id, "object": self.object_name(final), "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def token_text(self, out: OutputText, token_id: int) -> tuple[str, bytes]:
        raw = out.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw


@dataclass(frozen=True)
class ChatFormat(_OpenAIFormat):
    tools: ToolPlan | None = None
    """The request offered tools: the text may be calls (tools.ToolStream says when it is)."""
    tool_streams: dict[int, ToolStream] = field(default_factory=dict, compare=False)
    """Per streamed choice."""

    @staticmethod
    def object_name(final: bool) -> str:
        return "chat.completion" if final else "chat.completion.chunk"

    def _logprobs(self, out: OutputText, entries: list[TokenLogprobs]) -> dict | None:
        if not self.logprobs:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text, raw = self.token_text(out, token_id)
            return {"token": text, "logprob": logprob, "bytes": list(raw)}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in entries], "refusal": None}

    def _chunk(self, out: OutputText, delta: dict, finish_reason: str | None = None, logprobs=None) -> dict:
        return self.body([self.with_token_ids(out, {"index": out.index, "delta": delta, "logprobs": logprobs,
                                                    "finish_reason": finish_reason})])

    def first_chunk(self, out: OutputText) -> dict | None:
        return self._chunk(out, {"role": "assistant", "content": ""})

    def text_events(self, out: OutputText, text: str) -> list[Event]:
        if self.tools is not None:
            return self._tool_events(out, self._tool_stream(out).add(text))
        return [(None, self._chunk(out, {"content": text}, logprobs=self._logprobs(out, out.take_logprobs())))]

    def _tool_stream(self, out: OutputText) -> ToolStream:
        return self.tool_streams.setdefault(out.index, self.tools.stream("call_"))

    def _tool_events(self, out: OutputText, pieces: list[StreamEvent]) -> list[Event]:
        """Content deltas, and tool_calls deltas as OpenAI streams them: the call's id and name
        first (arguments ""), then pieces of its arguments."""
        events = []
        for piece in pieces:
            if isinstance(piece, CallStart):
                delta = {"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function",
                                         "function": {"name": piece.name, "arguments": ""}}]}
            elif not piece.text:
                continue
            elif isinstance(piece, TextPiece):
                delta = {"content": piece.text}
            else:
                delta = {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}
            events.append((None, self._chunk(out, delta, logprobs=self._logprobs(out, out.take_logprobs()))))
        return events

    def _message(self, out: OutputText) -> tuple[dict, str]:
        """The choice's message and finish_reason."""
        if self.tools is None:
            return {"role": "assistant", "content": out.text}, out.finish_reason
        content, calls = self.tools.parse(out.text, "call_")
        message = {"role": "assistant", "content": content or None}
        if not calls:
            return message, out.finish_reason
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls]
        return message, "tool_calls"

    def choice_end_events(self, out: OutputText) -> list[Event]:
        if self.tools is None:
            return [(None, self._chunk(out, {}, out.finish_reason))]
        stream = self._tool_stream(out)
        events = self._tool_events(out, stream.finish(out.text))
        left = out.take_logprobs()  # of tokens whose text is still held (a call's closing brace)
        logprobs = self._logprobs(out, left) if left else None
        return [*events, (None, self._chunk(out, {}, "tool_calls" if stream.has_calls else out.finish_reason,
                                            logprobs))]

    def full_choice(self, out: OutputText) -> dict:
        message, finish_reason = self._message(out)
        return {"index": out.index, "message": message, "finish_reason": finish_reason,
                "logprobs": self._logprobs(out, out.logprobs)}


@dataclass(frozen=True)
class CompletionFormat(_OpenAIFormat):
    offsets: dict[int, int] = field(default_factory=dict)
    """Per choice: characters of the token texts already reported (``text_offset``)."""

    @staticmethod
    def object_name(final: bool) -> str:
        return "text_completion"

    def _logprobs(self, out: OutputText, entries: list[TokenLogprobs]) -> dict | None:
        if not self.logprobs:
            return None
        texts = [self.token_text(out, lp.token_id)[0] for lp in entries]
        offsets = []
        for text in texts:
            offsets.append(self.offsets.get(out.index, 0))
            self.offsets[out.index] = offsets[-1] + len(text)
        return {"tokens": texts, "token_logprobs": [lp.logprob for lp in entries],
                "top_logprobs": [{self.token_text(out, t)[0]: v for t, v in lp.top} for lp in entries],
                "text_offset": offsets}

    def _choice(self, out: OutputText, text: str, finish_reason: str | None, logprobs) -> dict:
        return {"index": out.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def first_chunk(self, out: OutputText) -> dict | None:
        return None  # completions chunks carry no role

    def text_chunk(self, out: OutputText, text: str) -> dict:
        return self.body([self.with_token_ids(out, self._choice(out, text, None, self._logprobs(out, out.take_logprobs())))])

    def finish_chunk(self, out: OutputText) -> dict:
        return self.body([self.with_token_ids(out, self._choice(out, "", out.finish_reason,
                                                                self._logprobs(out, out.take_logprobs())))])

    def full_choice(self, out: OutputText) -> dict:
        return self._choice(out, out.text, out.finish_reason, self._logprobs(out, out.logprobs))


def usage_of(outs: list[OutputText]) -> dict:
    """One request's usage over its choices: the prompt once, every choice's output."""
    first = outs[0]
    return usage_body(first.num_prompt_tokens, sum(o.num_output_tokens for o in outs), first.num_cached_tokens)
