"""What a request body may hold, checked before anything is built from it (STYLE rule 17).

Three passes, each cheap next to what it prevents:

* the raw bytes, before FastAPI parses them (:class:`CheckedRoute`): at most ``MAX_JSON_CONTAINERS``
  objects and arrays and ``MAX_JSON_VALUES`` values. Parsing makes ~25 bytes of Python objects per
  byte of ``[{},{},...]`` and pydantic ~1 KB per bad item, so a 15 MB body of empty messages once
  cost 29 s and 5.7 GB;
* the parsed body, before pydantic builds the request model (:func:`check_json_text`, a model
  validator of every request body): at most ``MAX_JSON_DEPTH`` levels deep (deeper schemas overflow
  the grammar and schema checkers), and every string, keys included, valid Unicode: JSON can spell
  lone surrogates (``"\\ud800"``), which no tokenizer, protobuf or UTF-8 encoder takes;
* the sampling fields, before the prompt is built (:func:`check_ranges`, every protocol): each
  integer that reaches the wire within its proto type (a seed past int64 once failed the proto
  conversion, a 500), ``temperature`` within the protocol's documented range (OpenAI's [0, 2],
  Anthropic's [0, 1]), at most ``MAX_STOP_STRINGS`` stop strings (the OpenAI endpoints allow
  fewer: openai_api.MAX_STOP) and ``MAX_STOP_TOKEN_IDS`` stop ids. The other floats' ranges
  (``top_p`` in (0, 1], the penalties in [-2, 2], ...) are SamplingParams' own checks.

A prompt that cannot fit the context is refused before it is tokenized (prompts.check_fits).

Each refusal is a 400 naming the field (``messages[0].content``) in the path's protocol.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from services.common.errors import invalid
from services.common.sampling_params import INT32_MAX, INT64_MAX, INT64_MIN

MAX_JSON_CONTAINERS = 50_000
"""Objects and arrays in one body: thousands of messages, tools and schema nodes fit."""
MAX_JSON_VALUES = 262_144
"""Values (array items and object members) in one body: a token-id prompt of a 256K context fits."""
MAX_JSON_DEPTH = 64
"""Nesting levels: a JSON schema in ``tools`` may nest ~30 objects deep."""
MAX_STOP_STRINGS = 64
"""Each is searched for after every token, in the engine and in the router: their number is a cost."""
MAX_TEMPERATURE = 2.0
"""OpenAI's documented range is [0, 2] (chat, completions, Responses); Anthropic's is [0, 1]."""
MAX_STOP_TOKEN_IDS = 1024
"""Suppressed in every step until min_tokens: a vocabulary's worth would be a cost per step."""
_INLINE_BYTES = 64 * 1024
"""Smaller bodies are counted on the event loop; larger ones in a worker thread."""
_CHUNK_BYTES = 1 << 20
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_json_size(body: bytes, where: str = "the request body", param: str | None = None) -> None:
    """Refuse JSON with more containers or values than the limits, before it is parsed. Counting
    raw brackets and commas over-counts those inside strings: only when that count is over a limit
    is it made exact."""
    num_containers = body.count(b"{") + body.count(b"[")
    num_values = num_containers + body.count(b",")
    if num_containers <= MAX_JSON_CONTAINERS and num_values <= MAX_JSON_VALUES:
        return
    num_containers, num_commas = _count_outside_strings(body)
    if num_containers > MAX_JSON_CONTAINERS:
        raise invalid(f"{where} has {num_containers} JSON objects and arrays; at most {MAX_JSON_CONTAINERS} "
                      f"are accepted", param)
    if num_containers + num_commas > MAX_JSON_VALUES:
        raise invalid(f"{where} has about {num_containers + num_commas} JSON values; at most {MAX_JSON_VALUES} "
                      f"are accepted", param)


def _count_outside_strings(body: bytes) -> tuple[int, int]:
    """The brackets ({ and [) and commas of ``body`` outside its strings, in linear time and a
    bounded number of bytes per chunk (no regex: one that can fail rescans the rest from every
    quote, and one match object per string is ~170 bytes).

    Escapes are blanked first (backslash pairs, then escaped quotes: a run of backslashes pairs
    up from its left end, as JSON reads it); then every quote opens or closes a string::

        {"a": "x\\"{", "b": [1]}     the body: an escaped quote and a brace inside a string
        {"a": "x__{", "b": [1]}       escapes blanked
        01100011111000110000000       quotes xor-accumulated: 1 inside a string (or its opening quote)
    """
    body = body.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    num_containers = num_commas = 0
    parity = np.uint8(0)  # whether the chunk starts inside a string
    for start in range(0, len(body), _CHUNK_BYTES):
        chunk = np.frombuffer(body, np.uint8, count=min(_CHUNK_BYTES, len(body) - start), offset=start)
        inside = np.bitwise_xor.accumulate((chunk == ord('"')).view(np.uint8)) ^ parity
        outside = inside == 0
        num_containers += int(np.count_nonzero(((chunk == ord("{")) | (chunk == ord("["))) & outside))
        num_commas += int(np.count_nonzero((chunk == ord(",")) & outside))
        parity = inside[-1]
    return num_containers, num_commas


def parse_json_text(text: str, param: str, what: str | None = None) -> Any:
    """JSON text inside a body (a schema, a call's arguments), parsed under the body's limits;
    InvalidRequestError naming ``param`` (``what``: the message's name for it) if it is not valid
    JSON or breaks a limit."""
    what = what or param
    check_json_size(text.encode("utf-8", "surrogatepass"), what, param)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise invalid(f"{what} is not valid JSON: {exc}", param) from None
    return check_json_text(value, (param,))


class CheckedRoute(APIRoute):
    """A route whose request body passes :func:`check_json_size` before FastAPI parses it."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if request.method == "POST":
                body = await request.body()  # kept by the request: FastAPI's parse reads it from there
                if len(body) <= _INLINE_BYTES:
                    check_json_size(body)
                else:
                    await run_in_threadpool(check_json_size, body)
            return await handler(request)
        return checked


def _path(parts: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(parts))


def _check_text(text: str, parts: tuple, key: str | None = None) -> None:
    """``text`` (a value at ``parts``, or one of its keys) has no lone surrogate."""
    if text.isascii() or (match := _SURROGATE.search(text)) is None:
        return
    param = _path(parts) or None
    subject = (param or "the body") if key is None else f"the key {key!r} in {param or 'the body'}"
    raise invalid(f"{subject} is not valid Unicode: it holds a lone surrogate (U+{ord(match.group()):04X}) at "
                  f"character {match.start()}; JSON's \\ud800-\\udfff escapes are valid only as pairs", param)


def check_json_text(data: Any, root: tuple = ()) -> Any:
    """``data`` (a parsed body, or JSON found at ``root`` in one) unchanged, if no more than
    MAX_JSON_DEPTH deep and every string in it is valid Unicode; else InvalidRequestError naming
    the field."""
    stack: list[tuple[Any, tuple]] = [(data, root)]
    while stack:
        value, parts = stack.pop()
        if len(parts) > MAX_JSON_DEPTH:
            raise invalid(f"{_path(parts)}: the body nests more than {MAX_JSON_DEPTH} levels deep", _path(parts))
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str):
                    _check_text(key, parts, key)
                if isinstance(item, str):
                    _check_text(item, (*parts, key))
                elif isinstance(item, (dict, list)):
                    stack.append((item, (*parts, key)))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, str):
                    _check_text(item, (*parts, i))
                elif isinstance(item, (dict, list)):
                    stack.append((item, (*parts, i)))
        elif isinstance(value, str):
            _check_text(value, parts)
    return data


def _check_range(value: int | None, name: str, low: int, high: int) -> None:
    if value is not None and not low <= value <= high:
        raise invalid(f"{name}={value} is invalid: must be an integer in [{low}, {high}]", name)


def _check_number(value: float | None, name: str, low: float, high: float) -> None:
    if value is not None and not low <= value <= high:  # NaN fails too
        raise invalid(f"{name}={value:g} is invalid: must be a number in [{low:g}, {high:g}]", name)


class RangedFields(Protocol):
    """What :func:`check_ranges` reads: every protocol's sampling fields (openai_models.SamplingFields)."""

    temperature: float | None
    seed: int | None
    n: int | None
    top_k: int | None
    min_tokens: int
    num_speculative_tokens: int | None
    stop_token_ids: list[int] | None
    stop: str | list[str] | None


def check_ranges(body: RangedFields, max_temperature: float = MAX_TEMPERATURE) -> None:
    """Every integer that reaches the wire (proto int32 / int64), ``temperature`` in [0,
    ``max_temperature``] (the protocol's), and every list whose length is a cost, checked before
    any work: out of range is a 400 naming the field, never a failed conversion later. (n,
    logprobs, max_tokens and OpenAI's stop count have their own checks.)"""
    _check_number(body.temperature, "temperature", 0, max_temperature)
    _check_range(body.seed, "seed", INT64_MIN, INT64_MAX)
    if body.seed is not None and body.n and body.seed + body.n - 1 > INT64_MAX:
        raise invalid(f"seed={body.seed} is invalid with n={body.n}: the choices are seeded seed, seed + 1, ..., "
                      f"seed + {body.n - 1}, and each must be at most {INT64_MAX}", "seed")
    _check_range(body.top_k, "top_k", -1, INT32_MAX)
    _check_range(body.min_tokens, "min_tokens", 0, INT32_MAX)
    _check_range(body.num_speculative_tokens, "num_speculative_tokens", 0, INT32_MAX)
    stop_token_ids = body.stop_token_ids or ()
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"stop_token_ids has {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are accepted",
                      "stop_token_ids")
    for i, token_id in enumerate(stop_token_ids):
        _check_range(token_id, f"stop_token_ids[{i}]", 0, INT32_MAX)
    if isinstance(body.stop, list) and len(body.stop) > MAX_STOP_STRINGS:
        raise invalid(f"stop has {len(body.stop)} strings; at most {MAX_STOP_STRINGS} are accepted", "stop")
