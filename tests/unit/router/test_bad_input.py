"""Bad input is cheap to refuse: a 400 in the path's protocol that names the field, never a 500,
never work in proportion to a hostile body (STYLE rule 17). Every protocol: chat completions,
completions, Responses, Anthropic Messages (and count_tokens)."""

from __future__ import annotations

import json

import httpx
import pytest

from services.common.errors import InvalidRequestError, PromptTooLongError
from services.router.api import prompts
from services.router.api.body_checks import (MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, MAX_JSON_VALUES, check_json_size,
                                         check_json_text, parse_json_text)
from services.router.api.openai_models import ChatCompletionRequest, ChatMessage

BIG = 2**70  # 1180591620717411303424, the seed that once failed in the proto conversion
SURROGATES = '"a \\ud800 b \\udfff"'  # JSON text: lone surrogates, which JSON may spell
USER = '{"role": "user", "content": "hi"}'
PATHS = {
    "chat": ("/v1/chat/completions", '{{"messages": [{messages}], "max_tokens": 5{extra}}}'),
    "completions": ("/v1/completions", '{{"prompt": {prompt}, "max_tokens": 5{extra}}}'),
    "responses": ("/v1/responses", '{{"input": [{messages}], "max_output_tokens": 5{extra}}}'),
    "messages": ("/v1/messages", '{{"model": "test-model", "messages": [{messages}], "max_tokens": 5{extra}}}'),
    "count_tokens": ("/v1/messages/count_tokens", '{{"model": "test-model", "messages": [{messages}]{extra}}}'),
}


def post(base_url: str, protocol: str, messages: str = USER, prompt: str = '"hi"', extra: str = "",
         raw: str | None = None) -> tuple[int, str, str | None]:
    """(status, error message, param) of a raw JSON body sent to ``protocol``'s path; the error body
    must be the protocol's own."""
    path, template = PATHS[protocol]
    body = raw if raw is not None else template.format(messages=messages, prompt=prompt, extra=extra)
    response = httpx.post(base_url + path, content=body.encode(), headers={"content-type": "application/json"},
                          timeout=30)
    error = response.json()
    if protocol in ("messages", "count_tokens"):
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
        return response.status_code, error["error"]["message"], None
    assert error["error"]["type"] == "invalid_request_error", error
    return response.status_code, error["error"]["message"], error["error"]["param"]


# --- integers that reach the wire ---------------------------------------------------------------

@pytest.mark.parametrize("protocol, extra, param", [
    ("chat", f', "seed": {BIG}', "seed"),
    ("chat", f', "seed": {2**63 - 2}, "n": 3', "seed"),  # choices are seeded seed, seed + 1, seed + 2
    ("chat", f', "top_k": {BIG}', "top_k"),
    ("chat", f', "min_tokens": {2**31}', "min_tokens"),
    ("chat", ', "num_speculative_tokens": -1', "num_speculative_tokens"),
    ("chat", f', "stop_token_ids": [1, {2**31}]', "stop_token_ids[1]"),
    ("chat", ', "stop_token_ids": [-1]', "stop_token_ids[0]"),
    ("chat", f', "top_logprobs": {BIG}, "logprobs": true', "top_logprobs"),
    ("chat", f', "n": {BIG}', "n"),
    ("chat", f', "stop": {json.dumps(["x"] * 65)}', "stop"),
    ("completions", f', "seed": {BIG}', "seed"),
    ("completions", f', "logprobs": {BIG}', "logprobs"),
    ("completions", f', "best_of": {BIG}', "best_of"),
    ("responses", f', "seed": {-BIG}', "seed"),
    ("responses", f', "top_k": {BIG}', "top_k"),
    ("messages", f', "top_k": {BIG}', "top_k"),
    ("messages", f', "stop_sequences": {json.dumps(["x"] * 65)}', "stop_sequences"),
])
def test_integers_out_of_the_wire_range_are_400(base_url, backend, protocol, extra, param):
    status, message, named = post(base_url, protocol, extra=extra)
    assert status == 400 and message.startswith(param), message
    assert named in (param, None)  # Anthropic's error body has no param: the message names it
    assert backend.requests == []


def test_a_seed_at_the_edge_of_int64_is_served(client, backend):
    client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=2, seed=2**63 - 2, n=2)
    assert [r.params.seed for r in backend.requests] == [2**63 - 2, 2**63 - 1]


# --- numbers and stop lists outside each protocol's documented range ------------------------------

FIVE_STOPS = json.dumps(["a", "b", "c", "d", "e"])


@pytest.mark.parametrize("protocol, extra, param, words", [
    ("chat", ', "temperature": 2.5', "temperature", "must be a number in [0, 2]"),
    ("completions", ', "temperature": 2.5', "temperature", "must be a number in [0, 2]"),
    ("responses", ', "temperature": 2.5', "temperature", "must be a number in [0, 2]"),
    ("chat", ', "temperature": -0.5', "temperature", "must be a number in [0, 2]"),
    ("messages", ', "temperature": 1.5', "temperature", "must be a number in [0, 1]"),  # Anthropic's range
    ("chat", ', "top_p": 1.5', "top_p", "must be in (0, 1]"),
    ("completions", ', "top_p": -0.1', "top_p", "must be in (0, 1]"),
    ("responses", ', "top_p": 1.5', "top_p", "must be in (0, 1]"),
    ("chat", ', "presence_penalty": 2.5', "presence_penalty", "must be in [-2, 2]"),
    ("completions", ', "presence_penalty": -2.5', "presence_penalty", "must be in [-2, 2]"),
    ("chat", ', "frequency_penalty": -3', "frequency_penalty", "must be in [-2, 2]"),
    ("completions", ', "frequency_penalty": 3', "frequency_penalty", "must be in [-2, 2]"),
    ("chat", f', "stop": {FIVE_STOPS}', "stop", "stop has 5 strings; at most 4 are accepted"),
    ("completions", f', "stop": {FIVE_STOPS}', "stop", "stop has 5 strings; at most 4 are accepted"),
])
def test_out_of_range_sampling_fields_are_400_naming_the_field(base_url, backend, protocol, extra, param, words):
    status, message, named = post(base_url, protocol, extra=extra)
    assert status == 400 and message.startswith(param) and words in message, message
    assert named in (param, None)  # Anthropic's error body has no param: the message names it
    assert backend.requests == []


def test_an_out_of_range_temperature_is_each_protocols_error_body(base_url):
    reply = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                "temperature": 2.5})
    assert reply.status_code == 400 and reply.json() == {"error": {
        "message": "temperature=2.5 is invalid: must be a number in [0, 2]", "type": "invalid_request_error",
        "param": "temperature", "code": None}}
    reply = httpx.post(f"{base_url}/v1/messages", json={"model": "test-model", "max_tokens": 5, "temperature": 1.5,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 400 and reply.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "temperature=1.5 is invalid: must be a number in [0, 1]"}}


def test_the_edges_of_the_ranges_are_served(client, base_url, backend):
    """temperature 2 and 4 stop sequences on the OpenAI endpoints; temperature 1 and more than 4
    stop sequences (up to MAX_STOP_STRINGS) on Anthropic's."""
    stops = ["zz1", "zz2", "zz3", "zz4"]
    client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   temperature=2, top_p=1, presence_penalty=-2, frequency_penalty=2, stop=stops)
    client.completions.create(model="test-model", prompt="hi", max_tokens=2, temperature=2, stop=stops)
    client.responses.create(model="test-model", input="hi", max_output_tokens=2, temperature=2)
    reply = httpx.post(f"{base_url}/v1/messages", json={
        "model": "test-model", "max_tokens": 2, "temperature": 1, "stop_sequences": [*stops, "zz5"],
        "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200, reply.text
    chat, completion, response, message = (r.params for r in backend.requests)
    assert (chat.temperature, chat.top_p, chat.presence_penalty, chat.frequency_penalty) == (2, 1, -2, 2)
    assert chat.stop == completion.stop == tuple(stops) and completion.temperature == response.temperature == 2
    assert (message.temperature, message.stop) == (1, (*stops, "zz5"))


def test_token_id_prompts_are_checked_before_they_are_scanned(tokenizer):
    with pytest.raises(PromptTooLongError, match="the prompt is 5000 tokens") as info:
        prompts.completion_prompt([BIG] * 5000, tokenizer, max_model_len=2048)
    assert (info.value.param, info.value.code) == ("prompt", "context_length_exceeded")
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        prompts.completion_prompt([1, BIG], tokenizer, max_model_len=2048)


# --- invalid Unicode ----------------------------------------------------------------------------

@pytest.mark.parametrize("protocol, fields, param", [
    ("chat", {"messages": f'{{"role": "user", "content": {SURROGATES}}}'}, "messages[0].content"),
    ("chat", {"messages": f'{{"role": "system", "content": [{{"type": "text", "text": {SURROGATES}}}]}}, {USER}'},
     "messages[0].content[0].text"),
    ("chat", {"messages": f'{{"role": "user", "content": "hi", "name": {SURROGATES}}}'}, "messages[0].name"),
    ("chat", {"extra": f', "stop": ["ok", {SURROGATES}]'}, "stop[1]"),
    ("chat", {"extra": f', "tools": [{{"type": "function", "function": {{"name": "f", '
                       f'"description": {SURROGATES}}}}}]'}, "tools[0].function.description"),
    ("chat", {"extra": f', "cache_salt": {SURROGATES}'}, "cache_salt"),
    ("chat", {"extra": f', "metadata": {{{SURROGATES}: 1}}'}, "metadata"),
    ("chat", {"extra": ', "structured_outputs": {"json": "{\\"description\\": \\"\\\\ud800\\"}"}'},
     "structured_outputs.json.description"),
    ("completions", {"prompt": SURROGATES}, "prompt"),
    ("completions", {"prompt": f"[{SURROGATES}]"}, "prompt[0]"),
    ("responses", {"messages": f'{{"role": "user", "content": {SURROGATES}}}'}, "input[0].content"),
    ("responses", {"extra": f', "instructions": {SURROGATES}'}, "instructions"),
    ("messages", {"messages": f'{{"role": "user", "content": [{{"type": "text", "text": {SURROGATES}}}]}}'},
     "messages[0].content[0].text"),
    ("messages", {"extra": f', "system": {SURROGATES}'}, "system"),
    ("messages", {"extra": f', "stop_sequences": [{SURROGATES}]'}, "stop_sequences[0]"),
    ("messages", {"extra": f', "tools": [{{"name": {SURROGATES}, "input_schema": {{"type": "object"}}}}]'},
     "tools[0].name"),
    ("count_tokens", {"messages": f'{{"role": "user", "content": {SURROGATES}}}'}, "messages[0].content"),
])
def test_lone_surrogates_are_400_naming_the_field(base_url, backend, protocol, fields, param):
    status, message, named = post(base_url, protocol, **fields)
    assert status == 400 and f"{param} is not valid Unicode" in message, message
    assert "U+D800" in message and named in (param, None)
    assert backend.requests == []


def test_surrogate_pairs_are_fine(client, backend, tokenizer):
    client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "smile 😀"}],
                                   max_tokens=2)
    [request] = backend.requests
    assert "smile 😀" in tokenizer.decode(request.prompt_token_ids)


def test_json_text_inside_a_body_is_checked_too():
    assert parse_json_text('{"a": [1, "é"]}', "x") == {"a": [1, "é"]}
    with pytest.raises(InvalidRequestError, match=r"^x\.a\[0\] is not valid Unicode") as info:
        parse_json_text('{"a": ["\\udc00"]}', "x")
    assert info.value.param == "x.a[0]"
    with pytest.raises(InvalidRequestError, match="x is not valid JSON"):
        parse_json_text("[" * 10_000 + "]" * 10_000, "x")  # past json's own recursion limit: no 500


# --- a prompt that cannot fit is refused before it is tokenized ---------------------------------

@pytest.fixture
def no_long_encodes(tokenizer, monkeypatch):
    """Fails any encode of more than 100,000 characters (the server threads share the tokenizer)."""
    encode = tokenizer.encode
    long = []

    def checked(text, *args, **kwargs):
        if len(text) > 100_000:
            long.append(len(text))
        return encode(text, *args, **kwargs)
    monkeypatch.setattr(tokenizer, "encode", checked)
    yield
    assert long == [], "a text that cannot fit was tokenized"


WORDS = json.dumps("the quick brown fox jumps over the lazy dog " * 25_000)  # 1.1 MB, ~250K tokens


@pytest.mark.parametrize("protocol, fields, param", [
    ("chat", {"messages": f'{{"role": "user", "content": {WORDS}}}'}, "messages"),
    ("completions", {"prompt": WORDS}, "prompt"),
    ("responses", {"messages": f'{{"role": "user", "content": {WORDS}}}'}, "input"),
    ("messages", {"messages": f'{{"role": "user", "content": {WORDS}}}'}, None),
    ("count_tokens", {"messages": f'{{"role": "user", "content": {WORDS}}}'}, None),
])
def test_a_prompt_that_cannot_fit_is_refused_untokenized(base_url, backend, no_long_encodes, protocol, fields, param):
    status, message, named = post(base_url, protocol, **fields)
    assert status == 400 and message.startswith("the prompt is at least "), message
    assert "this model's context is 2048 tokens" in message and named == param
    assert backend.requests == []


def test_a_prompt_that_fits_is_tokenized_exactly_as_before(tokenizer, no_long_encodes):
    messages = [ChatMessage(role="user", content="the quick brown fox " * 50)]
    exact = prompts.chat_prompt(messages, tokenizer, None)
    assert prompts.chat_prompt(messages, tokenizer, None, max_model_len=len(exact.token_ids) + 1) == exact
    text = "Paris is " * 100
    assert (prompts.completion_prompt(text, tokenizer, max_model_len=2048).token_ids
            == tuple(tokenizer.encode(text, add_special_tokens=True)))


def test_the_bound_counts_every_piece_and_image(tokenizer):
    texts = ["#" * 800, "#" * 800]  # no token holds more than 80 '#': at least 10 tokens each
    assert [tokenizer.min_num_tokens(text) for text in texts] == [10, 10]
    with pytest.raises(PromptTooLongError, match="at least") as info:
        prompts.check_fits(tokenizer, texts, 1, 21, "messages")  # and an image
    assert str(info.value).startswith("the prompt is at least 21 tokens")
    prompts.check_fits(tokenizer, texts, 0, 21, "messages")  # 20 tokens: fits


# --- the body's size and shape ------------------------------------------------------------------

def test_json_counts():
    check_json_size(b'{"a": "' + b"{[," * 2_000_000 + b'"}')  # brackets in strings do not count
    check_json_size(b'{"a": "\\"{\\\\", "b": "' + b"[" * 60_000 + b'"}')  # escaped quotes and backslashes
    with pytest.raises(InvalidRequestError, match="has 60000 JSON objects"):  # a string left open
        check_json_size(b"[" * 60_000 + b'"\\' * 2_000_000)
    with pytest.raises(InvalidRequestError, match="about 3000000 JSON values"):  # many short strings
        check_json_size(b"[" + b",".join([b'"ab"'] * 3_000_000) + b"]")
    with pytest.raises(InvalidRequestError, match=f"has {MAX_JSON_CONTAINERS + 1} JSON objects and arrays"):
        check_json_size(b"[" + b",".join([b"{}"] * MAX_JSON_CONTAINERS) + b"]")
    with pytest.raises(InvalidRequestError, match=f"about {MAX_JSON_VALUES + 1} JSON values"):
        check_json_size(b"[" + b",".join([b"1"] * (MAX_JSON_VALUES + 1)) + b"]")
    deep: list = []
    for _ in range(MAX_JSON_DEPTH):
        deep = [deep]
    check_json_text({"a": deep[0]})
    with pytest.raises(InvalidRequestError, match="nests more than") as info:
        check_json_text({"a": deep})
    assert info.value.param.startswith("a[0][0][0]")


@pytest.mark.parametrize("protocol", ["chat", "completions", "responses", "messages", "count_tokens"])
def test_too_many_json_values_and_too_deep_bodies_are_400(base_url, backend, protocol):
    many = ",".join(["{}"] * (MAX_JSON_CONTAINERS + 1))
    status, message, _ = post(base_url, protocol, extra=f', "metadata": {{"x": [{many}]}}')
    assert status == 400 and "JSON objects and arrays; at most" in message
    status, message, _ = post(base_url, protocol, extra=', "metadata": {"x": ' + "[" * 100 + "]" * 100 + "}")
    assert status == 400 and message.startswith("metadata.x[0][0]") and "nests more than" in message
    assert backend.requests == []


def test_empty_messages_by_the_million_cost_little(base_url):
    """15 MB of {} once took 29 s and 5.7 GB in pydantic's error list."""
    status, message, _ = post(base_url, "chat", raw='{"messages": [' + ",".join(["{}"] * 5_000_000) + "]}")
    assert status == 400 and "5000002 JSON objects and arrays" in message
    status, message, param = post(base_url, "chat", raw='{"messages": [' + ",".join(["{}"] * 40_000) + "]}")
    assert status == 400 and param == "messages[0].role" and len(message) < 1000
    assert message.endswith("; and 39989 more errors")  # eleven named


def test_a_deep_schema_is_400_not_a_crash(base_url):
    schema: dict = {"type": "string"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"a": schema}}
    for extra in (f', "structured_outputs": {{"json": {json.dumps(json.dumps(schema))}}}',
                  f', "response_format": {{"type": "json_schema", "json_schema": {{"name": "x", "schema": '
                  f'{json.dumps(schema)}}}}}'):
        status, message, _ = post(base_url, "chat", extra=extra)
        assert status == 400 and "nests more than" in message


def test_request_models_check_their_text():
    with pytest.raises(ValueError, match="is not valid Unicode"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "\ud800"}]})
