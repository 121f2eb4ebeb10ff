"""The router's HTTP front door: OpenAI-compatible routes over a :class:`Backend`.

Life of a request here::

    body (pydantic) -> checks, chat template, token ids (a worker thread) -> GenerateRequest
        -> backend.generate() -> first chunk (errors before it are plain HTTP errors)
        -> JSON response, or SSE: role chunk, text deltas, finish chunk, [usage chunk], [DONE]

The client going away is watched for the whole time; it cancels whatever is reading the backend
iterator and the iterator is closed, which is how the backend learns to cancel the request. The
iterator is closed on every other exit too (done, error, stop string matched here).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common import metrics
from services.common.errors import EPDError
from services.router import openai_api as api
from services.router.backend import Backend, GenerateRequest
from services.router.openai_models import (ChatCompletionRequest, ChatFormat, CompletionFormat,
                                           CompletionRequest)

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


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


class RequestTimer:
    """One request's metrics, recorded once whichever way it ends."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
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
        status, body = error_of(exc)
        self.done(status)
        return JSONResponse(body, status_code=status)


def error_of(exc: BaseException) -> tuple[int, dict]:
    """HTTP status and OpenAI error body for any exception; unexpected ones are logged."""
    if isinstance(exc, EPDError):
        return exc.http_status, api.epd_error_body(exc)
    logger.error("request failed", exc_info=exc)
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return 503, api.error_body(503, f"the backend is unavailable: {exc}")
    return 500, api.error_body(500, f"internal error: {type(exc).__name__}")


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """One message naming each bad field; pydantic's union-branch tags are folded into
    "expected A or B" so the client sees its own field names only."""
    groups: dict[str, list[tuple[list, int, dict]]] = {}
    for error in errors:
        loc = list(error["loc"])[1:] if error["loc"][:1] == ("body",) else list(error["loc"])
        if error["type"] == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "")
            return f"the request body is not valid JSON: {reason}", None
        tag_at = next((i for i, p in enumerate(loc) if isinstance(p, str) and _is_union_tag(p)), len(loc))
        groups.setdefault(_path(loc[:tag_at]), []).append((loc, tag_at, error))
    messages = []
    for field, members in groups.items():
        deepest = max(len(loc) for loc, _, _ in members)
        kept = [(loc, tag_at, error) for loc, tag_at, error in members if len(loc) == deepest]
        if len(kept) > 1 and all(tag_at < len(loc) for loc, tag_at, _ in kept):
            expected = " or ".join(dict.fromkeys(loc[tag_at] for loc, tag_at, _ in kept))
            messages.append(f"{field}: expected {expected}")
            continue
        loc, _, error = kept[0]
        path = _path([p for p in loc if not (isinstance(p, str) and _is_union_tag(p))])
        if not path:
            messages.append("the request body must be a JSON object (send Content-Type: application/json)")
        else:
            messages.append(f"{path}: {error['msg']}")
    first = next(iter(groups), None)
    return "; ".join(messages), first or None


def _is_union_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "dict", "list")


def _path(loc: list) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))


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


def _sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _Generation:
    """Runs one GenerateRequest against the backend and shapes the result for one endpoint."""

    def __init__(self, backend: Backend, request: GenerateRequest, fmt: ChatFormat | CompletionFormat,
                 timer: RequestTimer, return_token_ids: bool = False) -> None:
        self.out = api.OutputText(backend.tokenizer, request)
        self.return_token_ids = return_token_ids
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
        out = self.out
        self.timer.done(200)
        body = self.fmt.response(out.text, out.finish_reason, out.usage())
        if self.return_token_ids:
            body["choices"][0]["token_ids"] = out.token_ids
        return JSONResponse(body)

    async def events(self, first_text: str, include_usage: bool) -> AsyncGenerator[bytes, None]:
        status = CLIENT_CLOSED_STATUS  # unless the stream reaches its end
        try:
            if (first := self.fmt.first_chunk()) is not None:
                yield _sse(first)
            text = first_text
            while True:
                if text:
                    yield _sse(self.fmt.text_chunk(text))
                if self.out.is_finished:
                    break
                text = await self.next_text()
            yield _sse(self.fmt.finish_chunk(self.out.finish_reason))
            if include_usage:
                yield _sse(self.fmt.usage_chunk(self.out.usage()))
            status = 200
        except Exception as exc:  # noqa: BLE001 - after the headers, an error is an SSE event
            status, body = error_of(exc)
            yield _sse(body)
        finally:
            await close(self.chunks)
            self.timer.done(status)
        yield b"data: [DONE]\n\n"


class OpenAIRoutes:
    def __init__(self, backend: Backend, served_model_names: list[str] | None) -> None:
        self.backend = backend
        self.model_names = list(dict.fromkeys([*(served_model_names or ()), backend.model_name]))

    def _chat_request(self, body: ChatCompletionRequest) -> GenerateRequest:
        api.check_model(body.model, self.model_names)
        api.check_chat_supported(body)
        api.requested_max_tokens(body)
        prompt = api.chat_prompt(body.messages, self.backend.tokenizer, self.backend.image_token_id)
        params = api.sampling_params(body, len(prompt.token_ids), self.backend.max_model_len, "messages")
        return api.generate_request(f"chatcmpl-{uuid.uuid4().hex}", prompt, params, body, "chat")

    def _completion_request(self, body: CompletionRequest) -> GenerateRequest:
        api.check_model(body.model, self.model_names)
        api.check_completion_supported(body)
        api.requested_max_tokens(body)
        prompt = api.completion_prompt(body.prompt, self.backend.tokenizer)
        params = api.sampling_params(body, len(prompt.token_ids), self.backend.max_model_len, "prompt")
        return api.generate_request(f"cmpl-{uuid.uuid4().hex}", prompt, params, body, "agent")

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        return await self._serve(request, body, self._chat_request, ChatFormat, "/v1/chat/completions")

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        return await self._serve(request, body, self._completion_request, CompletionFormat, "/v1/completions")

    async def _serve(self, request: Request, body, build: Callable, format_cls, endpoint: str) -> Response:
        timer = RequestTimer(endpoint)
        try:
            # Templates and tokenizing are CPU work: off the event loop, which streams for everyone.
            generate_request = await run_in_threadpool(build, body)
        except Exception as exc:  # noqa: BLE001 - EPDError: the client's fault; else logged as a bug
            return timer.error(exc)
        PROMPT_TOKENS.labels(endpoint).inc(len(generate_request.prompt_token_ids))
        fmt = format_cls(generate_request.request_id, body.model or self.backend.model_name, int(time.time()))
        generation = None
        try:
            generation = _Generation(self.backend, generate_request, fmt, timer, body.return_token_ids)
            reading = generation.next_text() if body.stream else generation.read_all()
            # Streams read the first chunk before the headers, so early failures get real statuses.
            first_text = await unless_disconnected(request.receive, reading)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            if generation is not None:
                await close(generation.chunks)
            if isinstance(exc, ClientGone):
                timer.done(CLIENT_CLOSED_STATUS)
                return Response(status_code=CLIENT_CLOSED_STATUS)
            return timer.error(exc)
        if not body.stream:
            await close(generation.chunks)
            return generation.response()
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStreamResponse(generation.events(first_text, include_usage))

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
    """The OpenAI-compatible ASGI app over ``backend`` (see openai_api.py for what it accepts)."""
    app = FastAPI(title="epd router", summary="OpenAI-compatible front door of the epd cluster")
    routes = OpenAIRoutes(backend, served_model_names)
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"], response_model=None)
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"], response_model=None)
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"], response_model=None)
    app.add_api_route("/metrics", metrics_text, methods=["GET"], response_model=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        REQUESTS.labels(request.url.path, "400").inc()
        return JSONResponse(api.error_body(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(api.error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(EPDError)
    async def _epd_error(request: Request, exc: EPDError) -> JSONResponse:
        return JSONResponse(api.epd_error_body(exc), status_code=exc.http_status)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        status, body = error_of(exc)
        return JSONResponse(body, status_code=status)

    return app
