"""The edge check of structured output: cheap, torch-free, and every error names its problem."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.common.errors import InvalidRequestError
from services.common.sampling_params import StructuredOutput
from services.common.structured import check_structured, structural_tag_spec, to_grammar

NESTED = {"type": "object", "properties": {
    "id": {"type": "integer"}, "kind": {"enum": ["a", "b"]},
    "items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["sku"]}}},
    "required": ["id", "kind"]}
TOOL = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("structured", [
    StructuredOutput("json_schema", json.dumps(NESTED)),
    StructuredOutput("json_object"),
    StructuredOutput("regex", r"\d{3}-[a-z]+"),
    StructuredOutput("grammar", 'root ::= greeting " " name\ngreeting ::= "hi" | "hello"\nname ::= [a-z]+'),
    StructuredOutput("structural_tag", structural_tag_spec([("<tool_call>", TOOL, "</tool_call>")], ["<tool_call>"])),
], ids=lambda s: s.kind)
def test_valid_specs_pass(structured):
    check_structured(structured)


@pytest.mark.parametrize("kind, spec, message", [
    ("json_schema", '{"type": "object"', "structured output json_schema: the spec is not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON Schema object, not list"),
    ("json_schema", '{"type": "objekt"}', "is not a valid JSON Schema: 'objekt' is not valid"),
    ("json_schema", '{"properties": {"a": {"minLength": -1}}}', "(at /properties/a/minLength)"),
    ("json_schema", '{"type": "object", "unevaluatedProperties": false}', "Unimplemented keys: [\"unevaluatedProperties\"]"),
    ("json_schema", '{"type": "string", "format": "no-such-format"}', "Unknown format: no-such-format"),
    ("regex", "(ab", "structured output regex: "),
    ("regex", "(?=a)b", "look-around"),
    ("grammar", 'root ::= "a" missing', "structured output grammar: EBNF error: Rule 'missing' not found"),
    ("grammar", 'item ::= "a"', "No 'root' rule found"),
    ("grammar", 'root ::= ("a"', "EBNF error: Expected ')'"),
    ("structural_tag", "{", "structured output structural_tag: the spec is not valid JSON"),
    ("structural_tag", '{"triggers": ["<f"]}', 'exactly the keys "triggers" and "tags"'),
    ("structural_tag", '{"triggers": [], "tags": []}', '"triggers" must be a non-empty list'),
    ("structural_tag", '{"triggers": ["<f"], "tags": []}', '"tags" must be a non-empty list'),
    ("structural_tag", '{"triggers": ["<f"], "tags": [{"begin": "<f>", "end": ""}]}', 'tag 0 must be an object'),
    ("structural_tag", '{"triggers": ["<f"], "tags": [{"begin": "<g>", "schema": {}, "end": ""}]}',
     "tag 0: its begin '<g>' starts with none of the triggers ['<f']"),
    ("structural_tag", '{"triggers": ["<f"], "tags": [{"begin": "<f>", "schema": {"type": 1}, "end": ""}]}',
     "tag 0's schema is not a valid JSON Schema"),
    ("structural_tag", '{"triggers": ["<f"], "tags": [{"begin": "<f>", "schema": {}, "end": 3}]}',
     '"begin" and "end" must be strings'),
])
def test_invalid_specs_name_the_problem(kind, spec, message):
    with pytest.raises(InvalidRequestError) as info:
        check_structured(StructuredOutput(kind, spec))
    assert message in str(info.value)
    assert str(info.value).startswith(f"structured output {kind}: ")


def test_structural_tag_spec_is_the_documented_shape():
    spec = structural_tag_spec([("<f=a>", TOOL, "</f>"), ("<f=b>", json.dumps(TOOL), "</f>")], ["<f="])
    assert json.loads(spec) == {"triggers": ["<f="], "tags": [{"begin": "<f=a>", "schema": TOOL, "end": "</f>"},
                                                              {"begin": "<f=b>", "schema": TOOL, "end": "</f>"}]}
    check_structured(StructuredOutput("structural_tag", spec))


def test_a_trigger_that_is_a_special_token_matches_the_token():
    spec = structural_tag_spec([("<tool_call>", TOOL, "</tool_call>")], ["<tool_call>"])
    as_text = to_grammar(StructuredOutput("structural_tag", spec))
    as_token = to_grammar(StructuredOutput("structural_tag", spec), special_tokens={"<tool_call>"})
    assert '"<tool_call>"' in as_text and '"<tool_call>"' not in as_token and " <tool_call> " in as_token


def test_generated_json_is_laid_out_like_json_dumps_unless_the_schema_says_otherwise():
    grammar = json.loads(to_grammar(StructuredOutput("json_schema", json.dumps(NESTED))))
    options = grammar["grammars"][0]["json_schema"]["x-guidance"]
    assert options == {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    own = {**NESTED, "x-guidance": {"item_separator": ","}}
    grammar = json.loads(to_grammar(StructuredOutput("json_schema", json.dumps(own))))
    assert grammar["grammars"][0]["json_schema"]["x-guidance"]["item_separator"] == ","


def test_the_check_loads_no_torch():
    code = ("import sys; from services.common.structured import check_structured; "
            "from services.common.sampling_params import StructuredOutput as S; "
            "check_structured(S('json_object')); print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
