"""n choices, logprobs, tools and output constraints through the official SDKs, over a scripted
backend (the grammar itself is the engine's: tests/unit/engine/test_structured.py)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from services.common.errors import InvalidRequestError
from services.router.api.tools import ToolPlan, anthropic_plan, check_tool
from tests.unit.router.conftest import SCRIPT_TEXT
from tests.unit.router.fakes import openai_error

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def test_n_choices_fork_with_seeds_and_stream_side_by_side(client, backend):
    reply = client.chat.completions.create(model="test-model", messages=MESSAGES, n=3, seed=7)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.message.content == SCRIPT_TEXT for c in reply.choices)
    assert [r.params.seed for r in backend.requests] == [7, 8, 9]
    assert [r.request_id for r in backend.requests] == [f"{reply.id}-{i}" for i in range(3)]
    one = len(backend.script) + 1
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(backend.requests[0].prompt_token_ids), 3 * one)
    chunks = list(client.chat.completions.create(model="test-model", messages=MESSAGES, n=3, stream=True,
                                                 stream_options={"include_usage": True}))
    for index in range(3):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "stop"
        assert "".join(c.delta.content or "" for c in mine) == SCRIPT_TEXT
    assert chunks[-1].usage.completion_tokens == 3 * one
    completion = client.completions.create(model="test-model", prompt="Say", n=2, max_tokens=4)
    assert [c.index for c in completion.choices] == [0, 1] and completion.usage.completion_tokens == 8


def test_logprobs_chat_and_completions(client, backend, tokenizer):
    reply = client.chat.completions.create(model="test-model", messages=MESSAGES, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert [e.logprob for e in content] == [-t / 1000 for t in backend.script]  # EOS is not shown
    assert b"".join(bytes(e.bytes) for e in content).decode() == SCRIPT_TEXT
    first = content[0]
    assert [t.logprob for t in first.top_logprobs] == [first.logprob, first.logprob - 1]
    assert first.top_logprobs[0].token == first.token
    chunks = list(client.chat.completions.create(model="test-model", messages=MESSAGES, logprobs=True, stream=True))
    streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.logprob for e in content]
    assert client.chat.completions.create(model="test-model", messages=MESSAGES).choices[0].logprobs is None
    completion = client.completions.create(model="test-model", prompt="Say", max_tokens=5, logprobs=1)
    lp = completion.choices[0].logprobs
    assert lp.token_logprobs == [-t / 1000 for t in backend.script[:5]]
    assert "".join(lp.tokens) == completion.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) == 1 for top in lp.top_logprobs)


@pytest.fixture
def call_backend(make_backend):
    return make_backend('{"name": "get_weather", "arguments": {"city": "Paris"}}')


def test_forced_tool_call_is_parsed_and_constrained(serve, call_backend):
    with openai.OpenAI(base_url=f"{serve(call_backend)}/v1", api_key="x", max_retries=0) as client:
        reply = client.chat.completions.create(model="test-model", messages=MESSAGES, tools=[WEATHER],
                                               tool_choice="required")
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        structured = call_backend.requests[0].params.structured
        assert structured.kind == "json_schema" and json.loads(structured.spec)["properties"]["name"] == {"const": "get_weather"}
        chunks = list(client.chat.completions.create(model="test-model", messages=MESSAGES, tools=[WEATHER],
                                                     tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                     stream=True))
        calls = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or [])]
        # Streamed as OpenAI does: id and name first, then the arguments piece by piece.
        assert (calls[0].id.startswith("call_"), calls[0].function.name, calls[0].function.arguments) == (True, "get_weather", "")
        assert len(calls) > 3 and all(c.index == 0 and c.id is None for c in calls[1:])
        assert json.loads("".join(c.function.arguments for c in calls)) == {"city": "Paris"}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert all(not chunk.choices[0].delta.content for chunk in chunks)
        # The next turn carries the call and its result back into the prompt.
        follow = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        client.chat.completions.create(model="test-model", messages=follow, tools=[WEATHER])
        prompt = call_backend.tokenizer.decode(call_backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
        assert "<tool_response>\nsunny\n</tool_response>" in prompt and "<tools>" in prompt
        assert call_backend.requests[-1].params.structured.kind == "structural_tag"


def test_auto_tool_calls_stream_text_then_calls(serve, make_backend):
    text = 'Let me check <that>.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    backend = make_backend(text)
    with openai.OpenAI(base_url=f"{serve(backend)}/v1", api_key="x", max_retries=0) as client:
        full = client.chat.completions.create(model="test-model", messages=MESSAGES, tools=[WEATHER]).choices[0]
        chunks = list(client.chat.completions.create(model="test-model", messages=MESSAGES, tools=[WEATHER], stream=True))
    assert full.message.content == "Let me check <that>.\n" and full.finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.message.content
    calls = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(c.function.arguments for c in calls)) == json.loads(full.message.tool_calls[0].function.arguments)
    with anthropic.Anthropic(base_url=serve(backend), api_key="x", max_retries=0) as claude:
        tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
        with claude.messages.stream(model="test-model", max_tokens=100, messages=MESSAGES, tools=[tool]) as stream:
            starts = [e.content_block.type for e in stream if e.type == "content_block_start"]
            message = stream.get_final_message()
    assert starts == ["text", "tool_use"] and message.stop_reason == "tool_use"
    assert message.content[0].text == "Let me check <that>.\n" and message.content[1].input == {"city": "Oslo"}
    plain = make_backend("No call <here>, just text.")
    with openai.OpenAI(base_url=f"{serve(plain)}/v1", api_key="x", max_retries=0) as client:
        chunks = list(client.chat.completions.create(model="test-model", messages=MESSAGES, tools=[WEATHER], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "No call <here>, just text."
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_auto_tool_calls_split_text_from_calls():
    plan = ToolPlan((check_tool("get_weather", "", {"type": "object"}, "tools[0]"),), "auto")
    text = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    content, [call] = plan.parse(text, "call_")
    assert content == "Let me check.\n" and call.arguments == {"city": "Oslo"}
    assert plan.parse("Just text", "call_") == ("Just text", [])
    cut = 'x <tool_call>{"name": "get_weather", "argu'
    assert plan.parse(cut, "call_") == (cut, [])  # cut by max_tokens: stays text
    spec = json.loads(plan.structured().spec)
    assert spec["triggers"] == ["<tool_call>"] and spec["tags"][0]["begin"].startswith('<tool_call>{"name": "get_weather"')


def test_tool_and_format_errors_are_400(client):
    chat = client.chat.completions.create
    openai_error(lambda: chat(model="test-model", messages=MESSAGES, tools=[WEATHER],
                              tool_choice={"type": "function", "function": {"name": "nope"}}), "'nope'")
    openai_error(lambda: chat(model="test-model", messages=MESSAGES, tools=[WEATHER, WEATHER]), "unique")
    openai_error(lambda: chat(model="test-model", messages=MESSAGES, tools=[WEATHER],
                              response_format={"type": "json_object"}), "only one output constraint")
    openai_error(lambda: chat(model="test-model", messages=MESSAGES, response_format={"type": "xml"}), "'xml'")
    openai_error(lambda: chat(model="test-model", messages=MESSAGES, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}), "response_format")
    openai_error(lambda: chat(model="test-model", messages=MESSAGES,
                              extra_body={"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs")
    openai_error(lambda: chat(model="test-model", messages=MESSAGES,
                              extra_body={"structured_outputs": {"regex": "a", "grammar": "b"}}), "exactly one")


def test_output_constraints_reach_the_engine(client, backend):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = client.chat.completions.create
    chat(model="test-model", messages=MESSAGES, response_format={"type": "json_schema",
                                                                 "json_schema": {"name": "s", "schema": schema}})
    chat(model="test-model", messages=MESSAGES, response_format={"type": "json_object"})
    chat(model="test-model", messages=MESSAGES, extra_body={"structured_outputs": {"choice": ["yes", "no."]}})
    client.completions.create(model="test-model", prompt="x", extra_body={"structured_outputs": {"regex": "[0-9]+"}})
    got = [(r.params.structured.kind, r.params.structured.spec) for r in backend.requests]
    assert got == [("json_schema", json.dumps(schema)), ("json_object", ""), ("regex", r"yes|no\."),
                   ("regex", "[0-9]+")]


def test_anthropic_tool_use(serve, call_backend):
    with anthropic.Anthropic(base_url=serve(call_backend), api_key="x", max_retries=0) as client:
        tool = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER["function"]["parameters"]}
        reply = client.messages.create(model="test-model", max_tokens=100, messages=MESSAGES, tools=[tool],
                                       tool_choice={"type": "any"})
        assert reply.stop_reason == "tool_use"
        [block] = reply.content
        assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Paris"}
        assert block.id.startswith("toolu_")
        with client.messages.stream(model="test-model", max_tokens=100, messages=MESSAGES, tools=[tool],
                                    tool_choice={"type": "tool", "name": "get_weather"}) as stream:
            deltas = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use" and final.content[0].input == {"city": "Paris"}
        assert len(deltas) > 3 and json.loads("".join(deltas)) == {"city": "Paris"}  # the input streams
        follow = [*MESSAGES, {"role": "assistant", "content": [block.model_dump()]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}]}]
        client.messages.create(model="test-model", max_tokens=100, messages=follow, tools=[tool])
        prompt = call_backend.tokenizer.decode(call_backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
        assert "<tool_response>\nsunny\n</tool_response>" in prompt and '"city": "Paris"' in prompt
    with pytest.raises(InvalidRequestError, match="tool_choice needs tools"):
        anthropic_plan([], {"type": "any"})


def test_responses_function_calls(serve, make_backend, call_backend):
    tool = {"type": "function", "name": "get_weather", "description": "Weather",
            "parameters": WEATHER["function"]["parameters"]}
    with openai.OpenAI(base_url=f"{serve(call_backend)}/v1", api_key="x", max_retries=0) as client:
        reply = client.responses.create(model="test-model", input="Weather in Paris?", tools=[tool],
                                        tool_choice="required")
        [call] = reply.output
        assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
        assert reply.status == "completed" and call.call_id.startswith("call_")
        events = list(client.responses.create(model="test-model", input="Weather in Paris?", tools=[tool],
                                              tool_choice={"type": "function", "name": "get_weather"}, stream=True))
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert len(deltas) > 3 and json.loads("".join(deltas)) == {"city": "Paris"}
        final = events[-1].response
        assert events[-1].type == "response.completed" and final.output[0].type == "function_call"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        # The call and its output go back into the next turn's prompt.
        client.responses.create(model="test-model", tools=[tool], input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        prompt = call_backend.tokenizer.decode(call_backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
        assert "<tool_response>\nsunny\n</tool_response>" in prompt and '"city": "Paris"' in prompt
    mixed = make_backend('Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    with openai.OpenAI(base_url=f"{serve(mixed)}/v1", api_key="x", max_retries=0) as client:
        events = list(client.responses.create(model="test-model", input="Weather?", tools=[tool], stream=True))
        reply = client.responses.create(model="test-model", input="Weather?", tools=[tool])
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["message", "function_call"] == [item.type for item in reply.output]
    assert events[-1].response.output[0].content[0].text == reply.output[0].content[0].text == "Checking."
