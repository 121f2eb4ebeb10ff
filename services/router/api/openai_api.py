"""OpenAI protocol <-> GenerateRequest / GenerateChunk: the pure core behind the HTTP routes.

Supported (``POST /v1/chat/completions`` and ``POST /v1/completions``):

* ``model``: the backend's model name or any ``--served-model-name``; omitted means the backend's
  model; anything else is a 404. ``GET /v1/models`` lists these names, ``GET /v1/models/{model}``
  answers one of them in the same shape (an SDK's ``models.retrieve``), any other with that 404.
* Chat ``messages``: roles ``system``, ``user``, ``assistant`` (with ``tool_calls``), ``tool`` (a
  call's result) and ``developer`` (rendered as ``system``); any other role is a 400 naming it. ``content`` is a string, null,
  or a list of parts: ``{"type": "text", "text": ...}`` and, for a model that takes images,
  ``{"type": "image_url", "image_url": {"url": "data:image/<fmt>;base64,..."}}`` (data URIs only;
  the router fetches nothing). Parts are joined with "\\n" (as vLLM does); each image becomes one
  placeholder token that the encoder side expands. The prompt is the tokenizer's chat template
  with the generation prompt, encoded with special tokens spelled in it mapped to their ids
  (services/router/api/prompts.py, which every protocol's prompt goes through).
* Completions ``prompt``: a string (encoded with the tokenizer's special tokens added, as
  Hugging Face and vLLM do) or a list of token ids; a list of exactly one of either is accepted.
* Sampling, in OpenAI's documented ranges: ``temperature`` (0 to 2), ``top_p`` (above 0, at most 1),
  ``seed``, ``stop`` (a string or a list of at most 4), ``presence_penalty`` and ``frequency_penalty``
  (-2 to 2), ``max_tokens`` (chat also ``max_completion_tokens``, which wins), and the
  vLLM-style extensions ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
  ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``num_speculative_tokens`` (the
  request's cap on draft tokens a step; 0: none). ``max_tokens`` defaults, as OpenAI's
  do, to the rest of the context (``max_model_len - prompt tokens``) for chat and to 16 (or the
  rest of the context, if less) for completions.
* ``logit_bias``: ``{"token id": bias}``, at most 300 ids of the vocabulary, biases in [-100, 100],
  added to the logits after any grammar mask (services/engine/sampler.py); logprobs stay those of
  the raw logits.
* ``stream``, with ``stream_options.include_usage``; ``n`` (1 to 16 choices, one engine request
  each, seeded ones with ``seed + i``); ``user`` (ignored). Every object and chunk carries a
  ``system_fingerprint`` (:func:`system_fingerprint`).
* Logprobs: chat ``logprobs`` / ``top_logprobs`` (0 to 20), completions ``logprobs`` (0 to 20), of
  the raw logits; the first token's come from the prefill instance, the rest from decode.
* Output constraints (services/router/api/structured.py, tools.py): ``response_format`` (``json_object``,
  ``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``grammar``, ``choice``,
  ``json_object``), and chat ``tools`` with ``tool_choice`` ``none`` / ``auto`` / ``required`` / a
  named function; one constraint per request.
* ``finish_reason`` is ``stop`` for EOS, a stop string or a stop token id (none of which appear in
  the text), ``length`` for ``max_tokens`` or the end of the context, ``tool_calls`` when the
  output is calls.

Not supported, rejected with a 400 that says so: ``echo: true``, ``suffix``, ``best_of`` > 1, several
prompts in one completions request, and the deprecated ``functions`` / ``function_call``. Image
parts for a model that takes none (no encoder serves it) are a 400 naming the part. Fields the API
does not define are ignored.

Errors use OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``: 400 for any bad
input (malformed JSON and schema errors included, with the field named), 404 for an unknown model,
503 when the backend aborts a request, 500 for bugs. A prompt that does not fit the context is a
400 with code ``context_length_exceeded`` that gives the numbers; one whose length alone shows it
cannot fit is refused before it is tokenized ("the prompt is at least N tokens": no token spans
more than the vocabulary's longest entry, services/common/token_bound.py). Integers are checked
against the wire's int32 / int64 and strings for lone surrogates before any work
(services/router/api/body_checks.py).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import math
import re
import time
import uuid

from services.common.errors import ModelNotFoundError, PromptTooLongError, invalid
from services.common.sampling_params import MAX_LOGIT_BIAS, SamplingParams, StructuredOutput
from services.router.api import structured
from services.router.api.body_checks import check_ranges
from services.router.api.generation import Format
from services.router.api.openai_formats import ChatFormat, CompletionFormat
from services.router.api.openai_models import ChatCompletionRequest, CompletionRequest, SamplingFields
from services.router.api.prompts import Prompt, chat_prompt, completion_prompt, prompt_too_long
from services.router.api.tools import openai_plan
from services.router.cluster.backend import Backend, GenerateRequest
from services.router.errors import openai_error_body

error_body = openai_error_body
"""The protocol's error format: one of its two entry points (with build_chat / build_completion)."""
MAX_CHOICES = 16
COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for completions (chat's is the rest of the context)."""
MAX_LOGIT_BIAS_TOKENS = 300
"""Most ids one ``logit_bias`` may name (OpenAI's limit): each is an edit of every step's logits."""
MAX_STOP = 4
"""Most ``stop`` sequences one request may give (OpenAI's limit; Anthropic's ``stop_sequences``
may hold up to body_checks.MAX_STOP_STRINGS)."""
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


@functools.cache
def system_fingerprint(model_name: str) -> str:
    """``system_fingerprint`` of every chat / completion object: the same for every request to one
    deployment (the model and the epd version), different when either changes, as OpenAI's is
    for its backend configuration."""
    try:
        version = importlib.metadata.version("epd-serve")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        version = "unknown"
    return "fp_" + hashlib.sha256(f"{model_name}\0{version}".encode()).hexdigest()[:10]


def check_model(requested: str | None, accepted: list[str]) -> None:
    if requested is not None and requested not in accepted:
        raise invalid(f"model {requested!r} does not exist; this server serves {accepted}",
                      "model", "model_not_found", ModelNotFoundError)


def _reject_unsupported(body: SamplingFields) -> None:
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise invalid(f"n={body.n} is invalid: must be in [1, {MAX_CHOICES}]", "n")
    if isinstance(body.stop, list) and len(body.stop) > MAX_STOP:
        raise invalid(f"stop has {len(body.stop)} strings; at most {MAX_STOP} are accepted", "stop")
    check_ranges(body)


def check_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """``logit_bias`` as SamplingParams takes it: ids of the vocabulary (JSON spells them as
    strings), at most MAX_LOGIT_BIAS_TOKENS of them, biases in [-100, 100]."""
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise invalid(f"logit_bias names {len(bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS} are accepted",
                      "logit_bias")
    checked = {}
    for key, value in bias.items():
        if _TOKEN_ID.fullmatch(key) is None or not int(key) < vocab_size:
            raise invalid(f"logit_bias: {key!r} is not a token id of this model's vocabulary "
                          f"(integers in [0, {vocab_size}), written as strings)", "logit_bias")
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise invalid(f"logit_bias: the bias of token {key} is {value}; it must be a number in "
                          f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", "logit_bias")
        checked[int(key)] = value
    return checked


def num_logprobs(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """SamplingParams.logprobs: None, or how many alternatives each token reports."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def check_chat_supported(body: ChatCompletionRequest) -> None:
    _reject_unsupported(body)
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise invalid(f"top_logprobs={body.top_logprobs} is invalid: must be in [0, 20]", "top_logprobs")
    if body.functions:
        raise invalid("functions are not supported (deprecated by OpenAI): use tools", "functions")
    if body.function_call not in (None, "none"):
        raise invalid("function_call is not supported (deprecated by OpenAI): use tool_choice", "function_call")


def check_completion_supported(body: CompletionRequest) -> None:
    _reject_unsupported(body)
    if body.logprobs is not None and not 0 <= body.logprobs <= 20:
        raise invalid(f"logprobs={body.logprobs} is invalid: must be in [0, 20]", "logprobs")
    if body.echo:
        raise invalid("echo is not supported yet", "echo")
    if body.suffix:
        raise invalid("suffix is not supported yet", "suffix")
    if body.best_of is not None and body.best_of != 1:
        raise invalid(f"best_of={body.best_of} is not supported yet: only 1", "best_of")


def requested_max_tokens(body: SamplingFields) -> tuple[int | None, str]:
    """The requested output budget and the field it came from; checked before the prompt is built."""
    value, name = body.max_tokens, "max_tokens"
    if getattr(body, "max_completion_tokens", None) is not None:
        value, name = body.max_completion_tokens, "max_completion_tokens"
    if value is not None and value < 1:
        raise invalid(f"{name}={value} is invalid: must be an integer >= 1", name)
    return value, name


def sampling_params(body: SamplingFields, num_prompt_tokens: int, max_model_len: int,
                    prompt_param: str, logprobs: int | None = None,
                    structured: StructuredOutput | None = None, default_max_tokens: int | None = None,
                    logit_bias: dict[int, float] | None = None) -> SamplingParams:
    """``default_max_tokens``: the output budget when the body sets none (None: the rest of the
    context; never more than that); ``logit_bias``: checked by :func:`check_logit_bias`."""
    max_tokens, max_tokens_param = requested_max_tokens(body)
    check_ranges(body)
    if num_prompt_tokens >= max_model_len:
        raise prompt_too_long(num_prompt_tokens, max_model_len, prompt_param)
    room = max_model_len - num_prompt_tokens
    if max_tokens is not None and max_tokens > room:
        raise invalid(f"{max_tokens_param}={max_tokens} plus the prompt's {num_prompt_tokens} tokens "
                      f"is {max_tokens + num_prompt_tokens} tokens, more than this model's context of "
                      f"{max_model_len}; ask for at most {room}",
                      max_tokens_param, "context_length_exceeded", PromptTooLongError)
    optional = {name: getattr(body, name) for name in
                ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "num_speculative_tokens")
                if getattr(body, name) is not None}
    if max_tokens is None:
        # A default below min_tokens would refuse a request that set no max_tokens: min_tokens wins.
        max_tokens = room if default_max_tokens is None else min(max(default_max_tokens, body.min_tokens), room)
    return SamplingParams(
        max_tokens=max_tokens, stop=body.stop or (),
        stop_token_ids=tuple(body.stop_token_ids or ()), min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos, skip_special_tokens=body.skip_special_tokens, logprobs=logprobs,
        structured=structured, logit_bias=logit_bias or (), **optional)


def generate_request(request_id: str, prompt: Prompt, params: SamplingParams, body: SamplingFields,
                     default_class: str) -> GenerateRequest:
    """``default_class``: the protocol's request class when the body names none."""
    return GenerateRequest(request_id, prompt.token_ids, params, prompt.images, prompt.image_positions,
                           cache_salt=body.cache_salt or "", request_class=body.kv_retention or default_class)


# ----- the protocol's entry points (services/router/api/app.py routes to them) -----------------
def build_chat(body: ChatCompletionRequest, backend: Backend, model_names: list[str]) -> tuple[GenerateRequest, Format]:
    """A chat completions body's GenerateRequest and the format that answers it (runs off the
    event loop: the chat template and tokenizing are CPU work)."""
    check_model(body.model, model_names)
    check_chat_supported(body)
    requested_max_tokens(body)
    logit_bias = check_logit_bias(body.logit_bias, backend.tokenizer.vocab_size)
    tools = openai_plan(body.tools, body.tool_choice)
    constraint = structured.pick(("tools", tools and tools.structured()),
                                 ("response_format", structured.from_response_format(body.response_format)),
                                 ("structured_outputs", structured.from_extension(body.structured_outputs)))
    prompt = chat_prompt(body.messages, backend.tokenizer, backend.image_token_id, tools, backend.max_model_len)
    params = sampling_params(body, len(prompt.token_ids), backend.max_model_len, "messages", num_logprobs(body),
                             constraint, logit_bias=logit_bias)
    request = generate_request(f"chatcmpl-{uuid.uuid4().hex}", prompt, params, body, "chat")
    return request, _format(ChatFormat, request, body, backend, tools=tools)


def build_completion(body: CompletionRequest, backend: Backend,
                     model_names: list[str]) -> tuple[GenerateRequest, Format]:
    """A completions body's GenerateRequest and the format that answers it."""
    check_model(body.model, model_names)
    check_completion_supported(body)
    requested_max_tokens(body)
    logit_bias = check_logit_bias(body.logit_bias, backend.tokenizer.vocab_size)
    constraint = structured.pick(("response_format", structured.from_response_format(body.response_format)),
                                 ("structured_outputs", structured.from_extension(body.structured_outputs)))
    prompt = completion_prompt(body.prompt, backend.tokenizer, backend.max_model_len)
    params = sampling_params(body, len(prompt.token_ids), backend.max_model_len, "prompt", num_logprobs(body),
                             constraint, COMPLETION_DEFAULT_MAX_TOKENS, logit_bias)
    request = generate_request(f"cmpl-{uuid.uuid4().hex}", prompt, params, body, "agent")
    return request, _format(CompletionFormat, request, body, backend)


def _format(format_cls, request: GenerateRequest, body: SamplingFields, backend: Backend, **extra) -> Format:
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return format_cls(request.request_id, body.model or backend.model_name, int(time.time()), include_usage,
                      body.return_token_ids, body.n or 1, request.params.logprobs is not None,
                      system_fingerprint(backend.model_name), **extra)
