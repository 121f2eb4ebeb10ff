"""The pure core: prompts, sampling parameters and output text, without a server."""

from __future__ import annotations

import base64
import re

import pytest

from services.common.errors import InvalidRequestError, PromptTooLongError, UnavailableError
from services.common.sampling_params import SamplingParams
from services.router.api import openai_api as api
from services.router.api import prompts
from services.router.cluster.backend import GenerateChunk, GenerateRequest
from services.router.api.app import describe_validation_errors
from services.router.api.openai_models import ChatCompletionRequest, ChatMessage, CompletionRequest
from services.router.api.output import OutputText

PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_chat_prompt_is_the_template_encoded(tokenizer):
    messages = [ChatMessage(role="developer", content="Be brief."), ChatMessage(role="user", content="Hi")]
    prompt = prompts.chat_prompt(messages, tokenizer, image_token_id=None)
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}])
    assert prompt.token_ids == tuple(tokenizer.encode(text))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert prompt.token_ids[0] == tokenizer.backend.token_to_id("<|im_start|>")
    assert prompt.images == () and prompt.image_positions == ()


def test_text_parts_join_with_newlines(tokenizer):
    parts = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]})
    plain = ChatMessage(role="user", content="a\nb")
    assert prompts.chat_prompt([parts], tokenizer, None) == prompts.chat_prompt([plain], tokenizer, None)


def test_each_image_is_one_placeholder(tokenizer):
    image_id = tokenizer.backend.token_to_id("<repo_name>")
    message = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": PNG}},
        {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": PNG}}]})
    prompt = prompts.chat_prompt([message], tokenizer, image_id)
    assert prompt.images == (PNG, PNG)
    assert prompt.token_ids.count(image_id) == 2
    assert [prompt.token_ids[p] for p in prompt.image_positions] == [image_id, image_id]
    first, second = prompt.image_positions
    assert tokenizer.decode(prompt.token_ids[first + 1:second]) == "\nwith\n"


@pytest.mark.parametrize("content, image_id, message", [
    ([{"type": "image_url", "image_url": {"url": PNG}}], None, "takes no images"),
    ([{"type": "image_url", "image_url": {"url": "https://x/cat.png"}}], 5, "only data:image"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}], 5, "does not decode"),
    ([{"type": "text"}], None, "needs \"text\""),
    ("see <repo_name>", "<repo_name>", "spells the image placeholder"),
])
def test_bad_content_is_rejected(tokenizer, content, image_id, message):
    if isinstance(image_id, str):
        image_id = tokenizer.backend.token_to_id(image_id)
    msg = ChatMessage.model_validate({"role": "user", "content": content})
    with pytest.raises(InvalidRequestError, match=message):
        prompts.chat_prompt([msg], tokenizer, image_id)


def test_unknown_role_is_named(tokenizer):
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]\.role 'robot'") as info:
        prompts.chat_prompt([ChatMessage(role="user", content="a"), ChatMessage(role="robot", content="b")],
                        tokenizer, None)
    assert info.value.param == "messages[1].role"


def test_completion_prompts(tokenizer):
    ids = tuple(tokenizer.encode("Hello world", add_special_tokens=True))
    assert prompts.completion_prompt("Hello world", tokenizer).token_ids == ids
    assert prompts.completion_prompt(["Hello world"], tokenizer).token_ids == ids
    assert prompts.completion_prompt([[1, 2, 3]], tokenizer).token_ids == (1, 2, 3)
    with pytest.raises(InvalidRequestError, match="2 prompts"):
        prompts.completion_prompt(["a", "b"], tokenizer)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        prompts.completion_prompt([1, tokenizer.vocab_size], tokenizer)
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        prompts.completion_prompt([], tokenizer)


def test_max_tokens_defaults_to_the_rest_of_the_context():
    params = api.sampling_params(chat(temperature=0, stop="x", top_k=-1), 100, 2048, "messages")
    assert params == SamplingParams(temperature=0, max_tokens=1948, stop=("x",))
    assert api.sampling_params(chat(max_tokens=5, max_completion_tokens=7), 100, 2048, "messages").max_tokens == 7


def test_completions_default_to_16_tokens_as_openai():
    def max_tokens(num_prompt_tokens: int, **fields) -> int:
        return api.sampling_params(CompletionRequest(prompt="x", **fields), num_prompt_tokens, 2048, "prompt",
                                   default_max_tokens=api.COMPLETION_DEFAULT_MAX_TOKENS).max_tokens

    assert api.COMPLETION_DEFAULT_MAX_TOKENS == 16
    assert max_tokens(100) == 16
    assert max_tokens(2040) == 8  # never past the context
    assert max_tokens(100, max_tokens=500) == 500
    assert max_tokens(100, min_tokens=40) == 40  # a request that only sets min_tokens is not refused


def test_logit_bias_is_checked_and_carried():
    bias = api.check_logit_bias({"5": 100, "49151": -100.0, "0": 0.5}, 49152)
    assert bias == {5: 100, 49151: -100.0, 0: 0.5}
    params = api.sampling_params(chat(), 10, 2048, "messages", logit_bias=bias)
    assert params.logit_bias == ((0, 0.5), (5, 100.0), (49151, -100.0))
    assert api.check_logit_bias(None, 10) == {} and api.check_logit_bias({}, 10) == {}
    assert api.sampling_params(chat(), 10, 2048, "messages").logit_bias == ()


@pytest.mark.parametrize("bias, words", [
    ({"49152": 1}, "'49152' is not a token id"), ({"-1": 1}, "'-1' is not a token id"),
    ({"cat": 1}, "'cat' is not a token id"), ({" 7": 1}, "' 7' is not a token id"),
    ({"1e3": 1}, "'1e3'"), ({"7": 100.5}, "must be a number in [-100, 100]"),
    ({"7": -101}, "[-100, 100]"), ({"7": float("nan")}, "[-100, 100]"), ({"7": float("inf")}, "[-100, 100]"),
    ({str(i): 1 for i in range(301)}, "names 301 tokens; at most 300"),
])
def test_bad_logit_bias_is_a_400_naming_the_field(bias, words):
    with pytest.raises(InvalidRequestError, match=re.escape(words)) as info:
        api.check_logit_bias(bias, 49152)
    assert info.value.param == "logit_bias" and info.value.http_status == 400


def test_system_fingerprint_is_stable_per_model():
    fingerprint = api.system_fingerprint("SmolLM2-135M-Instruct")
    assert re.fullmatch(r"fp_[0-9a-f]{10}", fingerprint)
    assert api.system_fingerprint("SmolLM2-135M-Instruct") == fingerprint != api.system_fingerprint("other")


def test_context_errors_give_the_numbers():
    with pytest.raises(PromptTooLongError, match="the prompt is 2048 tokens, but this model's context is 2048"):
        api.sampling_params(chat(), 2048, 2048, "messages")
    with pytest.raises(PromptTooLongError, match="max_tokens=1000 plus the prompt's 1100 tokens is 2100") as info:
        api.sampling_params(chat(max_tokens=1000), 1100, 2048, "messages")
    assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(InvalidRequestError, match="max_completion_tokens=0 is invalid"):
        api.sampling_params(chat(max_completion_tokens=0), 10, 2048, "messages")


@pytest.mark.parametrize("fields, param, words", [
    ({"n": 0}, "n", "must be in [1, 16]"), ({"n": 17}, "n", "must be in [1, 16]"),
    ({"top_logprobs": 30, "logprobs": True}, "top_logprobs", "[0, 20]"),
    ({"functions": [{}]}, "functions", "use tools"), ({"function_call": "auto"}, "function_call", "use tool_choice"),
])
def test_unsupported_or_invalid_chat_fields_say_so(fields, param, words):
    with pytest.raises(InvalidRequestError, match=re.escape(words)) as info:
        api.check_chat_supported(chat(**fields))
    assert info.value.param == param


def test_harmless_values_of_unsupported_fields_pass():
    api.check_chat_supported(chat(n=1, logprobs=False, tools=[], tool_choice="none",
                                  response_format={"type": "text"}, logit_bias={}))


def test_logprobs_fields_map_to_the_number_of_alternatives():
    assert api.num_logprobs(chat()) is None
    assert api.num_logprobs(chat(logprobs=True)) == 0
    assert api.num_logprobs(chat(logprobs=True, top_logprobs=3)) == 3
    with pytest.raises(InvalidRequestError, match="top_logprobs needs logprobs: true"):
        api.num_logprobs(chat(top_logprobs=3))
    assert api.num_logprobs(CompletionRequest(prompt="x", logprobs=2)) == 2


@pytest.mark.parametrize("fields", [{"echo": True}, {"suffix": "x"}, {"best_of": 2}])
def test_unsupported_completion_fields_say_so(fields):
    with pytest.raises(InvalidRequestError, match="not supported yet"):
        api.check_completion_supported(CompletionRequest(prompt="x", **fields))


def feed(tokenizer, token_ids, stop=(), finish=("stop", None), per_chunk=1, **params):
    request = GenerateRequest("r", tuple(tokenizer.encode("Hi")), SamplingParams(stop=stop, max_tokens=500, **params))
    out = OutputText(tokenizer, request)
    deltas = []
    for start in range(0, len(token_ids), per_chunk):
        last = start + per_chunk >= len(token_ids)
        chunk = GenerateChunk(tuple(token_ids[start:start + per_chunk]), finish[0] if last else None,
                              finish[1] if last else None, 2, 0)
        deltas.append(out.add(chunk))
        if out.is_finished:
            break
    return out, deltas


def test_stop_string_is_cut_and_never_sent(tokenizer):
    ids = tokenizer.encode("one two three. four five")
    out, deltas = feed(tokenizer, ids, stop=(". four",))
    assert out.text == "".join(deltas) == "one two three"
    assert (out.finish_reason, out.stop_reason) == ("stop", ". four")
    assert out.num_output_tokens < len(ids)
    assert not any("." in d for d in deltas)


def test_held_back_tail_is_sent_at_the_end(tokenizer):
    ids = tokenizer.encode("ends with a dot.")
    out, deltas = feed(tokenizer, ids, stop=(".!",), finish=("length", None))
    assert "".join(deltas) == "ends with a dot."
    assert deltas[-1].endswith(".")  # held back until the request ended


def test_ending_token_is_counted_not_shown(tokenizer):
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode("hello")
    out, _ = feed(tokenizer, [*ids, eos])
    assert (out.text, out.num_output_tokens) == ("hello", len(ids) + 1)
    stop_id = tokenizer.encode(" world")[0]
    out, deltas = feed(tokenizer, [*ids, stop_id], finish=("stop", stop_id), stop_token_ids=(stop_id,))
    assert "".join(deltas) == "hello" and out.stop_reason == stop_id


def test_multibyte_characters_never_split(tokenizer):
    text = "emoji 😀👍🏽 and 你好，世界"
    out, deltas = feed(tokenizer, tokenizer.encode(text), finish=("length", None))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_abort_is_an_error(tokenizer):
    with pytest.raises(UnavailableError):
        feed(tokenizer, tokenizer.encode("hi"), finish=("abort", None))


def test_validation_errors_name_fields_not_pydantic_internals():
    def describe(body, model=ChatCompletionRequest):
        from pydantic import ValidationError
        with pytest.raises(ValidationError) as info:
            model.model_validate(body)
        return describe_validation_errors([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()])

    assert describe({}) == ("messages: Field required", "messages")
    assert describe({"messages": [{"role": "user", "content": [{"type": "audio"}]}]})[0].startswith(
        "messages[0].content[0].type: Input should be 'text' or 'image_url'")
    assert describe({"messages": [], "temperature": "hot"})[0].startswith("temperature: Input should be a valid number")
    assert describe({"prompt": 5}, CompletionRequest) == (
        "prompt: expected str or list[int] or list[str] or list[list[int]]", "prompt")
