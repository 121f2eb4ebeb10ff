"""OpenAI Responses protocol <-> GenerateRequest: the request body, its checks, the response format.

Supported (``POST /v1/responses``):

* ``model``: as chat completions (omitted: the backend's model; unknown: a 404).
* ``input``: a string (one user message) or a list of message items, ``{"role": "user" |
  "assistant" | "system" | "developer", "content": str | [{"type": "input_text" | "output_text",
  "text": ...}]}`` (``"type": "message"`` optional). ``instructions`` becomes a system message
  placed first. Parts are joined with "\\n" as chat parts are, and the conversation goes through
  the same chat template and tokenizing as chat completions (same messages, same token ids).
* ``max_output_tokens`` (>= 1; default: the rest of the context), ``temperature``, ``top_p``,
  ``stream``, ``metadata`` (echoed, otherwise ignored), ``store`` (accepted; nothing is stored),
  the vLLM-style ``top_k`` / ``seed`` and the epd extensions ``cache_salt`` / ``kv_retention``
  (default ``chat``).
* The response is ``status: completed``, or ``incomplete`` with ``incomplete_details.reason:
  max_output_tokens`` when the output budget (or the context) ran out. ``usage.input_tokens_details
  .cached_tokens`` are the prompt tokens served from the KV cache.
* A stream is the Responses API's named events, each with its ``type`` and ``sequence_number``:
  ``response.created``, ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, ``response.output_text.delta`` per text piece, then
  ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done`` and
  ``response.completed`` (``response.incomplete`` when cut), no terminator. A failure after the
  stream started is an ``error`` event ``{"type": "error", "code", "message", "param"}``.

``text.format`` ``json_object`` / ``json_schema`` (``{"type": "json_schema", "name", "schema"}``)
constrains the output as chat's ``response_format`` does.

Not supported yet, a 400 that says so: non-empty ``tools``, ``previous_response_id``, ``reasoning``, ``n`` other than 1, input items other than messages (function
calls, ...) and content parts other than text (``input_image``, ``input_file``, ...). Unknown fields
are ignored. Errors use OpenAI's body (the path is not under /v1/messages).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.common.errors import InvalidRequestError
from services.common.sampling_params import SamplingParams
from services.router import openai_api as api
from services.router import structured
from services.router.backend import Backend, GenerateRequest
from services.router.openai_api import OutputText, invalid
from services.router.openai_models import ChatMessage, ContentPart, SamplingFields

_TEXT_PARTS = ("input_text", "output_text")

Event = tuple[str | None, dict]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputPart(_Body):
    """``{"type": "input_text" | "output_text", "text": ...}``; other types are declared only to be
    rejected in plain words."""

    type: str
    text: str | None = None


class InputItem(_Body):
    type: str | None = None
    """``message`` or omitted; any other item type is a 400."""
    role: str | None = None
    content: str | list[InputPart] | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    """Echoed in the response, otherwise ignored."""
    store: bool | None = None
    """Accepted and ignored: the router stores no responses."""
    tools: list[Any] | None = None
    """Not supported yet: only null or []."""
    previous_response_id: str | None = None
    """Not supported yet (nothing is stored to continue from)."""
    text: dict[str, Any] | None = None
    """``{"format": {"type": "text" | "json_object" | "json_schema", "name", "schema"}}``."""
    reasoning: dict[str, Any] | None = None
    """Not supported yet."""
    n: int | None = None
    """Only 1."""
    # vLLM-style and epd extensions, as the chat completions body has them.
    top_k: int | None = None
    seed: int | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    kv_retention: Literal["agent", "chat"] | None = None


def _check_supported(body: ResponsesRequest) -> None:
    if body.tools:
        raise invalid("tools are not supported yet (tool calling comes later)", "tools")
    if body.previous_response_id is not None:
        raise invalid("previous_response_id is not supported yet: responses are not stored, send the "
                      "whole conversation as input", "previous_response_id")
    if body.reasoning is not None and any(value is not None for value in body.reasoning.values()):
        raise invalid("reasoning is not supported yet", "reasoning")
    if body.n is not None and body.n != 1:
        raise invalid(f"n={body.n} is not supported yet: only one output per request", "n")


def _content(item: InputItem, where: str) -> str | list[ContentPart]:
    if item.content is None or isinstance(item.content, str):
        return item.content or ""
    parts = []
    for i, part in enumerate(item.content):
        param = f"{where}.content[{i}]"
        if part.type not in _TEXT_PARTS:
            raise invalid(f"{param}: {part.type!r} parts are not supported yet (only input_text and "
                          f"output_text)", param)
        if part.text is None:
            raise invalid(f"{param}: a {part.type} part needs \"text\"", param)
        parts.append(ContentPart(type="text", text=part.text))
    return parts


def chat_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """The input as the chat path's messages: the instructions first, then the items."""
    messages = [] if body.instructions is None else [ChatMessage(role="system", content=body.instructions)]
    if isinstance(body.input, str):
        return [*messages, ChatMessage(role="user", content=body.input)]
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if item.type not in (None, "message"):
            raise invalid(f"{where}: {item.type!r} items are not supported yet (only messages)", f"{where}.type")
        if item.role is None:
            raise invalid(f"{where}: a message needs a \"role\"", f"{where}.role")
        if item.role not in ("user", "assistant", "system", "developer"):
            raise invalid(f"{where}.role {item.role!r} is not supported (use user, assistant, system "
                          f"or developer)", f"{where}.role")
        messages.append(ChatMessage(role=item.role, content=_content(item, where)))
    if not messages:
        raise invalid("input must not be empty", "input")
    return messages


def _sampling_params(fields: SamplingFields, num_prompt_tokens: int, max_model_len: int,
                     text_format: dict | None) -> SamplingParams:
    constraint = structured.pick(("text.format", structured.from_response_format(text_format, "text.format")))
    try:
        return api.sampling_params(fields, num_prompt_tokens, max_model_len, "input", structured=constraint)
    except InvalidRequestError as exc:
        if getattr(exc, "param", None) != "max_tokens":
            raise
        # The shared check names the chat field; name the one this client sent.
        raise invalid(str(exc).replace("max_tokens=", "max_output_tokens=", 1), "max_output_tokens",
                      getattr(exc, "code", None), type(exc)) from None


def build(body: ResponsesRequest, backend: Backend,
          model_names: list[str]) -> tuple[GenerateRequest, ResponsesFormat]:
    """The checked body's GenerateRequest and the format that answers it (runs off the event loop)."""
    api.check_model(body.model, model_names)
    _check_supported(body)
    # The chat sampling fields of the same meaning, so every protocol shares one set of checks.
    fields = SamplingFields(model=body.model, stream=body.stream, max_tokens=body.max_output_tokens,
                            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                            cache_salt=body.cache_salt, kv_retention=body.kv_retention)
    prompt = api.chat_prompt(chat_messages(body), backend.tokenizer, backend.image_token_id)
    params = _sampling_params(fields, len(prompt.token_ids), backend.max_model_len, (body.text or {}).get("format"))
    request = api.generate_request(f"resp_{uuid.uuid4().hex}", prompt, params, fields, "chat")
    return request, ResponsesFormat(request.request_id, body.model or backend.model_name, body)


class ResponsesFormat:
    """A Response object, and its stream as the Responses API's numbered, named events.

    Not frozen like the other formats: every event takes the next ``sequence_number``.
    """

    terminator: ClassVar[bytes] = b""
    n: ClassVar[int] = 1

    def __init__(self, response_id: str, model: str, body: ResponsesRequest) -> None:
        self.id = response_id
        self.model = model
        self.body = body
        self.created_at = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.num_events = 0

    def _event(self, name: str, **data) -> Event:
        event = (name, {"type": name, **data, "sequence_number": self.num_events})
        self.num_events += 1
        return event

    def _at(self) -> dict:
        """Where a content event belongs: the one message, its one text part."""
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    @staticmethod
    def _is_incomplete(out: OutputText) -> bool:
        return out.finish_reason == "length"

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _message(self, status: str, content: list[dict]) -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": content}

    def _response(self, status: str, output: list[dict], out: OutputText | None = None) -> dict:
        is_incomplete = status == "incomplete"
        usage = None if out is None else {
            "input_tokens": out.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": out.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens}
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if is_incomplete else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "model": self.model, "output": output, "parallel_tool_calls": False,
                "temperature": body.temperature, "top_p": body.top_p, "tool_choice": "none", "tools": [],
                "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
                "metadata": body.metadata or {}, "usage": usage}

    def _final_message(self, out: OutputText) -> dict:
        return self._message("incomplete" if self._is_incomplete(out) else "completed", [self._part(out.text)])

    def response(self, outs: list[OutputText]) -> dict:
        out, = outs
        status = "incomplete" if self._is_incomplete(out) else "completed"
        return self._response(status, [self._final_message(out)], out)

    def start_events(self, outs: list[OutputText]) -> list[Event]:
        in_progress = self._response("in_progress", [])
        return [self._event("response.created", response=in_progress),
                self._event("response.in_progress", response=in_progress),
                self._event("response.output_item.added", output_index=0, item=self._message("in_progress", [])),
                self._event("response.content_part.added", **self._at(), part=self._part(""))]

    def text_events(self, out: OutputText, text: str) -> list[Event]:
        return [self._event("response.output_text.delta", **self._at(), delta=text, logprobs=[])]

    def choice_end_events(self, out: OutputText) -> list[Event]:
        return []

    def end_events(self, outs: list[OutputText]) -> list[Event]:
        out, = outs
        final = self.response(outs)
        return [self._event("response.output_text.done", **self._at(), text=out.text, logprobs=[]),
                self._event("response.content_part.done", **self._at(), part=self._part(out.text)),
                self._event("response.output_item.done", output_index=0, item=self._final_message(out)),
                self._event(f"response.{final['status']}", response=final)]

    def error_event(self, body: dict) -> Event:
        error = body["error"]
        return self._event("error", code=error["code"] or error["type"], message=error["message"],
                           param=error["param"])
