"""OpenAI Responses protocol <-> GenerateRequest: the request body and its checks.

Supported (``POST /v1/responses``):

* ``model``: as chat completions (omitted: the backend's model; unknown: a 404).
* ``input``: a string (one user message) or a list of message items, ``{"role": "user" |
  "assistant" | "system" | "developer", "content": str | [{"type": "input_text" | "output_text",
  "text": ...}]}`` (``"type": "message"`` optional), and for a model that takes images
  ``{"type": "input_image", "image_url": "data:image/<fmt>;base64,..."}`` parts (the chat path's
  ``image_url`` parts; a text-only model answers a 400 naming the part). ``instructions`` becomes
  a system message placed first. Parts are joined with "\\n" as chat parts are, and the conversation goes through
  the same chat template and tokenizing as chat completions (same messages, same token ids).
* ``max_output_tokens`` (>= 1; default: the rest of the context), ``temperature`` (0 to 2), ``top_p``,
  ``stream``, ``metadata`` (echoed, otherwise ignored), ``store`` (accepted; nothing is stored),
  the vLLM-style ``top_k`` / ``seed`` and the epd extensions ``cache_salt`` / ``kv_retention``
  (default ``chat``).
* The response is ``status: completed``, or ``incomplete`` with ``incomplete_details.reason:
  max_output_tokens`` when the output budget (or the context) ran out. ``usage.input_tokens_details
  .cached_tokens`` are the prompt tokens served from the KV cache.
* A stream is the Responses API's named events (services/router/api/responses_format.py), each with
  its ``type`` and ``sequence_number``, no terminator.
* ``text.format`` ``json_object`` / ``json_schema`` (``{"type": "json_schema", "name", "schema"}``)
  constrains the output as chat's ``response_format`` does.
* Function ``tools`` (``{"type": "function", "name", "description", "parameters"}``) with
  ``tool_choice`` ``none`` / ``auto`` / ``required`` / ``{"type": "function", "name"}``: calls come
  back as ``function_call`` output items (streamed: ``response.function_call_arguments.delta``),
  and ``function_call`` / ``function_call_output`` input items carry earlier calls and results.

Not supported yet, a 400 that says so: other tool types (``web_search``, ``file_search``, ...),
``previous_response_id``, ``reasoning``, ``n`` other than 1, other input items, other content parts
(``input_file``, ...) and images by ``file_id`` or URL. Unknown fields are ignored. Errors use
OpenAI's body (the path is not under /v1/messages).
"""

from __future__ import annotations

import uuid
from services.common.errors import InvalidRequestError, invalid
from services.common.sampling_params import SamplingParams
from services.router.api import openai_api as api
from services.router.api import prompts, structured
from services.router.cluster.backend import Backend, GenerateRequest
from services.router.api.body_checks import check_ranges
from services.router.api.openai_models import (ChatMessage, ContentPart, FunctionCall, ImageURL, MessageToolCall,
                                               SamplingFields)
from services.router.api.responses_models import InputItem, InputPart, ResponsesRequest  # noqa: F401 - the body type
from services.router.api.responses_format import ResponsesFormat
from services.router.api.tools import ToolPlan, responses_plan
from services.router.errors import openai_error_body

error_body = openai_error_body
"""The protocol's error format: one of its two entry points (with :func:`build`)."""
_TEXT_PARTS = ("input_text", "output_text")


def _check_supported(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise invalid("previous_response_id is not supported yet: responses are not stored, send the "
                      "whole conversation as input", "previous_response_id")
    if body.reasoning is not None and any(value is not None for value in body.reasoning.values()):
        raise invalid("reasoning is not supported yet", "reasoning")
    if body.n is not None and body.n != 1:
        raise invalid(f"n={body.n} is not supported yet: only one output per request", "n")


def _image(part: InputPart, param: str, image_token_id: int | None) -> ContentPart:
    if image_token_id is None:
        raise invalid(f"{param}: {prompts.NO_IMAGES}", param)
    if part.image_url is None:
        raise invalid(f"{param}: an input_image part needs \"image_url\" (a data:image/...;base64 URI; "
                      f"file_id is not supported)", param)
    url = prompts.check_image_uri(part.image_url, f"{param}.image_url")
    return ContentPart(type="image_url", image_url=ImageURL(url=url))


def _content(item: InputItem, where: str, image_token_id: int | None) -> str | list[ContentPart]:
    if item.content is None or isinstance(item.content, str):
        return item.content or ""
    parts = []
    for i, part in enumerate(item.content):
        param = f"{where}.content[{i}]"
        if part.type == "input_image":
            parts.append(_image(part, param, image_token_id))
            continue
        if part.type not in _TEXT_PARTS:
            raise invalid(f"{param}: {part.type!r} parts are not supported yet (only input_text, "
                          f"output_text and input_image)", param)
        if part.text is None:
            raise invalid(f"{param}: a {part.type} part needs \"text\"", param)
        parts.append(ContentPart(type="text", text=part.text))
    return parts


def chat_messages(body: ResponsesRequest, image_token_id: int | None = None) -> list[ChatMessage]:
    """The input as the chat path's messages: the instructions first, then the items
    (``image_token_id``: None, the model takes no images)."""
    messages = [] if body.instructions is None else [ChatMessage(role="system", content=body.instructions)]
    if isinstance(body.input, str):
        return [*messages, ChatMessage(role="user", content=body.input)]
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if item.type == "function_call":
            if not item.name or item.arguments is None:
                raise invalid(f"{where}: a function_call item needs \"name\" and \"arguments\"", where)
            call = MessageToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            messages.append(ChatMessage(role="assistant", tool_calls=[call]))
            continue
        if item.type == "function_call_output":
            messages.append(ChatMessage(role="tool", content=item.output or "", tool_call_id=item.call_id))
            continue
        if item.type not in (None, "message"):
            raise invalid(f"{where}: {item.type!r} items are not supported yet (only messages, function_call "
                          f"and function_call_output)", f"{where}.type")
        if item.role is None:
            raise invalid(f"{where}: a message needs a \"role\"", f"{where}.role")
        if item.role not in ("user", "assistant", "system", "developer"):
            raise invalid(f"{where}.role {item.role!r} is not supported (use user, assistant, system "
                          f"or developer)", f"{where}.role")
        messages.append(ChatMessage(role=item.role, content=_content(item, where, image_token_id)))
    if not messages:
        raise invalid("input must not be empty", "input")
    return messages


def _sampling_params(fields: SamplingFields, num_prompt_tokens: int, max_model_len: int,
                     text_format: dict | None, tools: ToolPlan | None) -> SamplingParams:
    constraint = structured.pick(("tools", tools and tools.structured()),
                                 ("text.format", structured.from_response_format(text_format, "text.format")))
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
    """The protocol's entry point: the checked body's GenerateRequest and the format that answers
    it (runs off the event loop)."""
    api.check_model(body.model, model_names)
    _check_supported(body)
    # The chat sampling fields of the same meaning, so every protocol shares one set of checks.
    fields = SamplingFields(model=body.model, stream=body.stream, max_tokens=body.max_output_tokens,
                            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                            cache_salt=body.cache_salt, kv_retention=body.kv_retention)
    check_ranges(fields)  # before the prompt is built: cheap checks first
    tools = responses_plan(body.tools, body.tool_choice)
    messages = chat_messages(body, backend.image_token_id)
    prompt = prompts.chat_prompt(messages, backend.tokenizer, backend.image_token_id, tools, backend.max_model_len, "input")
    params = _sampling_params(fields, len(prompt.token_ids), backend.max_model_len, (body.text or {}).get("format"),
                              tools)
    request = api.generate_request(f"resp_{uuid.uuid4().hex}", prompt, params, fields, "chat")
    return request, ResponsesFormat(request.request_id, body.model or backend.model_name, body, tools)
