"""Anthropic Messages protocol <-> GenerateRequest: request bodies, the response format, the checks.

Supported (``POST /v1/messages`` and ``POST /v1/messages/count_tokens``):

* ``model`` (required): the backend's model name or any ``--served-model-name``; else a 404.
* ``messages``: roles ``user`` and ``assistant`` (anything else is a 400 naming it); ``content`` a
  string or a list of blocks: ``{"type": "text", "text": ...}`` and, for a model that takes images,
  ``{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ...}}``
  (mapped to the data URI the OpenAI path takes; URL sources are a 400, the router fetches nothing).
  ``system``: a string or a list of text blocks. Blocks are joined with "\\n" as OpenAI parts are;
  the conversation then goes through the same chat template and tokenizing as chat completions.
* ``max_tokens`` (required on /v1/messages, >= 1), ``temperature`` (0 to 1, Anthropic's range),
  ``top_p``, ``top_k``, ``stop_sequences`` (at most body_checks.MAX_STOP_STRINGS), ``stream``,
  ``metadata`` (accepted, ignored), and the epd extensions ``cache_salt`` / ``kv_retention``
  (default ``chat``) as the OpenAI bodies have them.
* ``tools`` (client tools with an ``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool``,
  ``none``): the output is constrained by the tools' schemas (services/router/api/tools.py) and parsed
  into ``tool_use`` blocks; earlier ``tool_use`` / ``tool_result`` blocks go back into the prompt. A
  stream sends a text block while there is text, then a ``tool_use`` block per call whose input
  streams as ``input_json_delta`` pieces (tools.ToolStream).
* ``stop_reason``: ``end_turn`` (EOS), ``max_tokens``, ``tool_use``, or ``stop_sequence`` with the
  matched ``stop_sequence``. ``usage.cache_read_input_tokens`` are the prompt tokens served from the KV
  cache; ``cache_creation_input_tokens`` is always 0 (caching is automatic, never billed apart).
* count_tokens answers ``{"input_tokens": N}``: the templated prompt's tokens, one per image
  (the encoder side widens each image later); a prompt whose length alone shows it cannot fit the
  context is a 400 ("the prompt is at least N tokens"), as on /v1/messages, without tokenizing it.

Not supported yet, a 400 that says so: other block types (``document``, ``thinking``, ...), server
tools (``web_search``, ...) and an enabled ``thinking``.
Unknown fields are ignored. Errors use Anthropic's body, ``{"type": "error", "error": {"type",
"message"}}``, with the same statuses as the OpenAI endpoints (503 is an ``overloaded_error``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.common.errors import invalid
from services.router.api import openai_api as api
from services.router.api import prompts, structured
from services.router.cluster.backend import Backend, GenerateRequest
from services.router.api.body_checks import MAX_STOP_STRINGS, check_ranges
from services.router.api.prompts import Prompt
from services.router.api.output import OutputText
from services.router.api.openai_models import (ChatMessage, ContentPart, FunctionCall, ImageURL, MessageToolCall,
                                           RequestBody, SamplingFields)
from services.router.api.tools import CallStart, StreamEvent, TextPiece, ToolPlan, ToolStream, anthropic_plan
from services.router.errors import anthropic_error_body

error_body = anthropic_error_body
"""The protocol's error format: one of its two entry points (with :func:`build`)."""
MAX_TEMPERATURE = 1.0
"""Anthropic's documented range is [0, 1] (OpenAI's goes to 2)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageSource(_Body):
    type: str
    """Only ``base64`` is accepted."""
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ContentBlock(_Body):
    """``text``, ``image``, ``tool_use`` (an assistant's call) or ``tool_result`` (its answer, in a
    user turn); any other type is declared only to be rejected in plain words (a 400 that names it)."""

    type: str
    text: str | None = None
    source: ImageSource | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None
    """A tool_result's content: a string or text blocks."""
    is_error: bool | None = None


class AnthropicMessage(_Body):
    role: str
    """user or assistant."""
    content: str | list[ContentBlock]


class CountTokensRequest(RequestBody):
    model: str
    messages: list[AnthropicMessage]
    system: str | list[ContentBlock] | None = None
    tools: list[Any] | None = None
    """Client tools: ``{"name", "description", "input_schema"}``."""
    tool_choice: Any = None
    """``{"type": "auto" | "any" | "tool" | "none", "name": ...}``."""
    thinking: Any = None
    """Not supported yet: only null or {"type": "disabled"}."""


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    temperature: float | None = None
    """0 to 1."""
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    """Accepted and ignored."""
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    """vLLM extension: only requests with the same salt share cached KV."""
    kv_retention: Literal["agent", "chat"] | None = None
    """epd extension: how long the KV store keeps this request's blocks. Default: chat."""


def _check_supported(body: CountTokensRequest) -> None:
    if body.thinking is not None and body.thinking != {"type": "disabled"}:
        raise invalid("thinking is not supported yet", "thinking")


def _part(block: ContentBlock, param: str, image_token_id: int | None) -> ContentPart:
    if block.type == "text":
        if block.text is None:
            raise invalid(f"{param}: a text block needs \"text\"", param)
        return ContentPart(type="text", text=block.text)
    if block.type != "image":
        raise invalid(f"{param}: {block.type!r} blocks are not supported yet (only text and image)", param)
    if image_token_id is None:
        raise invalid(f"{param}: {prompts.NO_IMAGES}", param)
    source = block.source
    if source is None or source.type != "base64" or not source.media_type or source.data is None:
        raise invalid(f"{param}: only base64 image sources are accepted ({{\"type\": \"base64\", "
                      f"\"media_type\": \"image/png\", \"data\": ...}}); the router fetches URLs only under its "
                      f"--allow-image-urls prefixes", param)
    url = prompts.check_image_uri(f"data:{source.media_type};base64,{source.data}", f"{param}.source")
    return ContentPart(type="image_url", image_url=ImageURL(url=url))


def _turns(message: AnthropicMessage, where: str, image_token_id: int | None) -> list[ChatMessage]:
    """One Anthropic turn as OpenAI-path messages: tool results become tool turns (before the
    turn's other content), an assistant's tool_use blocks become its tool_calls."""
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    results, parts, calls = [], [], []
    for i, block in enumerate(message.content):
        param = f"{where}.content[{i}]"
        if block.type == "tool_result" and message.role == "user":
            content = block.content if isinstance(block.content, str) else "\n".join(
                b.text or "" for b in block.content or () if b.type == "text")
            results.append(ChatMessage(role="tool", content=content, tool_call_id=block.tool_use_id))
        elif block.type == "tool_use" and message.role == "assistant":
            if not block.name or not isinstance(block.input, dict):
                raise invalid(f"{param}: a tool_use block needs \"name\" and an \"input\" object", param)
            calls.append(MessageToolCall(id=block.id, function=FunctionCall(name=block.name,
                                                                             arguments=json.dumps(block.input))))
        else:
            parts.append(_part(block, param, image_token_id))
    turn = ChatMessage(role=message.role, content=parts or None, tool_calls=calls or None)
    return [*results, turn] if parts or calls or not results else results


def chat_messages(body: CountTokensRequest, image_token_id: int | None) -> list[ChatMessage]:
    """The conversation as the OpenAI path's messages: the system prompt first, then the turns."""
    if not body.messages:
        raise invalid("messages must not be empty", "messages")
    messages = []
    if body.system:
        if not isinstance(body.system, str) and any(block.type != "text" for block in body.system):
            raise invalid("system: only text blocks are accepted", "system")
        system = body.system if isinstance(body.system, str) else [
            _part(block, f"system[{i}]", None) for i, block in enumerate(body.system)]
        messages.append(ChatMessage(role="system", content=system))
    for i, message in enumerate(body.messages):
        if message.role not in ("user", "assistant"):
            raise invalid(f"messages[{i}].role {message.role!r} is not supported (use user or assistant)",
                          f"messages[{i}].role")
        messages.extend(_turns(message, f"messages[{i}]", image_token_id))
    return messages


def prompt(body: CountTokensRequest, backend: Backend, model_names: list[str]) -> Prompt:
    """The checked body's prompt: the chat template's token ids (and images), as chat completions."""
    api.check_model(body.model, model_names)
    _check_supported(body)
    messages = chat_messages(body, backend.image_token_id)
    return prompts.chat_prompt(messages, backend.tokenizer, backend.image_token_id,
                               anthropic_plan(body.tools, body.tool_choice), backend.max_model_len)


def build(body: MessagesRequest, backend: Backend, model_names: list[str]) -> tuple[GenerateRequest, MessagesFormat]:
    """The protocol's entry point: a Messages body's GenerateRequest and the format that answers it."""
    # The OpenAI sampling fields of the same meaning, so both protocols share one set of checks.
    fields = SamplingFields(model=body.model, stream=body.stream, max_tokens=body.max_tokens,
                            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                            stop=body.stop_sequences, cache_salt=body.cache_salt, kv_retention=body.kv_retention)
    if body.stop_sequences is not None and len(body.stop_sequences) > MAX_STOP_STRINGS:
        raise invalid(f"stop_sequences has {len(body.stop_sequences)} strings; at most {MAX_STOP_STRINGS} "
                      f"are accepted", "stop_sequences")
    check_ranges(fields, MAX_TEMPERATURE)  # before the prompt is built: cheap checks first
    checked = prompt(body, backend, model_names)
    tools = anthropic_plan(body.tools, body.tool_choice)
    params = api.sampling_params(fields, len(checked.token_ids), backend.max_model_len, "messages",
                                 structured=structured.pick(("tools", tools and tools.structured())))
    request = api.generate_request(f"msg_{uuid.uuid4().hex}", checked, params, fields, "chat")
    return request, MessagesFormat(request.request_id, body.model, tools)


@dataclass(frozen=True)
class MessagesFormat:
    """A Messages response, and its stream as Anthropic's named events (no terminator)."""

    id: str
    model: str
    tools: ToolPlan | None = None
    """The request offered tools: the text may be calls (tools.ToolStream says when it is)."""
    _stream: dict = field(default_factory=dict, compare=False)
    """A stream's state: its ToolStream, the open block's index, the next block's index."""
    terminator: ClassVar[bytes] = b""
    n: ClassVar[int] = 1

    def _content(self, out: OutputText) -> tuple[list[dict], bool]:
        """The content blocks, and whether any is a call."""
        if self.tools is None:
            return [{"type": "text", "text": out.text}], False
        text, calls = self.tools.parse(out.text, "toolu_")
        blocks = [{"type": "text", "text": text}] if text or not calls else []
        return blocks + [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in calls], bool(calls)

    @staticmethod
    def _stop(out: OutputText) -> tuple[str, str | None]:
        """stop_reason and stop_sequence of an output that is not a call."""
        if out.finish_reason == "length":
            return "max_tokens", None
        if isinstance(out.stop_reason, str):
            return "stop_sequence", out.stop_reason
        return "end_turn", None

    @staticmethod
    def _usage(out: OutputText, num_output_tokens: int) -> dict:
        return {"input_tokens": out.num_prompt_tokens, "output_tokens": num_output_tokens,
                "cache_read_input_tokens": out.num_cached_tokens, "cache_creation_input_tokens": 0}

    def _message(self, content: list[dict], stop: tuple[str | None, str | None], usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def response(self, outs: list[OutputText]) -> dict:
        out, = outs
        content, has_calls = self._content(out)
        stop = ("tool_use", None) if has_calls else self._stop(out)
        return self._message(content, stop, self._usage(out, out.num_output_tokens))

    def start_events(self, outs: list[OutputText]) -> list[tuple[str | None, dict]]:
        out, = outs
        # Usage so far: the prompt's; output_tokens grows in message_delta.
        message = self._message([], (None, None), self._usage(out, 0))
        events = [("message_start", {"type": "message_start", "message": message})]
        if self.tools is None:
            events.append(self._block_start(0, {"type": "text", "text": ""}))
        return [*events, ("ping", {"type": "ping"})]

    @staticmethod
    def _block_start(index: int, block: dict) -> tuple[str, dict]:
        return "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}

    @staticmethod
    def _delta(index: int, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}

    def text_events(self, out: OutputText, text: str) -> list[tuple[str | None, dict]]:
        if self.tools is None:
            return [self._delta(0, {"type": "text_delta", "text": text})]
        return self._tool_events(self._tool_stream().add(text))

    def _tool_stream(self) -> ToolStream:
        return self._stream.setdefault("tools", self.tools.stream("toolu_"))

    def _tool_events(self, pieces: list[StreamEvent]) -> list[tuple[str | None, dict]]:
        """With tools: a text block while there is text, then a tool_use block per call whose
        input streams as JSON text."""
        events = []
        for piece in pieces:
            if isinstance(piece, CallStart):
                events += self._close_block()
                events += self._open_block({"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}})
            elif not piece.text:
                continue
            elif isinstance(piece, TextPiece):
                if "open" not in self._stream:
                    events += self._open_block({"type": "text", "text": ""})
                events.append(self._delta(self._stream["open"], {"type": "text_delta", "text": piece.text}))
            else:
                events.append(self._delta(self._stream["open"], {"type": "input_json_delta", "partial_json": piece.text}))
        return events

    def _open_block(self, block: dict) -> list[tuple[str | None, dict]]:
        index = self._stream["open"] = self._stream.get("next", 0)
        self._stream["next"] = index + 1
        return [self._block_start(index, block)]

    def _close_block(self) -> list[tuple[str | None, dict]]:
        index = self._stream.pop("open", None)
        return [] if index is None else [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def choice_end_events(self, out: OutputText) -> list[tuple[str | None, dict]]:
        return []

    def end_events(self, outs: list[OutputText]) -> list[tuple[str | None, dict]]:
        out, = outs
        stop_reason, stop_sequence = self._stop(out)
        if self.tools is None:
            blocks = [("content_block_stop", {"type": "content_block_stop", "index": 0})]
        else:
            stream = self._tool_stream()
            blocks = self._tool_events(stream.finish(out.text)) + self._close_block()
            if stream.has_calls:
                stop_reason, stop_sequence = "tool_use", None
        return [*blocks,
                ("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                   "usage": {"output_tokens": out.num_output_tokens}}),
                ("message_stop", {"type": "message_stop"})]

    def error_event(self, body: dict) -> tuple[str | None, dict]:
        return "error", body
