"""The OpenAI API's wire shapes: request bodies as pydantic models (they make /openapi.json),
responses as JSON built by one small class per endpoint.

Unknown fields are ignored (the OpenAI SDK sends some we do not use). Fields the router does not
support yet are still declared, so that a client that sets them gets a 400 that says so instead of
a silently different answer; :mod:`services.router.openai_api` does those checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from services.router.openai_api import OutputText


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    """Send a last chunk (``choices: []``) carrying the usage."""


class ImageURL(_Body):
    url: str
    """A ``data:image/<format>;base64,...`` URI; the router fetches no URLs."""
    detail: str | None = None


class ContentPart(_Body):
    """One part of a message's content: ``{"type": "text", "text": ...}`` or
    ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``."""

    # One model rather than a tagged union: pydantic's union errors name internal tags, and a
    # missing "text" / "image_url" is reported by the prompt builder in plain words.
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(_Body):
    role: str
    """system, user, assistant, or developer (rendered as system)."""
    content: str | list[ContentPart] | None = None
    name: str | None = None


class SamplingFields(_Body):
    """Sampling knobs shared by both endpoints; None means the SamplingParams default."""

    model: str | None = None
    """Any served model name; omitted means the backend's model."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    """Default: the rest of the context (max_model_len - prompt tokens)."""
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    """Only 1 is supported yet."""
    logit_bias: dict[str, float] | None = None
    """Not supported yet: only null or {} is accepted."""
    user: str | None = None
    # vLLM-style extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    """vLLM extension: non-streaming choices also carry the generated ``token_ids``."""
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    """vLLM extension: salts the prefix cache, so only requests with the same salt share cached
    KV (and none can time another's prompts)."""
    kv_retention: Literal["agent", "chat"] | None = None
    """epd extension: how long the KV store keeps this request's blocks (agent: 3 days, chat:
    7 days by default). Default: chat for chat completions, agent for completions."""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    """Wins over max_tokens when both are given."""
    logprobs: bool | None = None
    """Not supported yet: only false / null."""
    top_logprobs: int | None = None
    """Not supported yet."""
    tools: list[Any] | None = None
    """Not supported yet: only null or []."""
    tool_choice: Any = None
    """Not supported yet: only null or "none"."""
    functions: list[Any] | None = None
    """Not supported yet: only null or []."""
    function_call: Any = None
    """Not supported yet: only null or "none"."""
    response_format: dict[str, Any] | None = None
    """Only {"type": "text"} yet."""


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    """A string or a list of token ids (a list holding exactly one of either is accepted too)."""
    echo: bool = False
    """Not supported yet."""
    suffix: str | None = None
    """Not supported yet."""
    best_of: int | None = None
    """Only 1 yet."""
    logprobs: int | None = None
    """Not supported yet."""


# Responses are plain JSON built here, one class per endpoint with the same methods, so the HTTP
# layer drives chat, completions (and anthropic_api's messages) with one streaming loop.

def usage_body(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


@dataclass(frozen=True)
class _OpenAIFormat:
    """The streaming loop's side of an OpenAI endpoint: data-only events (no SSE event names), an
    error as one more data event, and ``data: [DONE]`` last, after an error too."""

    id: str
    model: str
    created: int
    include_usage: bool = False
    """``stream_options.include_usage``: a last chunk carries the usage."""
    return_token_ids: bool = False
    terminator: ClassVar[bytes] = b"data: [DONE]\n\n"

    def start_events(self, out: OutputText) -> list[tuple[str | None, dict]]:
        first = self.first_chunk()
        return [] if first is None else [(None, first)]

    def text_event(self, text: str) -> tuple[str | None, dict]:
        return None, self.text_chunk(text)

    def end_events(self, out: OutputText) -> list[tuple[str | None, dict]]:
        events = [(None, self.finish_chunk(out.finish_reason))]
        if self.include_usage:
            events.append((None, self.usage_chunk(out.usage())))
        return events

    def error_event(self, body: dict) -> tuple[str | None, dict]:
        return None, body

    def response(self, out: OutputText) -> dict:
        body = self.full_response(out.text, out.finish_reason, out.usage())
        if self.return_token_ids:
            body["choices"][0]["token_ids"] = out.token_ids
        return body


class ChatFormat(_OpenAIFormat):
    def _chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def _choice_chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])

    def first_chunk(self) -> dict | None:
        return self._choice_chunk({"role": "assistant", "content": ""})

    def text_chunk(self, text: str) -> dict:
        return self._choice_chunk({"content": text})

    def finish_chunk(self, finish_reason: str) -> dict:
        return self._choice_chunk({}, finish_reason)

    def usage_chunk(self, usage: dict) -> dict:
        return self._chunk([], usage=usage)

    def full_response(self, text: str, finish_reason: str, usage: dict) -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": finish_reason, "logprobs": None}],
                "usage": usage}


class CompletionFormat(_OpenAIFormat):
    def _body(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def _choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def first_chunk(self) -> dict | None:
        return None  # completions chunks carry no role

    def text_chunk(self, text: str) -> dict:
        return self._body([self._choice(text, None)])

    def finish_chunk(self, finish_reason: str) -> dict:
        return self._body([self._choice("", finish_reason)])

    def usage_chunk(self, usage: dict) -> dict:
        return self._body([], usage=usage)

    def full_response(self, text: str, finish_reason: str, usage: dict) -> dict:
        return self._body([self._choice(text, finish_reason)], usage=usage)
