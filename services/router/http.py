"""The router's HTTP front door: OpenAI- and Anthropic-compatible routes over a :class:`Backend`.

One module per protocol (openai_api / openai_models, anthropic_api, responses_api) turns its bodies
into a GenerateRequest plus a format object; this module is the shared core. Life of a request here::

    body (pydantic) -> checks, chat template, token ids (a worker thread) -> GenerateRequest, Format
        -> backend.generate() -> first chunk (errors before it are plain HTTP errors)
        -> JSON response, or SSE: the format's start events, text deltas, end events, terminator
           (OpenAI: role chunk, deltas, finish chunk, [usage chunk], [DONE]; Anthropic: message_start
           ... message_stop, no terminator)

The client going away is watched for the whole time; it cancels whatever is reading the backend
iterator and the iterator is closed, which is how the backend learns to cancel the request. The
iterator is closed on every other exit too (done, error, stop string matched here).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import ClassVar, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common import metrics
from services.common.errors import EPDError
from services.router import anthropic_api, responses_api
from services.router import openai_api as api
from services.router.anthropic_api import CountTokensRequest, MessagesFormat, MessagesRequest
from services.router.backend import Backend, GenerateRequest
from services.router.errors import ErrorBody, describe_validation_errors, error_body_for, error_of
from services.router.openai_models import (ChatCompletionRequest, ChatFormat, CompletionFormat,
                                           CompletionRequest)
from services.router.responses_api import ResponsesRequest

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0
"""A backend health check that takes longer counts as unhealthy: /health must never hang."""
CLIENT_CLOSED_STATUS = 499
"""nginx's "client closed request", used in metrics for requests the client abandoned."""

REQUESTS = metrics.counter("epd_router_requests", "HTTP generation requests by endpoint and final "
                           "status (499: the client went away)", ["endpoint", "status"])
TIME_TO_FIRST_TOKEN = metrics.histogram(
    "epd_router_time_to_first_token_seconds", "From request arrival to the first generated token",
    ["endpoint"], buckets=metrics.TTFT_BUCKETS_S)
E2E_LATENCY = metrics.histogram("epd_router_e2e_request_latency_seconds",
                                "From request arrival to the end of its response", ["endpoint"])
GENERATED_TOKENS = metrics.counter("epd_router_generation_tokens", "Tokens generated", ["endpoint"])
PROMPT_TOKENS = metrics.counter("epd_router_prompt_tokens", "Prompt tokens of admitted requests", ["endpoint"])
CACHED_PROMPT_TOKENS = metrics.counter(
    "epd_router_cached_prompt_tokens", "Prompt tokens served from the KV cache, counted when a request "
    "finishes (prefix hit rate: rate of this over rate of epd_router_prompt_tokens)", ["endpoint"])
INTER_TOKEN_LATENCY = metrics.histogram(
    "epd_router_inter_token_latency_seconds", "Time between output tokens after the first (a chunk of k "
    "tokens after a gap g counts as k tokens g/k apart)", ["endpoint"], buckets=metrics.INTER_TOKEN_BUCKETS_S)


"""A protocol's error body: ``(status, message, param=None, code=None) -> dict``."""
Event = tuple[str | None, dict]
"""One SSE event: its name (None: a data-only event, as OpenAI sends them) and its JSON data."""


class Format(Protocol):
    """How one request's output goes on the wire (openai_models.ChatFormat, anthropic_api.MessagesFormat, ...)."""

    terminator: ClassVar[bytes]
    """Sent after the last event, after an error event too (OpenAI's ``data: [DONE]``); b"": none."""

    def response(self, out: api.OutputText) -> dict: ...
    def start_events(self, out: api.OutputText) -> list[Event]: ...
    def text_event(self, text: str) -> Event: ...
    def end_events(self, out: api.OutputText) -> list[Event]: ...
    def error_event(self, body: dict) -> Event: ...


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


class RequestTimer:
    """One request's metrics, recorded once whichever way it ends."""

    def __init__(self, endpoint: str, error_body: ErrorBody = api.error_body) -> None:
        self.endpoint = endpoint
        self.error_body = error_body
        self.start = time.perf_counter()
        self.has_first_token = False
        self.last_token_at = self.start
        self.is_done = False

    def tokens(self, num_tokens: int) -> None:
        """``num_tokens`` arrived together. Spread evenly over the gap since the last ones, so
        the inter-token histogram gets one sample per token and its count stays comparable with
        the generated tokens. Tokens riding with the first have no gap of their own: no sample."""
        GENERATED_TOKENS.labels(self.endpoint).inc(num_tokens)
        if not num_tokens:
            return
        now = time.perf_counter()
        if not self.has_first_token:
            self.has_first_token = True
            TIME_TO_FIRST_TOKEN.labels(self.endpoint).observe(now - self.start)
        else:
            inter_token, gap_s = INTER_TOKEN_LATENCY.labels(self.endpoint), now - self.last_token_at
            for _ in range(num_tokens):
                inter_token.observe(gap_s / num_tokens)
        self.last_token_at = now

    def cached_tokens(self, num_cached_tokens: int) -> None:
        """The finished request's usage: how many of its prompt tokens the KV cache served."""
        CACHED_PROMPT_TOKENS.labels(self.endpoint).inc(num_cached_tokens)

    def done(self, status: int) -> None:
        if not self.is_done:
            self.is_done = True
            REQUESTS.labels(self.endpoint, str(status)).inc()
            E2E_LATENCY.labels(self.endpoint).observe(time.perf_counter() - self.start)

    def error(self, exc: BaseException) -> JSONResponse:
        status, body = error_of(exc, self.error_body)
        self.done(status)
        return JSONResponse(body, status_code=status)


async def _wait_for_disconnect(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Callable, work: Awaitable) -> object:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()
        watcher.cancel()
        await asyncio.wait((task, watcher))
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def close(chunks: AsyncIterator) -> None:
    """Closing the backend iterator is how the backend learns to cancel (see backend.py)."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


class EventStreamResponse(StreamingResponse):
    """SSE whose body generator is cancelled once and closed as soon as the client disconnects.

    Starlette's StreamingResponse does not fit: under ASGI spec 2.4 servers it notices a disconnect
    only at the next send (for a stalled backend, never), and otherwise it cancels through an anyio
    scope that keeps cancelling every await, so the backend's own cleanup (cancel RPCs, lease
    releases) would be cut short. A plain ``Task.cancel()`` lets that cleanup run.
    """

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        sending = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait((sending, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sending.cancel()
            watcher.cancel()
            await asyncio.wait((sending, watcher))
            await self.body_iterator.aclose()  # a generator parked at a yield is closed here
        if not sending.cancelled() and sending.exception() is not None:
            raise sending.exception()

    async def _send_all(self, send) -> None:
        try:
            await self.stream_response(send)
        except OSError:  # the client went away mid-send; the generator is closed by the caller
            pass


def _sse(event: Event) -> bytes:
    name, data = event
    head = b"" if name is None else b"event: " + name.encode() + b"\n"
    return head + b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _Generation:
    """Runs one GenerateRequest against the backend and shapes the result for one endpoint."""

    def __init__(self, backend: Backend, request: GenerateRequest, fmt: Format, timer: RequestTimer) -> None:
        self.out = api.OutputText(backend.tokenizer, request)
        self.chunks = aiter(backend.generate(request))
        self.fmt = fmt
        self.timer = timer

    async def next_text(self) -> str:
        """Read one chunk; the text it made safe to send."""
        try:
            chunk = await anext(self.chunks)
        except StopAsyncIteration:
            raise RuntimeError("the backend's stream ended without a finish_reason") from None
        num_before = self.out.num_output_tokens
        text = self.out.add(chunk)
        self.timer.tokens(self.out.num_output_tokens - num_before)
        if self.out.is_finished:
            self.timer.cached_tokens(self.out.num_cached_tokens)
        return text

    async def read_all(self) -> None:
        while not self.out.is_finished:
            await self.next_text()

    def response(self) -> JSONResponse:
        self.timer.done(200)
        return JSONResponse(self.fmt.response(self.out))

    async def events(self, first_text: str) -> AsyncGenerator[bytes, None]:
        status = CLIENT_CLOSED_STATUS  # unless the stream reaches its end
        try:
            for event in self.fmt.start_events(self.out):
                yield _sse(event)
            text = first_text
            while True:
                if text:
                    yield _sse(self.fmt.text_event(text))
                if self.out.is_finished:
                    break
                text = await self.next_text()
            for event in self.fmt.end_events(self.out):
                yield _sse(event)
            status = 200
        except Exception as exc:  # noqa: BLE001 - after the headers, an error is an SSE event
            status, body = error_of(exc, self.timer.error_body)
            yield _sse(self.fmt.error_event(body))
        finally:
            await close(self.chunks)
            self.timer.done(status)
        if self.fmt.terminator:
            yield self.fmt.terminator


class Routes:
    """Every protocol's routes over one backend."""

    def __init__(self, backend: Backend, served_model_names: list[str] | None) -> None:
        self.backend = backend
        self.model_names = list(dict.fromkeys([*(served_model_names or ()), backend.model_name]))

    def _openai_format(self, format_cls, request: GenerateRequest, body) -> Format:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return format_cls(request.request_id, body.model or self.backend.model_name, int(time.time()),
                          include_usage, body.return_token_ids)

    def _chat_request(self, body: ChatCompletionRequest) -> tuple[GenerateRequest, Format]:
        api.check_model(body.model, self.model_names)
        api.check_chat_supported(body)
        api.requested_max_tokens(body)
        prompt = api.chat_prompt(body.messages, self.backend.tokenizer, self.backend.image_token_id)
        params = api.sampling_params(body, len(prompt.token_ids), self.backend.max_model_len, "messages")
        request = api.generate_request(f"chatcmpl-{uuid.uuid4().hex}", prompt, params, body, "chat")
        return request, self._openai_format(ChatFormat, request, body)

    def _completion_request(self, body: CompletionRequest) -> tuple[GenerateRequest, Format]:
        api.check_model(body.model, self.model_names)
        api.check_completion_supported(body)
        api.requested_max_tokens(body)
        prompt = api.completion_prompt(body.prompt, self.backend.tokenizer)
        params = api.sampling_params(body, len(prompt.token_ids), self.backend.max_model_len, "prompt")
        request = api.generate_request(f"cmpl-{uuid.uuid4().hex}", prompt, params, body, "agent")
        return request, self._openai_format(CompletionFormat, request, body)

    def _messages_request(self, body: MessagesRequest) -> tuple[GenerateRequest, Format]:
        request = anthropic_api.messages_request(body, self.backend, self.model_names)
        return request, MessagesFormat(request.request_id, body.model)

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        return await self._serve(request, body, self._chat_request, RequestTimer("/v1/chat/completions"))

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        return await self._serve(request, body, self._completion_request, RequestTimer("/v1/completions"))

    async def messages(self, request: Request, body: MessagesRequest) -> Response:
        timer = RequestTimer("/v1/messages", anthropic_api.error_body)
        return await self._serve(request, body, self._messages_request, timer)

    async def responses(self, request: Request, body: ResponsesRequest) -> Response:
        build = functools.partial(responses_api.build, backend=self.backend, model_names=self.model_names)
        return await self._serve(request, body, build, RequestTimer("/v1/responses"))

    async def count_tokens(self, body: CountTokensRequest) -> Response:
        """Anthropic's ``/v1/messages/count_tokens``: the templated prompt's length, nothing generated."""
        try:
            prompt = await run_in_threadpool(anthropic_api.prompt, body, self.backend, self.model_names)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an Anthropic error body
            status, error = error_of(exc, anthropic_api.error_body)
            return JSONResponse(error, status_code=status)
        return JSONResponse({"input_tokens": len(prompt.token_ids)})

    async def _serve(self, request: Request, body, build: Callable, timer: RequestTimer) -> Response:
        try:
            # Templates and tokenizing are CPU work: off the event loop, which streams for everyone.
            generate_request, fmt = await run_in_threadpool(build, body)
        except Exception as exc:  # noqa: BLE001 - EPDError: the client's fault; else logged as a bug
            return timer.error(exc)
        PROMPT_TOKENS.labels(timer.endpoint).inc(len(generate_request.prompt_token_ids))
        generation = None
        try:
            generation = _Generation(self.backend, generate_request, fmt, timer)
            reading = generation.next_text() if body.stream else generation.read_all()
            # Streams read the first chunk before the headers, so early failures get real statuses.
            first_text = await unless_disconnected(request.receive, reading)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the protocol's error body
            if generation is not None:
                await close(generation.chunks)
            if isinstance(exc, ClientGone):
                timer.done(CLIENT_CLOSED_STATUS)
                return Response(status_code=CLIENT_CLOSED_STATUS)
            return timer.error(exc)
        if not body.stream:
            await close(generation.chunks)
            return generation.response()
        return EventStreamResponse(generation.events(first_text))

    async def models(self) -> dict:
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "epd",
             "max_model_len": self.backend.max_model_len} for name in self.model_names]}

    async def health(self) -> Response:
        try:
            is_healthy = await asyncio.wait_for(self.backend.is_healthy(), HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a failing check is an unhealthy backend
            logger.warning("backend health check failed", exc_info=True)
            is_healthy = False
        return JSONResponse({"status": "ok" if is_healthy else "unavailable"},
                            status_code=200 if is_healthy else 503)


def metrics_text() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def create_app(backend: Backend, served_model_names: list[str] | None = None) -> FastAPI:
    """The ASGI app over ``backend`` (openai_api.py, responses_api.py, anthropic_api.py: what it accepts)."""
    app = FastAPI(title="epd router", summary="OpenAI- and Anthropic-compatible front door of the epd cluster")
    routes = Routes(backend, served_model_names)
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"], response_model=None)
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"], response_model=None)
    app.add_api_route("/v1/responses", routes.responses, methods=["POST"], response_model=None)
    app.add_api_route("/v1/messages", routes.messages, methods=["POST"], response_model=None)
    app.add_api_route("/v1/messages/count_tokens", routes.count_tokens, methods=["POST"], response_model=None)
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"], response_model=None)
    app.add_api_route("/metrics", metrics_text, methods=["GET"], response_model=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        REQUESTS.labels(request.url.path, "400").inc()
        return JSONResponse(error_body_for(request.url.path)(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = error_body_for(request.url.path)(exc.status_code, str(exc.detail))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(EPDError)
    async def _epd_error(request: Request, exc: EPDError) -> JSONResponse:
        status, body = error_of(exc, error_body_for(request.url.path))
        return JSONResponse(body, status_code=status)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        status, body = error_of(exc, error_body_for(request.url.path))
        return JSONResponse(body, status_code=status)

    return app
