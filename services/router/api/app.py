"""The router's HTTP front door: OpenAI- and Anthropic-compatible routes over a :class:`Backend`.

One module per protocol (openai_api / openai_models / openai_formats, anthropic_api, responses_api /
responses_models / responses_format) exposes the same two entry points: ``build(body, backend,
model_names)`` turns its body into a GenerateRequest plus a format object, and ``error_body`` is
its error format (from ``services/router/errors.py``); prompts.py builds every protocol's prompt,
and tools.py and structured.py turn tools and output formats into a grammar for every protocol;
generation.py (with output.py) is the shared core that runs any of them, and this module only
routes. Life of a request here::

    [CORS: a preflight is answered here] -> [gate: API key, limits, body size]
        -> body (pydantic) -> checks, chat template, token ids (a worker thread) -> GenerateRequest, Format
        -> the tenant's salt joins the cache salt (the gate put the tenant in the ASGI scope)
        -> backend.generate(), once per choice -> first chunks (errors before them are plain HTTP errors)
        -> JSON response, or SSE: the format's start events, each choice's text deltas and end
           events as they come, end events, terminator (OpenAI: role chunks, deltas, finish chunks,
           [usage chunk], [DONE]; Anthropic: message_start ... message_stop, no terminator)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware

from services.common.errors import EPDError
from services.router.access.gate import Gate
from services.router.api import anthropic_api, openai_api, responses_api
from services.router.api.anthropic_api import CountTokensRequest, MessagesRequest
from services.router.api.body_checks import CheckedRoute
from services.router.api.generation import (CLIENT_CLOSED_STATUS, PROMPT_TOKENS, REQUESTS, ClientGone,
                                            EventStreamResponse, Format, Generation, RequestTimer,
                                            unless_disconnected)
from services.router.api.image_urls import ImageFetcher
from services.router.api.openai_models import ChatCompletionRequest, CompletionRequest
from services.router.api.responses_models import ResponsesRequest
from services.router.cluster.backend import Backend, GenerateRequest
from services.router.errors import ErrorBody, describe_validation_errors, error_body_for, error_of

logger = logging.getLogger(__name__)

Build = Callable[[object, Backend, list[str]], tuple[GenerateRequest, Format]]
"""A protocol's entry point: ``build(body, backend, model_names) -> (GenerateRequest, format)``
(openai_api.build_chat / build_completion, anthropic_api.build, responses_api.build), each with
its ``error_body``."""

HEALTH_TIMEOUT_S = 5.0
"""A backend health check that takes longer counts as unhealthy: /health must never hang."""


def tenant_salt(tenant: str, cache_salt: str) -> str:
    """A tenant's requests share cached KV only with each other (and, within the tenant, only
    with the same cache_salt): no tenant can hit, or time, another's prefixes."""
    return json.dumps([tenant, cache_salt])


INLINE_BUILD_BYTES = 2048
"""Request bodies up to this size are templated and tokenized on the event loop (~0.1-0.3 ms);
larger ones in a worker thread, so a long prompt never stalls the streams of others."""

class Routes:
    """Every protocol's routes over one backend."""

    def __init__(self, backend: Backend, served_model_names: list[str] | None,
                 image_urls: ImageFetcher | None = None) -> None:
        self.backend = backend
        self.image_urls = image_urls or ImageFetcher()
        self.model_names = list(dict.fromkeys([*(served_model_names or ()), backend.model_name]))

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        return await self._serve(request, body, openai_api.build_chat, openai_api.error_body, "/v1/chat/completions")

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        return await self._serve(request, body, openai_api.build_completion, openai_api.error_body, "/v1/completions")

    async def messages(self, request: Request, body: MessagesRequest) -> Response:
        return await self._serve(request, body, anthropic_api.build, anthropic_api.error_body, "/v1/messages")

    async def responses(self, request: Request, body: ResponsesRequest) -> Response:
        return await self._serve(request, body, responses_api.build, responses_api.error_body, "/v1/responses")

    async def count_tokens(self, body: CountTokensRequest) -> Response:
        """Anthropic's ``/v1/messages/count_tokens``: the templated prompt's length, nothing generated."""
        try:
            prompt = await run_in_threadpool(anthropic_api.prompt, body, self.backend, self.model_names)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an Anthropic error body
            status, error = error_of(exc, anthropic_api.error_body)
            return JSONResponse(error, status_code=status)
        return JSONResponse({"input_tokens": len(prompt.token_ids)})

    async def _serve(self, request: Request, body, build: Build, error_body: ErrorBody, endpoint: str) -> Response:
        """One generation request of any protocol: ``build`` (its protocol's entry point) turns the
        body into a GenerateRequest and a format; the rest is the same for every protocol."""
        timer = RequestTimer(endpoint, error_body)
        timer.state = request.scope.setdefault("state", {})
        try:
            await self.image_urls.inline(body)  # allowed remote image URLs -> data URIs
            # Templates and tokenizing are CPU work: off the event loop, which streams for everyone,
            # unless the body is so small that the hop to a thread costs more than the work.
            if int(request.headers.get("content-length") or INLINE_BUILD_BYTES + 1) <= INLINE_BUILD_BYTES:
                generate_request, fmt = build(body, self.backend, self.model_names)
            else:
                generate_request, fmt = await run_in_threadpool(build, body, self.backend, self.model_names)
        except Exception as exc:  # noqa: BLE001 - EPDError: the client's fault; else logged as a bug
            return timer.error(exc)
        if tenant := timer.state.get("epd_tenant"):
            generate_request = dataclasses.replace(
                generate_request, cache_salt=tenant_salt(tenant, generate_request.cache_salt))
        PROMPT_TOKENS.labels(timer.endpoint).inc(len(generate_request.prompt_token_ids) * fmt.n)
        generation = None
        try:
            generation = Generation(self.backend, generate_request, fmt, timer)
            reading = generation.first_texts() if body.stream else generation.read_all()
            # Streams read the first chunks before the headers, so early failures get real statuses.
            first_texts = await unless_disconnected(request.receive, reading)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the protocol's error body
            if generation is not None:
                await generation.close()
            if isinstance(exc, ClientGone):
                timer.done(CLIENT_CLOSED_STATUS, generation.num_tokens)
                return Response(status_code=CLIENT_CLOSED_STATUS)
            return timer.error(exc)
        if not body.stream:
            await generation.close()
            return generation.response()
        return EventStreamResponse(generation.events(first_texts))

    def _model(self, name: str, created: int) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "epd",
                "max_model_len": self.backend.max_model_len}

    async def models(self) -> dict:
        created = int(time.time())
        return {"object": "list", "data": [self._model(name, created) for name in self.model_names]}

    async def model(self, model: str) -> dict:
        """One entry of :meth:`models` (the SDKs' ``models.retrieve``); an unknown name is the
        404 ``model_not_found`` that a generation request naming it gets."""
        openai_api.check_model(model, self.model_names)
        return self._model(model, int(time.time()))

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


def cors_middleware(allow_origins: tuple[str, ...] | list[str]) -> Middleware:
    """CORS for browser clients. Any request header is allowed (the preflight's list is echoed):
    the SDKs send their own (Authorization, x-api-key, anthropic-version, OpenAI-Beta, x-stainless-*,
    anthropic-dangerous-direct-browser-access ...), and a fixed list would break each new one.
    Retry-After (429 / 503) is the one response header clients read that CORS hides by default."""
    return Middleware(CORSMiddleware, allow_origins=list(allow_origins), allow_methods=["GET", "POST"],
                      allow_headers=["*"], expose_headers=["Retry-After"], max_age=600)


def create_app(backend: Backend, served_model_names: list[str] | None = None, gate: Gate | None = None,
               cors_allow_origins: tuple[str, ...] = (), image_urls: ImageFetcher | None = None) -> FastAPI:
    """The ASGI app over ``backend`` (openai_api.py, responses_api.py, anthropic_api.py: what it accepts),
    behind ``gate`` (API keys, per-key limits, body size: gate.py) if given, and CORS for
    ``cors_allow_origins`` if any: outermost, so a preflight (which carries no key) is answered
    before the gate, and the gate's own 401 / 429 reach the browser with CORS headers too.
    ``image_urls``: which remote image URLs are fetched (image_urls.py; default none)."""
    middleware = [] if not cors_allow_origins else [cors_middleware(cors_allow_origins)]
    middleware += [] if gate is None else [gate.middleware()]  # the first in the list is the outermost
    app = FastAPI(title="epd router", summary="OpenAI- and Anthropic-compatible front door of the epd cluster",
                  middleware=middleware)
    routes = Routes(backend, served_model_names, image_urls)
    app.router.route_class = CheckedRoute  # bodies are counted before FastAPI parses them
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"], response_model=None)
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"], response_model=None)
    app.add_api_route("/v1/responses", routes.responses, methods=["POST"], response_model=None)
    app.add_api_route("/v1/messages", routes.messages, methods=["POST"], response_model=None)
    app.add_api_route("/v1/messages/count_tokens", routes.count_tokens, methods=["POST"], response_model=None)
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    # ":path": a served name may hold a slash ("org/model"), which clients send as %2F.
    app.add_api_route("/v1/models/{model:path}", routes.model, methods=["GET"])
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
