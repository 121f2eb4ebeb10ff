"""The public API on a live SmolLM2 cluster (1 prefill + 1 decode + 1 store node, encoders left to
auto: none for a text model), with the official openai and anthropic SDKs as clients: choices,
seeds, stops, logprobs across the prefill -> decode hand-over, JSON schema and tool calls whose
grammar the engines enforce, the Messages / Responses streams, and OpenAI's defaults (completions'
16 tokens, logit_bias, system_fingerprint, images refused by a text model)."""

from __future__ import annotations

import asyncio
import json

import anthropic
import jsonschema
import openai
import pytest

from tests.cluster import running_cluster

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Tell me a short story about a cat."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "doctor", "artist", "teacher"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 15}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "skills"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def cluster():
    with running_cluster("", prefills=1, decodes=1, kv_cache_gib=0.2, device="cpu") as running:
        yield running


@pytest.fixture
def client(cluster):
    with openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        yield client


@pytest.mark.slow
def test_streams_seeds_choices_stops(client, cluster):
    params = dict(model=MODEL, messages=ASK, max_tokens=24, temperature=0.8, seed=11)
    full = client.chat.completions.create(**params)
    chunks = list(client.chat.completions.create(**params, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    three = client.chat.completions.create(**{**params, "seed": 5}, n=3)
    again = client.chat.completions.create(**{**params, "seed": 5}, n=3)
    texts = [c.message.content for c in three.choices]
    assert texts == [c.message.content for c in again.choices] and len(set(texts)) > 1
    assert three.choices[0].message.content == client.chat.completions.create(**{**params, "seed": 5}).choices[0].message.content
    greedy = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0).choices[0]
    word = greedy.message.content.split()[3]
    cut = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0, stop=[word]).choices[0]
    assert cut.finish_reason == "stop" and greedy.message.content.startswith(cut.message.content)
    assert word not in cut.message.content
    assert cluster.leftovers() == []


@pytest.mark.slow
def test_logprobs_cross_the_handoff(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens  # the first token's came from prefill
    assert b"".join(bytes(e.bytes) for e in content).decode() == reply.choices[0].message.content
    for entry in content:  # greedy: each token is its step's most likely (in bf16 two can tie exactly)
        tied_first = [top.token for top in entry.top_logprobs if top.logprob == entry.top_logprobs[0].logprob]
        assert len(entry.top_logprobs) == 3 and entry.token in tied_first
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4) and entry.logprob <= 0


async def _generate_all(url: str, requests: list[dict]) -> list:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900) as client:
        return await asyncio.gather(*(client.chat.completions.create(**r) for r in requests))


@pytest.mark.slow
def test_fifty_json_schema_generations_validate(cluster):
    ask = [{"role": "user", "content": "Invent a person and describe them as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    requests = [dict(model=MODEL, messages=ask, n=10, seed=seed, temperature=0.7, max_tokens=160,
                     response_format=fmt) for seed in range(0, 50, 10)]
    replies = asyncio.run(_generate_all(cluster.url, requests))
    choices = [c for r in replies for c in r.choices]
    assert len(choices) == 50
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({c.message.content for c in choices}) > 10
    assert cluster.leftovers() == []


@pytest.mark.slow
def test_twenty_tool_calls_have_valid_arguments(cluster, client):
    ask = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    requests = [dict(model=MODEL, messages=ask, n=10, seed=seed, temperature=0.7, max_tokens=80, tools=TOOLS,
                     tool_choice="required") for seed in (0, 10)]
    calls = [call for r in asyncio.run(_generate_all(cluster.url, requests)) for c in r.choices
             for call in c.message.tool_calls or ()]
    assert len(calls) == 20
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=80, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, max_tokens=80, tools=TOOLS, stream=True,
                                                 tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    pieces = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or ()]
    assert pieces[0].function.name == "get_weather" and len(pieces) > 2  # the arguments stream in pieces
    jsonschema.validate(json.loads("".join(p.function.arguments for p in pieces)), WEATHER)
    auto = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=80, tools=TOOLS, temperature=0)
    for call in auto.choices[0].message.tool_calls or ():  # the model may answer in words instead
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.slow
def test_regex_grammar_and_bad_constraints(client):
    digits = client.completions.create(model=MODEL, prompt="My phone number is", max_tokens=20,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert digits.choices[0].text[3] == "-" and len(digits.choices[0].text) == 8
    grammar = 'root ::= "yes" | "no"'
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}],
                                            max_tokens=5, extra_body={"structured_outputs": {"grammar": grammar}})
    assert answer.choices[0].message.content in ("yes", "no")
    for extra, words in (({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
                         ({"structured_outputs": {"grammar": "root ::= missing"}}, "missing"),
                         ({"response_format": {"type": "json_schema", "json_schema": {
                             "name": "x", "schema": {"type": "object", "required": 5}}}}, "response_format")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=extra)
        assert words in info.value.body["message"]
    # The prompt-length limit, in both protocols' error bodies.
    long = [{"role": "user", "content": "word " * 9000}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=5)
    assert info.value.body["code"] == "context_length_exceeded" and "the prompt is" in info.value.body["message"]
    with anthropic.Anthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key="unused",
                             max_retries=0) as claude:
        with pytest.raises(anthropic.BadRequestError) as info:
            claude.messages.create(model=MODEL, max_tokens=5, messages=long)
    assert info.value.body["error"]["type"] == "invalid_request_error" and "context" in info.value.body["error"]["message"]


@pytest.mark.slow
def test_messages_and_responses_streams(cluster):
    tool = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}
    with anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0, timeout=600) as claude:
        with claude.messages.stream(model=MODEL, max_tokens=16, messages=ASK) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
        reply = claude.messages.create(model=MODEL, max_tokens=80, tools=[tool], tool_choice={"type": "any"},
                                       messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert reply.stop_reason == "tool_use" and reply.content[-1].type == "tool_use"
    jsonschema.validate(reply.content[-1].input, WEATHER)
    assert final.content[0].text
    with openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        events = list(client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=12, stream=True))
        assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
        assert [e.sequence_number for e in events] == list(range(len(events)))
        fn = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}
        reply = client.responses.create(model=MODEL, input="Weather in Rome?", max_output_tokens=80, tools=[fn],
                                        tool_choice="required")
        [call] = reply.output
        assert call.type == "function_call" and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER)


@pytest.mark.slow
def test_openai_defaults_logit_bias_and_no_images(client):
    story = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                      extra_body={"ignore_eos": True})
    assert (story.usage.completion_tokens, story.choices[0].finish_reason) == (16, "length")  # OpenAI's default
    assert story.system_fingerprint.startswith("fp_")
    params = dict(model=MODEL, messages=ASK, max_tokens=3, temperature=0, extra_body={"return_token_ids": True})
    greedy = client.chat.completions.create(**params)
    ids = greedy.choices[0].model_extra["token_ids"]
    assert greedy.system_fingerprint == story.system_fingerprint
    forced = next(t for t in range(1000, 2000) if t not in ids)
    boosted = client.chat.completions.create(**params, logit_bias={str(forced): 100})
    assert boosted.choices[0].model_extra["token_ids"] == [forced] * 3
    banned = client.chat.completions.create(**params, logit_bias={str(ids[0]): -100})
    assert ids[0] not in banned.choices[0].model_extra["token_ids"]
    png = "data:image/png;base64,iVBORw0KGgo="
    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                          {"type": "image_url", "image_url": {"url": png}}]}]
    with pytest.raises(openai.BadRequestError) as info:  # no encoder starts for a text-only model
        client.chat.completions.create(model=MODEL, messages=image, max_tokens=3)
    assert info.value.body["param"] == "messages[0].content[1]" and "takes no images" in info.value.body["message"]
