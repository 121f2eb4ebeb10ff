"""What the output must match, from each protocol's fields: OpenAI's ``response_format`` (chat
completions) and ``text.format`` (Responses), and vLLM's ``structured_outputs`` extension (regex,
EBNF grammar, JSON schema, choice). The grammar itself is checked by services.common.structured and
compiled by the engine."""

from __future__ import annotations

import json
import re

from services.common.errors import InvalidRequestError, invalid
from services.common.sampling_params import StructuredOutput
from services.common.structured import check_structured
from services.router.api.body_checks import parse_json_text
from services.router.api.openai_models import StructuredOutputs


def _schema_text(schema, param: str) -> str:
    if isinstance(schema, str):
        schema = parse_json_text(schema, param)
    if not isinstance(schema, dict):
        raise invalid(f"{param} must be a JSON schema object", param)
    return json.dumps(schema)


def from_response_format(response_format: dict | None, param: str = "response_format") -> StructuredOutput | None:
    """``{"type": "text"}`` (or none), ``{"type": "json_object"}``, or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}``; Responses' ``text.format`` spells the last
    one flat: ``{"type": "json_schema", "name", "schema"}``."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema", response_format)
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid(f"{param}: a json_schema format needs \"json_schema\": {{\"name\": ..., "
                          f"\"schema\": {{...}}}}", param)
        return StructuredOutput("json_schema", _schema_text(spec["schema"], f"{param}.json_schema.schema"))
    raise invalid(f"{param}.type {kind!r} is invalid: use text, json_object or json_schema", f"{param}.type")


def from_extension(fields: StructuredOutputs | None) -> StructuredOutput | None:
    if fields is None:
        return None
    given = {name: value for name, value in (("json", fields.json_), ("regex", fields.regex), ("grammar", fields.grammar),
                                               ("choice", fields.choice), ("json_object", fields.json_object))
             if value not in (None, False)}
    if len(given) != 1:
        raise invalid(f"structured_outputs needs exactly one of json, regex, grammar, choice, json_object; "
                      f"got {sorted(given) or 'none'}", "structured_outputs")
    (name, value), = given.items()
    if name == "json":
        return StructuredOutput("json_schema", _schema_text(value, "structured_outputs.json"))
    if name == "choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise invalid("structured_outputs.choice needs non-empty strings", "structured_outputs.choice")
        return StructuredOutput("regex", "|".join(re.escape(c) for c in value))
    if name == "json_object":
        return StructuredOutput("json_object")
    return StructuredOutput(name, value)


def pick(*candidates: tuple[str, StructuredOutput | None]) -> StructuredOutput | None:
    """The one constraint the request asked for (checked); two at once is a 400."""
    given = [(name, s) for name, s in candidates if s is not None]
    if len(given) > 1:
        raise invalid(f"only one output constraint per request: got {' and '.join(n for n, _ in given)}", given[1][0])
    if not given:
        return None
    name, structured = given[0]
    try:
        check_structured(structured)
    except InvalidRequestError as exc:
        raise invalid(f"{name}: {exc}", name) from None
    return structured
