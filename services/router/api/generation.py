"""One request's generation: its choices read from the backend side by side and shaped by a
protocol's :class:`Format` into one JSON response or one SSE stream; the metrics every request
records; the watch for a client that goes away.

The client going away is watched for the whole time; it cancels whatever is reading the backend
iterators and they are closed, which is how the backend learns to cancel the request. The
iterators are closed on every other exit too (done, error, stop string matched here).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import ClassVar, Protocol

from fastapi.responses import JSONResponse, StreamingResponse

from services.common import metrics
from services.router.api.output import OutputText, num_request_tokens
from services.router.cluster.backend import Backend, GenerateRequest
from services.router.errors import ErrorBody, error_of, openai_error_body

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


Event = tuple[str | None, dict]
"""One SSE event: its name (None: a data-only event, as OpenAI sends them) and its JSON data."""


class Format(Protocol):
    """How one request's output goes on the wire (openai_formats.ChatFormat,
    anthropic_api.MessagesFormat, responses_api.ResponsesFormat). ``outs`` are the choices, in order."""

    terminator: ClassVar[bytes]
    """Sent after the last event, after an error event too (OpenAI's ``data: [DONE]``); b"": none."""
    n: int
    """Choices per request (OpenAI's ``n``; 1 for the other protocols)."""

    def response(self, outs: list[OutputText]) -> dict: ...
    def start_events(self, outs: list[OutputText]) -> list[Event]: ...
    def text_events(self, out: OutputText, text: str) -> list[Event]: ...
    def choice_end_events(self, out: OutputText) -> list[Event]: ...
    def end_events(self, outs: list[OutputText]) -> list[Event]: ...
    def error_event(self, body: dict) -> Event: ...


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


class RequestTimer:
    """One request's metrics, recorded once whichever way it ends."""

    def __init__(self, endpoint: str, error_body: ErrorBody = openai_error_body) -> None:
        self.endpoint = endpoint
        self.error_body = error_body
        self.state: dict = {}
        """The ASGI scope's state: ``epd_num_tokens`` (prompt + generated) is left there at the end
        for the gate's tokens-per-minute limit."""
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

    def done(self, status: int, num_tokens: int = 0) -> None:
        if not self.is_done:
            self.is_done = True
            self.state["epd_num_tokens"] = num_tokens
            REQUESTS.labels(self.endpoint, str(status)).inc()
            E2E_LATENCY.labels(self.endpoint).observe(time.perf_counter() - self.start)

    def error(self, exc: BaseException) -> JSONResponse:
        status, body = error_of(exc, self.error_body)
        self.done(status)
        return JSONResponse(body, status_code=status)


async def _wait_for_disconnect(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(receive: Callable, work: Awaitable) -> asyncio.Future:
    """Run ``work`` until it ends or the client disconnects (then it is cancelled); its task, done."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()
        watcher.cancel()
        await asyncio.wait((task, watcher))
    return task


async def unless_disconnected(receive: Callable, work: Awaitable) -> object:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientGone."""
    task = await _until_disconnect(receive, work)
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
        try:
            sending = await _until_disconnect(receive, self._send_all(send))
        finally:
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


def fork(request: GenerateRequest, n: int) -> list[GenerateRequest]:
    """One request per choice: ids suffixed ``-i``, and seed + i so that seeded choices differ from
    each other yet reproduce (as vLLM does)."""
    if n == 1:
        return [request]
    params = request.params
    return [dataclasses.replace(request, request_id=f"{request.request_id}-{i}", params=dataclasses.replace(
        params, seed=None if params.seed is None else params.seed + i)) for i in range(n)]


class _Choice:
    def __init__(self, backend: Backend, request: GenerateRequest, index: int) -> None:
        self.out = OutputText(backend.tokenizer, request, index)
        self.chunks = aiter(backend.generate(request))


class Generation:
    """Runs one GenerateRequest (``fmt.n`` choices of it) against the backend and shapes the result
    for one endpoint."""

    def __init__(self, backend: Backend, request: GenerateRequest, fmt: Format, timer: RequestTimer) -> None:
        self.choices = [_Choice(backend, r, i) for i, r in enumerate(fork(request, fmt.n))]
        self.fmt = fmt
        self.timer = timer

    @property
    def outs(self) -> list[OutputText]:
        return [choice.out for choice in self.choices]

    @property
    def num_tokens(self) -> int:
        """What the request costs (its usage: the prompt once, every choice's output)."""
        return num_request_tokens(self.outs)

    async def _next_text(self, choice: _Choice) -> str:
        """Read one chunk of a choice; the text it made safe to send."""
        try:
            chunk = await anext(choice.chunks)
        except StopAsyncIteration:
            raise RuntimeError("the backend's stream ended without a finish_reason") from None
        out = choice.out
        num_before = out.num_output_tokens
        text = out.add(chunk)
        self.timer.tokens(out.num_output_tokens - num_before)
        if out.is_finished:
            self.timer.cached_tokens(out.num_cached_tokens)
        return text

    async def _read_choice(self, choice: _Choice) -> None:
        while not choice.out.is_finished:
            await self._next_text(choice)

    async def read_all(self) -> None:
        await _all(self._read_choice(c) for c in self.choices)

    async def first_texts(self) -> list[str]:
        """Every choice's first chunk (read before the headers, so early failures get real statuses)."""
        return await _all(self._next_text(c) for c in self.choices)

    async def close(self) -> None:
        for choice in self.choices:
            await close(choice.chunks)

    def response(self) -> JSONResponse:
        self.timer.done(200, self.num_tokens)
        return JSONResponse(self.fmt.response(self.outs))

    def _choice_events(self, choice: _Choice, text: str) -> list[Event]:
        events = self.fmt.text_events(choice.out, text) if text else []
        if choice.out.is_finished:
            events += self.fmt.choice_end_events(choice.out)
        return events

    async def events(self, first_texts: list[str]) -> AsyncGenerator[bytes, None]:
        status = CLIENT_CLOSED_STATUS  # unless the stream reaches its end
        reading: dict[asyncio.Task, _Choice] = {}
        try:
            events = self.fmt.start_events(self.outs)
            for choice, text in zip(self.choices, first_texts):
                events += self._choice_events(choice, text)
            for event in events:
                yield _sse(event)
            reading = {asyncio.ensure_future(self._next_text(c)): c for c in self.choices if not c.out.is_finished}
            while reading:
                # Choices stream side by side: each chunk goes out as soon as it arrives.
                done, _ = await asyncio.wait(reading, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: reading[t].out.index):
                    choice = reading.pop(task)
                    for event in self._choice_events(choice, task.result()):
                        yield _sse(event)
                    if not choice.out.is_finished:
                        reading[asyncio.ensure_future(self._next_text(choice))] = choice
            for event in self.fmt.end_events(self.outs):
                yield _sse(event)
            status = 200
        except Exception as exc:  # noqa: BLE001 - after the headers, an error is an SSE event
            status, body = error_of(exc, self.timer.error_body)
            yield _sse(self.fmt.error_event(body))
        finally:
            await _cancel(reading)
            await self.close()
            self.timer.done(status, self.num_tokens)
        if self.fmt.terminator:
            yield self.fmt.terminator


async def _all(works) -> list:
    """Await all of ``works``; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await _cancel(tasks)


async def _cancel(tasks) -> None:
    """Cancel and wait for what still runs; the failures of the rest are already handled (one is
    raised, the others would only be logged as never retrieved)."""
    tasks = list(tasks)
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
    for task in tasks:
        if not task.cancelled():
            task.exception()
