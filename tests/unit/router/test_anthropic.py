"""The Anthropic Messages API on the router, through the official anthropic SDK (raw httpx for the wire)."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.unit.router.conftest import SCRIPT_TEXT

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = "You answer in one sentence."


@pytest.fixture
def claude(base_url):
    with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=10) as client:
        yield client


def test_non_streaming_text_and_usage(claude, backend):
    reply = claude.messages.create(model="test-model", max_tokens=500, messages=MESSAGES)
    assert reply.id.startswith("msg_") and (reply.type, reply.role, reply.model) == ("message", "assistant", "test-model")
    assert [(block.type, block.text) for block in reply.content] == [("text", SCRIPT_TEXT)]
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)  # EOS
    [request] = backend.requests
    assert request.request_id == reply.id and request.request_class == "chat"
    assert request.params.max_tokens == 500
    assert reply.usage.model_dump(exclude_none=True) == {
        "input_tokens": len(request.prompt_token_ids), "output_tokens": len(backend.script) + 1,  # and EOS
        "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}


def test_cached_tokens_are_cache_reads(make_backend, serve):
    with anthropic.Anthropic(base_url=serve(make_backend(num_cached_tokens=16)), api_key="unused",
                             max_retries=0) as claude:
        reply = claude.messages.create(model="test-model", max_tokens=5, messages=MESSAGES)
    assert (reply.usage.cache_read_input_tokens, reply.usage.cache_creation_input_tokens) == (16, 0)


def test_stop_reasons(claude, backend, tokenizer):
    reply = claude.messages.create(model="test-model", max_tokens=5, messages=MESSAGES)
    assert (reply.stop_reason, reply.stop_sequence) == ("max_tokens", None)
    assert reply.content[0].text == tokenizer.decode(backend.script[:5]) and reply.usage.output_tokens == 5
    reply = claude.messages.create(model="test-model", max_tokens=500, messages=MESSAGES,
                                   stop_sequences=["zzz", "Eiffel"])
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "Eiffel")
    assert reply.content[0].text == SCRIPT_TEXT[:SCRIPT_TEXT.index("Eiffel")]


def test_system_prompt_reaches_the_template_as_openai_chat(claude, client, backend):
    claude.messages.create(model="test-model", max_tokens=5, system=SYSTEM, messages=[
        *MESSAGES, {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": [{"type": "text", "text": "And of"}, {"type": "text", "text": "Italy?"}]}])
    claude.messages.create(model="test-model", max_tokens=5, system=[{"type": "text", "text": SYSTEM}],
                           messages=MESSAGES)
    client.chat.completions.create(model="test-model", max_tokens=5, messages=[
        {"role": "system", "content": SYSTEM}, *MESSAGES, {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of\nItaly?"}])
    client.chat.completions.create(model="test-model", max_tokens=5,
                                   messages=[{"role": "system", "content": SYSTEM}, *MESSAGES])
    anthropic_turns, anthropic_blocks, openai_turns, openai_system = backend.requests
    assert anthropic_turns.prompt_token_ids == openai_turns.prompt_token_ids
    assert anthropic_blocks.prompt_token_ids == openai_system.prompt_token_ids


def test_stream_matches_non_streaming(claude):
    full = claude.messages.create(model="alias", max_tokens=500, messages=MESSAGES)
    with claude.messages.stream(model="alias", max_tokens=500, messages=MESSAGES) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == full.content[0].text == final.content[0].text
    assert final.id.startswith("msg_") and final.id != full.id and final.model == "alias"
    assert (final.stop_reason, final.stop_sequence) == ("end_turn", None)
    assert final.usage == full.usage


def test_raw_stream_event_names(base_url):
    body = {"model": "test-model", "max_tokens": 3, "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/messages", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * 3,
                     "content_block_stop", "message_delta", "message_stop"]
    assert len(lines) == 2 * len(names) and not any("[DONE]" in line for line in lines)


def test_stream_stop_sequence(claude):
    with claude.messages.stream(model="test-model", max_tokens=500, messages=MESSAGES,
                                stop_sequences=["Eiffel"]) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(deltas) == SCRIPT_TEXT[:SCRIPT_TEXT.index("Eiffel")]
    assert not any("Eif" in delta for delta in deltas)
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "Eiffel")


def test_count_tokens_is_the_prompt_the_backend_saw(claude, backend):
    kwargs = dict(model="test-model", system=SYSTEM, messages=MESSAGES)
    counted = claude.messages.count_tokens(**kwargs)
    claude.messages.create(max_tokens=5, **kwargs)
    assert counted.input_tokens == len(backend.requests[0].prompt_token_ids)


def test_extensions_reach_the_backend(claude, backend):
    # This SDK version no longer declares the sampling knobs; the API still takes them.
    claude.messages.create(model="test-model", max_tokens=5, messages=MESSAGES, metadata={"user_id": "u1"},
                           extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7,
                                       "cache_salt": "tenant-a", "kv_retention": "agent"})
    [request] = backend.requests
    params = request.params
    assert (params.temperature, params.top_p, params.top_k) == (0.5, 0.9, 7)
    assert (request.cache_salt, request.request_class) == ("tenant-a", "agent")


def test_images_map_to_the_openai_path(make_backend, serve, tokenizer):
    image_id = tokenizer.backend.token_to_id("<repo_name>")
    backend = make_backend(image_token_id=image_id)
    with anthropic.Anthropic(base_url=serve(backend), api_key="unused", max_retries=0) as claude:
        claude.messages.create(model="test-model", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    [request] = backend.requests
    assert request.images == ("data:image/png;base64,iVBORw0KGgo=",)
    assert [request.prompt_token_ids[p] for p in request.image_positions] == [image_id]


def _error(call, status: type[anthropic.APIStatusError], error_type: str, *words: str) -> None:
    with pytest.raises(status) as info:
        call()
    assert info.value.body["type"] == "error" and info.value.type == error_type
    message = info.value.body["error"]["message"]
    assert all(word in message for word in words), message


def test_errors_use_anthropics_body(claude, backend, base_url):
    create = claude.messages.create
    bad = anthropic.BadRequestError
    # messages.create() refuses to send a body without max_tokens; the client's raw post does.
    _error(lambda: claude.post("/v1/messages", body={"model": "test-model", "messages": MESSAGES},
                               cast_to=anthropic.types.Message), bad, "invalid_request_error",
           "max_tokens", "Field required")
    _error(lambda: create(model="test-model", max_tokens=0, messages=MESSAGES), bad, "invalid_request_error",
           "max_tokens")
    _error(lambda: create(model="test-model", max_tokens=5, messages=MESSAGES, extra_body={"temperature": 1.5}), bad,
           "invalid_request_error", "temperature=1.5", "[0, 1]")
    _error(lambda: create(model="claude-9", max_tokens=5, messages=MESSAGES), anthropic.NotFoundError,
           "not_found_error", "claude-9")
    _error(lambda: create(model="test-model", max_tokens=5, messages=[{"role": "system", "content": "x"}]), bad,
           "invalid_request_error", "messages[0].role", "'system'")
    _error(lambda: create(model="test-model", max_tokens=5000, messages=MESSAGES), bad, "invalid_request_error",
           "5000", "2048")
    _error(lambda: create(model="test-model", max_tokens=5, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]), bad,
        "invalid_request_error", "messages[0].content[0]", "takes no images")
    _error(lambda: create(model="test-model", max_tokens=5, messages=MESSAGES,
                          tools=[{"name": "f", "input_schema": {"type": "object"}}],
                          tool_choice={"type": "tool", "name": "g"}), bad,
           "invalid_request_error", "'g'", "not one of the tools")
    _error(lambda: claude.messages.count_tokens(model="nope", messages=MESSAGES), anthropic.NotFoundError,
           "not_found_error", "nope")
    response = httpx.post(f"{base_url}/v1/messages", content="{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert backend.requests == []


def test_backend_failures_mid_stream_are_error_events(make_backend, serve):
    with anthropic.Anthropic(base_url=serve(make_backend(abort_after=3)), api_key="unused", max_retries=0) as claude:
        with pytest.raises(anthropic.APIStatusError, match="aborted"):
            with claude.messages.stream(model="test-model", max_tokens=50, messages=MESSAGES) as stream:
                list(stream.text_stream)
    with anthropic.Anthropic(base_url=serve(make_backend(abort_after=0)), api_key="unused", max_retries=0) as claude:
        _error(lambda: claude.messages.create(model="test-model", max_tokens=5, messages=MESSAGES),
               anthropic.APIStatusError, "overloaded_error", "aborted")


def test_openai_error_bodies_are_unchanged(client, base_url):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="test-model", messages=[{"role": "robot", "content": "x"}])
    assert set(info.value.body) == {"message", "type", "param", "code"}
    response = httpx.post(f"{base_url}/v1/chat/completions", json={"model": "test-model"})
    assert response.status_code == 400 and response.json() == {"error": {
        "message": "messages: Field required", "type": "invalid_request_error", "param": "messages", "code": None}}


def test_openapi_lists_the_messages_routes(base_url):
    spec = httpx.get(f"{base_url}/openapi.json").json()
    assert {"/v1/messages", "/v1/messages/count_tokens"} <= set(spec["paths"])
    assert {"MessagesRequest", "CountTokensRequest", "AnthropicMessage"} <= set(spec["components"]["schemas"])
