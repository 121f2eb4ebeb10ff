"""The HTTP front door through the official openai SDK (and raw httpx where the SDK can't go)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import httpx
import openai
import pytest

from services.common.errors import PromptTooLongError
from tests.unit.router.conftest import SCRIPT_TEXT
from tests.unit.router.fakes import openai_error

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]



def test_a_request_may_set_its_number_of_speculative_tokens(client, backend):
    client.chat.completions.create(model="test-model", messages=MESSAGES, extra_body={"num_speculative_tokens": 2})
    client.chat.completions.create(model="test-model", messages=MESSAGES)
    assert [r.params.num_speculative_tokens for r in backend.requests] == [2, None]

def test_chat_non_streaming(client, backend, tokenizer):
    reply = client.chat.completions.create(model="test-model", messages=MESSAGES, temperature=0, seed=3)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.model == "test-model"
    choice = reply.choices[0]
    assert (choice.index, choice.message.role, choice.finish_reason) == (0, "assistant", "stop")
    assert choice.message.content == SCRIPT_TEXT
    [request] = backend.requests
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES))
    assert request.prompt_token_ids == tuple(prompt) and request.request_id == reply.id
    assert (request.params.temperature, request.params.seed) == (0, 3)
    assert request.params.max_tokens == backend.max_model_len - len(prompt)
    num_output = len(backend.script) + 1  # and EOS
    assert reply.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": len(prompt), "completion_tokens": num_output, "total_tokens": len(prompt) + num_output,
        "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_streaming_matches_non_streaming(client):
    full = client.chat.completions.create(model="alias", messages=MESSAGES)
    chunks = list(client.chat.completions.create(model="alias", messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.model == "alias" for c in chunks)
    *body, finish, usage = chunks
    assert "".join(c.choices[0].delta.content or "" for c in body) == full.choices[0].message.content
    assert finish.choices[0].finish_reason == "stop" and finish.choices[0].delta.content is None
    assert all(c.choices[0].finish_reason is None for c in body)
    assert usage.choices == [] and usage.usage == full.usage


def test_stream_without_usage_has_no_usage_chunk(client):
    chunks = list(client.chat.completions.create(model="test-model", messages=MESSAGES, stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks)


def test_raw_stream_ends_with_done(base_url):
    body = {"messages": MESSAGES, "stream": True, "max_tokens": 3}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_completions(client, backend, tokenizer):
    reply = client.completions.create(model="test-model", prompt="Paris is", max_tokens=5)
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion"
    assert reply.choices[0].text == tokenizer.decode(backend.script[:5])
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
    assert backend.requests[0].prompt_token_ids == tuple(tokenizer.encode("Paris is", add_special_tokens=True))
    by_ids = client.completions.create(model="test-model", prompt=[1, 2, 3], max_tokens=5)
    assert by_ids.choices[0].text == reply.choices[0].text
    assert backend.requests[1].prompt_token_ids == (1, 2, 3)
    chunks = list(client.completions.create(model="test-model", prompt="Paris is", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 5


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_cut_and_never_leaks(client, backend, stream):
    kwargs = dict(model="test-model", messages=MESSAGES, stop=["Eiffel", "zzz"])
    if stream:
        deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                  if c.choices]
        text = "".join(deltas)
        assert not any("Eif" in d for d in deltas)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    assert text == SCRIPT_TEXT[:SCRIPT_TEXT.index("Eiffel")]
    # The router found the stop string and closed the backend iterator (the double does not stop).
    assert backend.ended.wait(2) and backend.closed == [backend.requests[0].request_id]


@pytest.mark.parametrize("tokens_per_chunk", [1, 3])
def test_multibyte_text_streams_whole(make_backend, serve, tokens_per_chunk):
    text = "Emoji 😀👍🏽 family 👨‍👩‍👧, 你好，世界！日本語のテキスト"
    url = serve(make_backend(text, tokens_per_chunk=tokens_per_chunk))
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        deltas = [c.choices[0].delta.content or "" for c in
                  client.chat.completions.create(model="test-model", messages=MESSAGES, stream=True)]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stop_token_id_ends_with_stop(client, backend, tokenizer):
    stop_id = backend.script[4]
    reply = client.chat.completions.create(model="test-model", messages=MESSAGES,
                                           extra_body={"stop_token_ids": [stop_id]})
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == tokenizer.decode(backend.script[:4])
    assert reply.usage.completion_tokens == 5


def test_cache_salt_and_retention_reach_the_backend(client, backend):
    """vLLM's cache_salt and epd's kv_retention; the class defaults from the protocol."""
    client.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=2)
    client.completions.create(model="test-model", prompt="Paris is", max_tokens=2)
    client.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=2,
                                   extra_body={"cache_salt": "tenant-a", "kv_retention": "agent"})
    got = [(r.cache_salt, r.request_class) for r in backend.requests]
    assert got == [("", "chat"), ("", "agent"), ("tenant-a", "agent")]
    chat = client.chat.completions.create
    openai_error(lambda: chat(model="test-model", messages=MESSAGES, extra_body={"kv_retention": "forever"}),
                 "kv_retention")
    openai_error(lambda: chat(model="test-model", messages=MESSAGES, extra_body={"cache_salt": ""}), "cache_salt")
    assert len(backend.requests) == 3


def test_bad_input_is_400(client, backend):
    chat = client.chat.completions.create
    body = openai_error(lambda: chat(model="test-model", messages=[{"role": "robot", "content": "x"}]), "'robot'")
    assert body["type"] == "invalid_request_error" and body["param"] == "messages[0].role"
    openai_error(lambda: chat(model="test-model", messages=MESSAGES, max_tokens=0), "max_tokens=0")
    openai_error(lambda: chat(model="test-model", messages=MESSAGES, max_tokens=5000), "5000", "2048")
    openai_error(lambda: chat(model="test-model", messages=[{"role": "user", "content": "hi " * 3000}]),
                 "the prompt is", "2048")
    openai_error(lambda: chat(model="test-model", messages=MESSAGES, n=17), "n=17", "[1, 16]")
    openai_error(lambda: chat(model="test-model", messages=MESSAGES, top_logprobs=2), "needs logprobs: true")
    openai_error(lambda: chat(model="test-model", messages=MESSAGES, logprobs=True, top_logprobs=21), "[0, 20]")
    openai_error(lambda: chat(model="test-model", messages=MESSAGES, tool_choice="required"), "needs tools")
    openai_error(lambda: chat(model="test-model", messages=MESSAGES, temperature=-1), "temperature")
    openai_error(lambda: chat(model="test-model", messages=MESSAGES, extra_body={"top_p": "x"}), "top_p")
    openai_error(lambda: chat(model="test-model", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), "takes no images")
    openai_error(lambda: client.completions.create(model="test-model", prompt=["a", "b"]), "not supported yet")
    body = openai_error(lambda: chat(model="gpt-9", messages=MESSAGES), "gpt-9", status=openai.NotFoundError)
    assert body["type"] == "not_found_error" and body["code"] == "model_not_found"
    assert backend.requests == []


@pytest.mark.parametrize("content, expected", [
    ("{not json", "not valid JSON"),
    ('{"model": "test-model"}', "messages: Field required"),
    ("[1, 2]", "must be a JSON object"),
])
def test_malformed_bodies_are_400(base_url, content, expected):
    response = httpx.post(f"{base_url}/v1/chat/completions", content=content,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert expected in error["message"] and error["type"] == "invalid_request_error"


def test_backend_failures(make_backend, serve):
    def client_for(**kwargs):
        return openai.OpenAI(base_url=f"{serve(make_backend(**kwargs))}/v1", api_key="x", max_retries=0)

    with client_for(abort_after=0) as client:
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model="test-model", messages=MESSAGES, stream=True)
        assert info.value.status_code == 503 and "aborted" in info.value.body["message"]
    with client_for(error=PromptTooLongError("too long for the KV pool")) as client:
        openai_error(lambda: client.chat.completions.create(model="test-model", messages=MESSAGES), "KV pool")
    with client_for(error=RuntimeError("boom")) as client:
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="test-model", messages=MESSAGES)
        assert info.value.body["type"] == "internal_server_error"
    with client_for(abort_after=3) as client:  # after the stream started: an error event, then [DONE]
        stream = client.chat.completions.create(model="test-model", messages=MESSAGES, stream=True)
        with pytest.raises(openai.APIError, match="aborted"):
            list(stream)


def test_images_reach_the_backend(make_backend, serve, tokenizer):
    image_id = tokenizer.backend.token_to_id("<repo_name>")
    backend = make_backend(image_token_id=image_id)
    png = "data:image/png;base64,iVBORw0KGgo="
    with openai.OpenAI(base_url=f"{serve(backend)}/v1", api_key="x", max_retries=0) as client:
        client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": png}}]}])
    [request] = backend.requests
    assert request.images == (png,)
    assert [request.prompt_token_ids[p] for p in request.image_positions] == [image_id]


def test_models_health_metrics_openapi(base_url, client, backend):
    assert [m.id for m in client.models.list()] == ["alias", "test-model"]
    assert httpx.get(f"{base_url}/health").status_code == 200
    backend.healthy = False
    assert httpx.get(f"{base_url}/health").status_code == 503
    client.chat.completions.create(model="test-model", messages=MESSAGES)
    metrics = httpx.get(f"{base_url}/metrics").text
    assert 'epd_router_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics
    assert "epd_router_time_to_first_token_seconds_bucket" in metrics
    assert "epd_router_generation_tokens_total" in metrics
    spec = httpx.get(f"{base_url}/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= set(spec["paths"])
    assert {"ChatCompletionRequest", "CompletionRequest", "ChatMessage"} <= set(spec["components"]["schemas"])
    assert httpx.get(f"{base_url}/nope").json()["error"]["type"] == "not_found_error"


def test_models_retrieve_answers_one_entry_of_the_list_or_404(base_url, client):
    listed = httpx.get(f"{base_url}/v1/models").json()["data"]
    for entry in listed:
        body = httpx.get(f"{base_url}/v1/models/{entry['id']}").json()
        assert body == {**entry, "created": body["created"]}  # the list's entry (made in another second, maybe)
        model = client.models.retrieve(entry["id"])
        assert model.model_dump(exclude_none=True) == {"id": entry["id"], "object": "model", "created": model.created,
                                                       "owned_by": "epd", "max_model_len": 2048}
    assert [entry["id"] for entry in listed] == ["alias", "test-model"]
    openai_error(lambda: client.models.retrieve("gpt-9"), "gpt-9", status=openai.NotFoundError)
    reply = httpx.get(f"{base_url}/v1/models/gpt-9")
    assert reply.status_code == 404 and reply.json() == {"error": {
        "message": "model 'gpt-9' does not exist; this server serves ['alias', 'test-model']",
        "type": "not_found_error", "param": "model", "code": "model_not_found"}}


def test_a_served_name_with_a_slash_is_retrieved(make_backend, serve):
    with openai.OpenAI(base_url=f"{serve(make_backend(), ['org/alias'])}/v1", api_key="x", max_retries=0) as client:
        assert client.models.retrieve("org/alias").id == "org/alias"
        openai_error(lambda: client.models.retrieve("org/other"), "org/other", status=openai.NotFoundError)


def test_router_imports_no_torch_and_no_engine():
    """STYLE rule 15: router -> common (and generated pb) and kvstore only."""
    root = Path(__file__).resolve().parents[3] / "services" / "router"
    forbidden = ("torch", "services.engine", "services.prefill", "services.decode", "services.encoder")
    bad = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            bad += [f"{path.name}: {n}" for n in names if any(n == f or n.startswith(f + ".") for f in forbidden)]
    assert bad == []


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": MESSAGES}),
                                        ("/v1/completions", {"prompt": "Say something."})])
def test_streamed_token_ids_add_up_to_the_non_streamed_ones(base_url, path, body):
    """``return_token_ids``: each stream chunk carries the ids new since the previous one."""
    body = {"model": "test-model", "return_token_ids": True, "n": 2, **body}
    full = httpx.post(base_url + path, json=body, timeout=10).json()
    streamed: dict[int, list[int]] = {0: [], 1: []}
    with httpx.stream("POST", base_url + path, json={**body, "stream": True}, timeout=10) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed[choice["index"]] += choice["token_ids"]
    assert streamed == {c["index"]: c["token_ids"] for c in full["choices"]}
    assert all(streamed.values())
