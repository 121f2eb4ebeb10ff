"""Structured output at the edge: check a request's grammar before it goes anywhere, and turn a
:class:`StructuredOutput` into the grammar text engines compile against their tokenizer.

The grammar library is llguidance (torch-free, no tokenizer needed to parse and check a grammar;
see ``benchmarks/grammar_libraries.py`` for why it and not xgrammar). Everything here is cheap:
parsing the spec, ``jsonschema``'s meta-schema check and llguidance's tokenizer-free grammar
check, about a millisecond for a large schema. Compiling against a tokenizer happens in the
engine (``services/engine/structured.py``).

Every problem is an :class:`InvalidRequestError` whose message starts with
``structured output <kind>:`` and names what is wrong.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import jsonschema
import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from services.common.errors import InvalidRequestError
from services.common.sampling_params import StructuredOutput

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How generated JSON is laid out unless a schema's own ``x-guidance`` says otherwise: like
``json.dumps`` (one space after ``,`` and ``:``), no other whitespace, so a model cannot pad
a document with whitespace forever."""
ANY_JSON_OBJECT = {"type": "object"}


@functools.lru_cache(maxsize=256)
def check_structured(structured: StructuredOutput) -> None:
    """Raise InvalidRequestError naming the problem if ``structured`` cannot be compiled.

    Cached (valid specs only): an agent sends the same tools and schemas with every turn, and the
    router checks each request before the engine compiles (and caches) the grammar."""
    error = llguidance.LLMatcher.validate_grammar(to_grammar(structured))
    if error:
        raise _error(structured.kind, error)


def to_grammar(structured: StructuredOutput, special_tokens: Collection[str] = ()) -> str:
    """The llguidance grammar for ``structured`` (not yet checked against any tokenizer).

    ``special_tokens``: the tokenizer's special tokens; a structural tag trigger spelled like
    one (``<tool_call>``) then matches that single token rather than its text.
    """
    kind, spec = structured.kind, structured.spec
    if kind == "json_schema":
        return _json_grammar(_parse_schema(kind, spec, "the spec"))
    if kind == "json_object":
        return _json_grammar(ANY_JSON_OBJECT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "grammar":
        try:
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec))
        except Exception as exc:  # noqa: BLE001 - the converter raises bare Exceptions
            raise _error(kind, f"EBNF error: {exc}") from exc
    assert kind == "structural_tag", kind
    return _structural_tag_grammar(spec, special_tokens)


def structural_tag_spec(tags: Iterable[tuple[str, Mapping[str, Any] | str, str]], triggers: Iterable[str]) -> str:
    """The ``structural_tag`` spec for (begin, JSON schema, end) tags: what an API layer builds
    for tool calls with ``tool_choice: auto``, e.g. one tag per tool
    ``('<tool_call>{"name": "get_weather", "arguments": ', parameters_schema, '}</tool_call>')``
    and the trigger ``'<tool_call>'``. A schema may be a mapping or JSON text."""
    return json.dumps({
        "triggers": list(triggers),
        "tags": [{"begin": begin, "schema": json.loads(schema) if isinstance(schema, str) else dict(schema),
                  "end": end} for begin, schema, end in tags],
    })


def _json_grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)


def _parse_schema(kind: str, schema: Any, where: str) -> dict:
    """A JSON Schema (JSON text or already parsed) checked against its meta-schema."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise _error(kind, f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise _error(kind, f"{where} must be a JSON Schema object, not {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path)
        raise _error(kind, f"{where} is not a valid JSON Schema: {exc.message}"
                           + (f" (at /{path})" if path else "")) from exc
    return schema


def _structural_tag_grammar(spec: str, special_tokens: Collection[str]) -> str:
    kind = "structural_tag"
    try:
        parsed = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise _error(kind, f"the spec is not valid JSON: {exc}") from exc
    if not isinstance(parsed, dict) or set(parsed) != {"triggers", "tags"}:
        raise _error(kind, 'the spec must be a JSON object with exactly the keys "triggers" and "tags"')
    triggers, tags = parsed["triggers"], parsed["tags"]
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise _error(kind, '"triggers" must be a non-empty list of non-empty strings')
    if not isinstance(tags, list) or not tags:
        raise _error(kind, '"tags" must be a non-empty list')
    items = []
    for i, tag in enumerate(tags):
        if not isinstance(tag, dict) or set(tag) != {"begin", "schema", "end"}:
            raise _error(kind, f'tag {i} must be an object with exactly the keys "begin", "schema" and "end"')
        begin, end = tag["begin"], tag["end"]
        if not isinstance(begin, str) or not isinstance(end, str):
            raise _error(kind, f'tag {i}: "begin" and "end" must be strings')
        matching = [t for t in triggers if begin.startswith(t)]
        if not matching:
            raise _error(kind, f"tag {i}: its begin {begin!r} starts with none of the triggers {triggers}")
        schema = _parse_schema(kind, tag["schema"], f"tag {i}'s schema")
        items.append(llguidance.StructTag(trigger=max(matching, key=len), begin=begin,
                                          grammar=_with_layout(schema), end=end))
    # StructTag makes every trigger spelled like a special token match that token, or none.
    special_like = [t for t in triggers if t.startswith("<") and t.endswith(">")]
    return llguidance.StructTag.to_grammar(items, assume_special=bool(special_like) and all(
        t in special_tokens for t in special_like))


def _with_layout(schema: dict) -> dict:
    """``schema`` with JSON_LAYOUT as its x-guidance defaults (a tag's body is compiled from the
    schema alone, so the layout travels inside it)."""
    return {**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}


def _error(kind: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"structured output {kind}: {message}")
