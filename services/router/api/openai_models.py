"""The OpenAI API's request bodies as pydantic models (they make /openapi.json); the responses are
built in :mod:`services.router.api.openai_formats`.

Unknown fields are ignored (the OpenAI SDK sends some we do not use). Fields the router does not
support yet are still declared, so that a client that sets them gets a 400 that says so instead of
a silently different answer; :mod:`services.router.api.openai_api` does those checks.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.router.api.body_checks import check_json_text


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestBody(_Body):
    """A whole request body: its depth and its strings' Unicode are checked (body_checks.py)
    before any field is validated."""

    @model_validator(mode="before")
    @classmethod
    def _check_json(cls, data: Any) -> Any:
        return check_json_text(data)


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


class FunctionCall(_Body):
    name: str
    arguments: str
    """JSON text."""


class MessageToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    """system, user, assistant, developer (rendered as system), or tool (a call's result)."""
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    """An assistant turn's calls."""
    tool_call_id: str | None = None
    """A tool turn: the call it answers."""


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    """Accepted; arguments always match the schema exactly."""


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs`` extension: exactly one of these constrains the output."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    """A JSON schema (object or JSON text)."""
    regex: str | None = None
    grammar: str | None = None
    """An EBNF grammar (GBNF dialect, root rule ``root``)."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    json_object: bool | None = None


class SamplingFields(_Body):
    """Sampling knobs shared by both endpoints; None means the SamplingParams default."""

    model: str | None = None
    """Any served model name; omitted means the backend's model."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    """Default (OpenAI's): chat, the rest of the context (max_model_len - prompt tokens);
    completions, 16 (at most the rest of the context)."""
    temperature: float | None = None
    """0 to 2 (0: greedy)."""
    top_p: float | None = None
    """Above 0, at most 1."""
    seed: int | None = None
    stop: str | list[str] | None = None
    """A string or a list of at most 4 (openai_api.MAX_STOP)."""
    presence_penalty: float | None = None
    """-2 to 2."""
    frequency_penalty: float | None = None
    """-2 to 2."""
    n: int | None = None
    """Choices per request, 1 to 16; seeded choices use seed, seed + 1, ..."""
    logit_bias: dict[str, float] | None = None
    """``{"token id": bias}``: at most 300 ids of the vocabulary, biases in [-100, 100], added to
    the logits before sampling (-100 bans a token, 100 all but forces it)."""
    user: str | None = None
    # vLLM-style extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    num_speculative_tokens: int | None = None
    """Most draft tokens per step for this request where decode drafts (0: none; the name is
    vLLM's speculative_config field)."""
    return_token_ids: bool = False
    """vLLM extension: choices also carry the generated ``token_ids`` (a stream's chunks, the
    ids new since the previous chunk)."""
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    """vLLM extension: salts the prefix cache, so only requests with the same salt share cached
    KV (and none can time another's prompts)."""
    kv_retention: Literal["agent", "chat"] | None = None
    """epd extension: how long the KV store keeps this request's blocks (agent: 3 days, chat:
    7 days by default). Default: chat for chat completions, agent for completions."""
    response_format: dict[str, Any] | None = None
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", ...}}``."""
    structured_outputs: StructuredOutputs | None = None
    """vLLM extension: regex, EBNF grammar, JSON schema or choice."""


class ChatCompletionRequest(SamplingFields, RequestBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    """Wins over max_tokens when both are given."""
    logprobs: bool | None = None
    """Each token's logprob in ``choices[].logprobs.content``."""
    top_logprobs: int | None = None
    """0 to 20 most likely alternatives per token (needs ``logprobs: true``)."""
    tools: list[ChatTool] | None = None
    tool_choice: Any = None
    """``"none"``, ``"auto"`` (default with tools), ``"required"``, or
    ``{"type": "function", "function": {"name": ...}}``."""
    parallel_tool_calls: bool | None = None
    """Accepted; with ``tool_choice`` required or named the output is exactly one call."""
    functions: list[Any] | None = None
    """Deprecated by OpenAI; not supported: only null or []."""
    function_call: Any = None
    """Deprecated by OpenAI; not supported: only null or "none"."""


class CompletionRequest(SamplingFields, RequestBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    """A string or a list of token ids (a list holding exactly one of either is accepted too)."""
    echo: bool = False
    """Not supported yet."""
    suffix: str | None = None
    """Not supported yet."""
    best_of: int | None = None
    """Only 1 yet."""
    logprobs: int | None = None
    """0 to 5 (vLLM: 20) most likely alternatives per token, with each token's own logprob."""


def usage_body(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}
