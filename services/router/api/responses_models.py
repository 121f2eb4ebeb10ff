"""The OpenAI Responses request body (pydantic): what ``responses_api`` checks and turns into a
GenerateRequest and ``responses_format`` echoes back; both import it from here."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.router.api.openai_models import RequestBody


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputPart(_Body):
    """``{"type": "input_text" | "output_text", "text": ...}`` or ``{"type": "input_image",
    "image_url": "data:image/png;base64,..."}``; other types are declared only to be rejected in
    plain words."""

    type: str
    text: str | None = None
    image_url: str | None = None
    """An input_image's ``data:`` URI (the router fetches no URLs)."""
    file_id: str | None = None
    """Not supported (nothing is stored)."""


class InputItem(_Body):
    type: str | None = None
    """``message`` (or omitted), ``function_call`` (an earlier call) or ``function_call_output``
    (its result); any other item type is a 400."""
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    """0 to 2."""
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    """Echoed in the response, otherwise ignored."""
    store: bool | None = None
    """Accepted and ignored: the router stores no responses."""
    tools: list[dict[str, Any]] | None = None
    """Function tools: ``{"type": "function", "name", "description", "parameters"}``."""
    tool_choice: Any = None
    """``"none"``, ``"auto"`` (default with tools), ``"required"`` or ``{"type": "function", "name"}``."""
    parallel_tool_calls: bool | None = None
    """Accepted; required / named tool choice gives exactly one call."""
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
