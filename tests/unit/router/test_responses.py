"""The OpenAI Responses API on the router, through the official openai SDK (raw httpx for the wire)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.unit.router.conftest import SCRIPT_TEXT
from tests.unit.router.fakes import openai_error

QUESTION = "What is the capital of France?"
INSTRUCTIONS = "You answer in one sentence."

STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added"]
END_EVENTS = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_non_streaming_text_and_usage(client, backend):
    reply = client.responses.create(model="test-model", input=QUESTION, temperature=0.5, top_p=0.9,
                                    metadata={"k": "v"}, store=False)
    assert reply.id.startswith("resp_") and (reply.object, reply.model) == ("response", "test-model")
    assert (reply.status, reply.incomplete_details) == ("completed", None)
    assert reply.output_text == SCRIPT_TEXT
    [message] = reply.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert message.id.startswith("msg_")
    assert [(part.type, part.text, part.annotations) for part in message.content] == [
        ("output_text", SCRIPT_TEXT, [])]
    [request] = backend.requests
    assert request.request_id == reply.id and (request.cache_salt, request.request_class) == ("", "chat")
    assert (request.params.temperature, request.params.top_p) == (0.5, 0.9)
    assert request.params.max_tokens == backend.max_model_len - len(request.prompt_token_ids)
    num_input, num_output = len(request.prompt_token_ids), len(backend.script) + 1  # and EOS
    assert reply.usage.to_dict() == {
        "input_tokens": num_input, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_input + num_output}


def test_cached_tokens(make_backend, serve):
    with openai.OpenAI(base_url=f"{serve(make_backend(num_cached_tokens=16))}/v1", api_key="x",
                       max_retries=0) as client:
        reply = client.responses.create(model="test-model", input=QUESTION, max_output_tokens=5)
    assert reply.usage.input_tokens_details.cached_tokens == 16


def test_max_output_tokens_is_incomplete(client, backend, tokenizer):
    reply = client.responses.create(model="test-model", input=QUESTION, max_output_tokens=5)
    assert (reply.status, reply.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert reply.output[0].status == "incomplete"
    assert reply.output_text == tokenizer.decode(backend.script[:5]) and reply.usage.output_tokens == 5
    assert backend.requests[0].params.max_tokens == 5


def test_instructions_and_items_give_the_chat_prompt(client, backend):
    client.responses.create(model="test-model", instructions=INSTRUCTIONS, max_output_tokens=5, input=[
        {"role": "user", "content": QUESTION},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "And of"},
                                     {"type": "input_text", "text": "Italy?"}]}])
    client.responses.create(model="test-model", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=5)
    client.chat.completions.create(model="test-model", max_tokens=5, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Paris."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "And of\nItaly?"}])
    client.chat.completions.create(model="test-model", max_tokens=5, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    items, string, chat_items, chat_string = backend.requests
    assert items.prompt_token_ids == chat_items.prompt_token_ids
    assert string.prompt_token_ids == chat_string.prompt_token_ids


def test_stream_events_and_text_match_non_streaming(client):
    full = client.responses.create(model="alias", input=QUESTION)
    events = list(client.responses.create(model="alias", input=QUESTION, stream=True))
    types = [event.type for event in events]
    num_deltas = types.count("response.output_text.delta")
    assert num_deltas > 1
    assert types == [*STREAM_EVENTS, *["response.output_text.delta"] * num_deltas, *END_EVENTS,
                     "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert text == full.output_text == final.output_text == events[-4].text
    assert final.id.startswith("resp_") and final.id != full.id and final.model == "alias"
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    assert final.status == "completed" and final.usage == full.usage
    with client.responses.stream(model="alias", input=QUESTION) as stream:
        streamed = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        assert stream.get_final_response().output_text == streamed == full.output_text


def test_stream_cut_by_max_output_tokens_ends_incomplete(client, backend, tokenizer):
    events = list(client.responses.create(model="test-model", input=QUESTION, max_output_tokens=3, stream=True))
    assert [event.type for event in events][-4:] == [*END_EVENTS, "response.incomplete"]
    final = events[-1].response
    assert (final.status, final.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert final.output_text == tokenizer.decode(backend.script[:3]) and final.usage.output_tokens == 3


def test_raw_stream_has_event_names_and_no_done(base_url):
    body = {"model": "test-model", "input": QUESTION, "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/responses", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[::2]]
    data = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert names == [*STREAM_EVENTS, "response.output_text.delta", "response.output_text.delta", *END_EVENTS,
                     "response.incomplete"]
    assert [d["type"] for d in data] == names and not any("[DONE]" in line for line in lines)


def test_extensions_reach_the_backend(client, backend):
    client.responses.create(model="test-model", input=QUESTION, max_output_tokens=2,
                            extra_body={"top_k": 7, "seed": 3, "cache_salt": "tenant-a", "kv_retention": "agent"})
    [request] = backend.requests
    assert (request.params.top_k, request.params.seed) == (7, 3)
    assert (request.cache_salt, request.request_class) == ("tenant-a", "agent")


def test_unsupported_and_bad_fields_are_400(client, backend):
    create = client.responses.create
    for kwargs, field in [
        (dict(previous_response_id="resp_123"), "previous_response_id"),
        (dict(reasoning={"effort": "high"}), "reasoning"),
        (dict(extra_body={"n": 2}), "n"),
    ]:
        body = openai_error(lambda: create(model="test-model", input=QUESTION, **kwargs), "not supported yet")
        assert body["param"] == field and body["type"] == "invalid_request_error"
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}
    body = openai_error(lambda: create(model="test-model", input=[image]), "takes no images")  # a text-only model
    assert body["param"] == "input[0].content[0]"
    pdf = {"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}
    body = openai_error(lambda: create(model="test-model", input=[pdf]), "'input_file'", "not supported yet")
    assert body["param"] == "input[0].content[0]"
    openai_error(lambda: create(model="test-model", input=[{"type": "reasoning", "summary": []}]), "'reasoning'")
    body = openai_error(lambda: create(model="test-model", input=QUESTION, tools=[{"type": "web_search"}]),
                        "'web_search'", "only function tools")
    assert body["param"] == "tools[0].type"
    openai_error(lambda: create(model="test-model", input=[{"role": "robot", "content": "x"}]), "'robot'")
    openai_error(lambda: create(model="test-model", input=[]), "input must not be empty")
    openai_error(lambda: create(model="test-model", input=QUESTION, max_output_tokens=0), "max_output_tokens")
    body = openai_error(lambda: create(model="test-model", input=QUESTION, max_output_tokens=5000),
                        "max_output_tokens=5000", "2048")
    assert (body["param"], body["code"]) == ("max_output_tokens", "context_length_exceeded")
    body = openai_error(lambda: create(model="gpt-9", input=QUESTION), "gpt-9", status=openai.NotFoundError)
    assert body["type"] == "not_found_error" and body["code"] == "model_not_found"
    assert backend.requests == []


def test_text_format_constrains_the_output(client, backend):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    reply = client.responses.create(model="test-model", input=QUESTION, max_output_tokens=4,
                                    text={"format": {"type": "json_schema", "name": "r", "schema": schema}})
    assert reply.text.format.type == "json_schema"
    client.responses.create(model="test-model", input=QUESTION, max_output_tokens=4,
                            text={"format": {"type": "json_object"}})
    assert [r.params.structured.kind for r in backend.requests] == ["json_schema", "json_object"]
    body = openai_error(lambda: client.responses.create(model="test-model", input=QUESTION, text={
        "format": {"type": "json_schema", "name": "r", "schema": {"type": "nope"}}}), "text.format")
    assert body["param"] == "text.format"


def test_accepted_defaults_are_not_rejected(client, backend):
    client.responses.create(model="test-model", input=QUESTION, max_output_tokens=2, tools=[],
                            text={"format": {"type": "text"}}, reasoning={"effort": None}, store=True)
    assert len(backend.requests) == 1


def test_backend_failures(make_backend, serve):
    def client_for(**kwargs):
        return openai.OpenAI(base_url=f"{serve(make_backend(**kwargs))}/v1", api_key="x", max_retries=0)

    with client_for(abort_after=0) as client:
        with pytest.raises(openai.APIStatusError) as info:
            client.responses.create(model="test-model", input=QUESTION, stream=True)
        assert info.value.status_code == 503 and "aborted" in info.value.body["message"]
    with client_for(abort_after=3) as client:  # after the stream started: an error event, the stream ends
        events = list(client.responses.create(model="test-model", input=QUESTION, stream=True))
    error = events[-1]
    assert error.type == "error" and "aborted" in error.message
    assert error.sequence_number == len(events) - 1
    assert "response.completed" not in [event.type for event in events]


def test_metrics_and_openapi(client, base_url):
    client.responses.create(model="test-model", input=QUESTION, max_output_tokens=2)
    metrics = httpx.get(f"{base_url}/metrics").text
    assert 'epd_router_requests_total{endpoint="/v1/responses",status="200"}' in metrics
    spec = httpx.get(f"{base_url}/openapi.json").json()
    assert "/v1/responses" in spec["paths"] and "ResponsesRequest" in spec["components"]["schemas"]
