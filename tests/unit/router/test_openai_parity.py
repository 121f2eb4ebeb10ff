"""Where clients expect OpenAI's behaviour (found by running an OpenAI-server test suite against
epd): completions' default max_tokens, images sent to a text-only model, system_fingerprint,
CORS for browsers, and logit_bias."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from services.common.config import ConfigError, parse_config
from services.router.api import openai_api as api
from services.router.access.auth import ApiKey, FileKeyStore, hash_key
from services.router.config import RouterConfig
from services.router.access.gate import Gate
from services.router.api.app import create_app
from services.router.access.limits import Limits, LocalLimiter
from tests.unit.router.fakes import ServerThread, openai_error

MESSAGES = [{"role": "user", "content": "Hello"}]
PNG = "data:image/png;base64,iVBORw0KGgo="
ORIGIN = "https://app.example.com"


# ----- completions: max_tokens defaults to 16, as OpenAI's -----------------------------------
def test_completions_default_to_16_tokens_and_chat_to_the_rest_of_the_context(make_backend, serve):
    long_backend = make_backend(" word" * 100)
    with openai.OpenAI(base_url=f"{serve(long_backend)}/v1", api_key="x", max_retries=0) as client:
        completion = client.completions.create(model="test-model", prompt="Say")
        assert (completion.usage.completion_tokens, completion.choices[0].finish_reason) == (16, "length")
        chunks = list(client.completions.create(model="test-model", prompt="Say", stream=True))
        assert "".join(c.choices[0].text for c in chunks) == completion.choices[0].text
        reply = client.chat.completions.create(model="test-model", messages=MESSAGES)
        assert reply.usage.completion_tokens == 101  # the whole script and EOS
    first, _, chat = long_backend.requests
    assert first.params.max_tokens == 16
    assert chat.params.max_tokens == long_backend.max_model_len - len(chat.prompt_token_ids)


# ----- images: a model without a vision tower answers 400 in every protocol -------------------
def test_a_text_only_model_refuses_images_naming_the_part(client, base_url, backend):
    chat = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": PNG}}]}]
    body = openai_error(lambda: client.chat.completions.create(model="test-model", messages=chat), "takes no images")
    assert (body["type"], body["param"]) == ("invalid_request_error", "messages[0].content[1]")
    assert "messages[0].content[1]" in body["message"]
    items = [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                          {"type": "input_image", "image_url": PNG}]}]
    body = openai_error(lambda: client.responses.create(model="test-model", input=items), "takes no images")
    assert (body["type"], body["param"]) == ("invalid_request_error", "input[0].content[1]")
    with anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0) as claude:
        image = [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]
        for call in (lambda: claude.messages.create(model="test-model", max_tokens=5, messages=image),
                     lambda: claude.messages.count_tokens(model="test-model", messages=image)):
            with pytest.raises(anthropic.BadRequestError) as info:
                call()
            error = info.value.body["error"]
            assert error["type"] == "invalid_request_error"
            assert "messages[0].content[0]" in error["message"] and "takes no images" in error["message"]
    assert backend.requests == []


def test_responses_images_reach_a_model_that_takes_them(make_backend, serve, tokenizer):
    image_id = tokenizer.backend.token_to_id("<repo_name>")
    backend = make_backend(image_token_id=image_id)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                          {"type": "input_image", "image_url": PNG}]}]
    with openai.OpenAI(base_url=f"{serve(backend)}/v1", api_key="x", max_retries=0) as client:
        client.responses.create(model="test-model", input=items, max_output_tokens=3)
        client.chat.completions.create(model="test-model", max_tokens=3, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": PNG}}]}])
        by_file = [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]
        body = openai_error(lambda: client.responses.create(model="test-model", input=by_file), "file_id")
        assert body["param"] == "input[0].content[0]"
        bad = [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/cat.png"}]}]
        body = openai_error(lambda: client.responses.create(model="test-model", input=bad), "only data:image")
        assert body["param"] == "input[0].content[0].image_url"
    responses, chat = backend.requests
    assert responses.images == chat.images == (PNG,)
    assert responses.prompt_token_ids == chat.prompt_token_ids  # the same conversation, the same prompt
    assert [responses.prompt_token_ids[p] for p in responses.image_positions] == [image_id]


# ----- system_fingerprint in every chat / completion object and chunk ---------------------------
def test_every_object_and_chunk_has_the_deployments_fingerprint(client):
    fingerprint = api.system_fingerprint("test-model")
    objects = [client.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=3),
               client.completions.create(model="test-model", prompt="Say", max_tokens=3, n=2)]
    objects += client.chat.completions.create(model="alias", messages=MESSAGES, max_tokens=3, stream=True,
                                              stream_options={"include_usage": True})
    objects += client.completions.create(model="test-model", prompt="Say", max_tokens=3, stream=True,
                                         stream_options={"include_usage": True})
    assert {o.object for o in objects} == {"chat.completion", "chat.completion.chunk", "text_completion"}
    assert objects[-1].usage is not None and objects[-1].choices == []  # the usage chunks too
    assert [o.system_fingerprint for o in objects] == [fingerprint] * len(objects)


def test_raw_chunks_carry_the_fingerprint(base_url):
    body = {"model": "test-model", "messages": MESSAGES, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 3 and all(c["system_fingerprint"].startswith("fp_") for c in chunks)


# ----- CORS ------------------------------------------------------------------------------------
KEY = "epd-cors-test"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os, openai-beta"}


@pytest.fixture
def gated_url(backend):
    """The router behind a gate that needs KEY, with CORS for ORIGIN; and the same without CORS."""
    store = FileKeyStore(None)
    asyncio.run(store.add(ApiKey(hash_key(KEY), "acme")))

    def app(origins: tuple[str, ...]):
        return create_app(backend, gate=Gate(store, LocalLimiter(), Limits(), max_body_bytes=1 << 20),
                          cors_allow_origins=origins)

    with ServerThread(app((ORIGIN,))) as with_cors, ServerThread(app(())) as without:
        yield with_cors.url, without.url


def test_a_preflight_is_answered_before_the_api_key_is_asked_for(gated_url):
    with_cors, without = gated_url
    # Without CORS the preflight meets the gate, which wants a key that no preflight carries.
    assert httpx.options(f"{without}/v1/chat/completions", headers=PREFLIGHT).status_code == 401
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/models"):
        response = httpx.options(with_cors + path, headers=PREFLIGHT)
        assert response.status_code == 200, response.text
        assert response.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in response.headers["access-control-allow-methods"]
        allowed = {h.strip().lower() for h in response.headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type", "x-stainless-os", "openai-beta"} <= allowed
    other = httpx.options(f"{with_cors}/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_cross_origin_calls_get_cors_headers_and_still_need_a_key(gated_url):
    with_cors, without = gated_url
    body = {"model": "test-model", "messages": MESSAGES, "max_tokens": 2}
    ok = httpx.post(f"{with_cors}/v1/chat/completions", json=body,
                    headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "retry-after" in ok.headers["access-control-expose-headers"].lower()
    denied = httpx.post(f"{with_cors}/v1/chat/completions", json=body, headers={"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN  # readable
    streamed = httpx.post(f"{with_cors}/v1/chat/completions", json={**body, "stream": True},
                          headers={"Origin": ORIGIN, "x-api-key": KEY})
    assert streamed.status_code == 200 and streamed.headers["access-control-allow-origin"] == ORIGIN
    plain = httpx.post(f"{without}/v1/chat/completions", json=body,
                       headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert plain.status_code == 200 and not any(h.startswith("access-control-") for h in plain.headers)


def test_any_origin(backend):
    with ServerThread(create_app(backend, cors_allow_origins=("*",))) as server:
        response = httpx.options(f"{server.url}/v1/completions", headers=PREFLIGHT)
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "*"


def test_cors_setting_is_a_flag_and_an_env_var():
    config = parse_config(RouterConfig, ["--cors-allow-origin", ORIGIN, "--cors-allow-origin", "http://localhost:3000"],
                          "router", env={})
    assert config.cors_allow_origin == (ORIGIN, "http://localhost:3000")
    from_env = parse_config(RouterConfig, [], "router", env={"EPD_ROUTER_CORS_ALLOW_ORIGIN": f"{ORIGIN},*"})
    assert from_env.cors_allow_origin == (ORIGIN, "*")
    assert parse_config(RouterConfig, [], "router", env={}).cors_allow_origin == ()
    with pytest.raises(ConfigError, match="--cors-allow-origin / EPD_ROUTER_CORS_ALLOW_ORIGIN") as info:
        parse_config(RouterConfig, ["--cors-allow-origin", "https://app.example.com/chat"], "router", env={})
    assert "without a path" in str(info.value)


# ----- logit_bias --------------------------------------------------------------------------------
def test_logit_bias_reaches_the_engine(client, backend, tokenizer):
    token = tokenizer.encode(" Paris")[0]
    client.chat.completions.create(model="test-model", messages=MESSAGES, logit_bias={str(token): 100, "0": -100})
    client.completions.create(model="test-model", prompt="Say", logit_bias={str(token): -5.5})
    chat, completion = backend.requests
    assert chat.params.logit_bias == ((0, -100.0), (token, 100.0))
    assert completion.params.logit_bias == ((token, -5.5),)


@pytest.mark.parametrize("bias, words", [
    ({"49152": 1}, "'49152' is not a token id"), ({"x": 1}, "'x' is not a token id"),
    ({"5": 101}, "[-100, 100]"), ({str(i): 1 for i in range(301)}, "at most 300"),
])
def test_bad_logit_bias_is_a_400_naming_the_field(client, backend, bias, words):
    for call in (lambda: client.chat.completions.create(model="test-model", messages=MESSAGES, logit_bias=bias),
                 lambda: client.completions.create(model="test-model", prompt="Say", logit_bias=bias)):
        body = openai_error(call, "logit_bias", words)
        assert (body["type"], body["param"]) == ("invalid_request_error", "logit_bias")
    body = openai_error(lambda: client.chat.completions.create(model="test-model", messages=MESSAGES,
                                                               logit_bias={"5": "lots"}), "logit_bias")
    assert body["param"].startswith("logit_bias")
    assert backend.requests == []
