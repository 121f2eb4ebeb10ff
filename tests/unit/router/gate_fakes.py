"""For the gate's tests: a clock the test moves, ASGI calls the test drives message by message,
a tiny app behind the gate that records what reached it, and a key store and a limiter that go
down like Redis does."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from services.common.errors import UnavailableError
from services.router.access.auth import ApiKey, FileKeyStore
from services.router.access.gate import Gate
from services.router.access.limits import Lease, Limits, LocalLimiter, Refusal

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                    "/v1/messages/count_tokens")


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


class Call:
    """One HTTP request straight into an ASGI app: the body arrives in ``chunks`` (more than one,
    without Content-Length: what a server hands over for a chunked body), and the client stays
    until ``disconnect()`` (``leaves_mid_body``: right after the last chunk, which is not the end)."""

    def __init__(self, app, path: str, headers: dict[str, str] | None = None, body: bytes = b"",
                 chunks: list[bytes] | None = None, method: str = "POST", content_length: bool = True,
                 leaves_mid_body: bool = False) -> None:
        chunks = [body] if chunks is None else chunks
        raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        if content_length and len(chunks) == 1:
            raw.append((b"content-length", str(len(chunks[0])).encode()))
        self.scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                      "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
                      "query_string": b"", "root_path": "", "headers": raw, "client": ("127.0.0.1", 50000),
                      "server": ("127.0.0.1", 8000)}
        self.app = app
        self.incoming: asyncio.Queue = asyncio.Queue()
        for i, chunk in enumerate(chunks):
            more_body = leaves_mid_body or i < len(chunks) - 1
            self.incoming.put_nowait({"type": "http.request", "body": chunk, "more_body": more_body})
        if leaves_mid_body:
            self.disconnect()
        self.num_received = 0
        self.sent: list[dict] = []
        self.first_body = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def _receive(self) -> dict:
        message = await self.incoming.get()
        self.num_received += 1
        return message

    async def _send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            self.first_body.set()

    def start(self) -> Call:
        self.task = asyncio.ensure_future(self.app(self.scope, self._receive, self._send))
        return self

    def disconnect(self) -> None:
        self.incoming.put_nowait({"type": "http.disconnect"})

    def reply(self) -> Reply:
        start = next(m for m in self.sent if m["type"] == "http.response.start")
        headers = {k.decode(): v.decode() for k, v in start["headers"]}
        return Reply(start["status"], headers, b"".join(m.get("body", b"") for m in self.sent[1:]))

    async def run(self) -> Reply:
        self.start()
        await self.task
        return self.reply()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class TinyApp:
    """Behind the gate: answers every gated path, records the tenant and body it saw. A body
    ``{"tokens": n}`` reports n tokens used; ``{"hold": true}`` streams one chunk, then waits for
    ``release`` (or the client leaving); ``{"fail": true}`` raises."""

    gate: Gate
    tenants: list[str | None] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> Starlette:
        routes = [Route(path, self.generate, methods=["POST"]) for path in GENERATION_PATHS]
        routes += [Route("/v1/models", self.models, methods=["GET"]),
                   Route("/health", lambda request: PlainTextResponse("ok")),
                   Route("/metrics", lambda request: PlainTextResponse("# metrics"))]
        return Starlette(routes=routes, middleware=[self.gate.middleware()])

    async def generate(self, request: Request):
        body = await request.body()
        self.bodies.append(body)
        self.tenants.append(getattr(request.state, "epd_tenant", None))
        spec = json.loads(body) if body else {}
        if spec.get("fail"):
            raise RuntimeError("the app failed")
        request.state.epd_num_tokens = spec.get("tokens", 0)
        if spec.get("hold"):
            return StreamingResponse(self._held())
        return JSONResponse({"ok": True})

    async def _held(self):
        yield b"first"
        await self.release.wait()
        yield b"rest"

    async def models(self, request: Request):
        return JSONResponse({"data": []})


class RedisBacked:
    """Objects of one kind sharing one state (one Redis prefix), made inside the test's event loop;
    ``run`` closes the Redis clients they opened."""

    def __init__(self, kind: str, redis_url: str | None) -> None:
        self.kind, self.redis_url = kind, redis_url
        self.prefix = f"test-{uuid.uuid4().hex}"
        self.clients: list = []

    def redis_client(self):
        import redis.asyncio
        client = redis.asyncio.Redis.from_url(self.redis_url)
        self.clients.append(client)
        return client

    def run(self, test) -> None:
        async def body():
            try:
                await test()
            finally:
                for client in self.clients:
                    await client.aclose()
        asyncio.run(body())


class FlakyKeyStore(FileKeyStore):
    """Keys in memory standing in for Redis: counts what it is asked; ``is_down`` makes every
    call fail the way RedisKeyStore's do."""

    def __init__(self) -> None:
        super().__init__(None)
        self.is_down = False
        self.calls: dict[str, int] = {}

    def _ask(self, what: str) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1
        if self.is_down:
            raise UnavailableError("the API key store (Redis) is unavailable: connection refused (test)")

    async def find(self, sha256: str) -> ApiKey | None:
        self._ask("find")
        return await super().find(sha256)

    async def has_keys(self) -> bool:
        self._ask("has_keys")
        return await super().has_keys()


class FlakyLimiter(LocalLimiter):
    """LocalLimiter's rules standing in for the Redis limiter, with leases to renew and an outage
    switch; ``calls`` counts what was asked of it while down."""

    def __init__(self, clock, renew_every_s: float | None = None) -> None:
        super().__init__(clock)
        self.renew_every_s = renew_every_s
        self.is_down = False
        self.failed: dict[str, int] = {}

    def _ask(self, what: str) -> None:
        if self.is_down:
            self.failed[what] = self.failed.get(what, 0) + 1
            raise UnavailableError("the per-key limits store (Redis) is unavailable: connection refused (test)")

    async def acquire(self, key_id: str, limits: Limits) -> Lease | Refusal:
        self._ask("acquire")
        return await super().acquire(key_id, limits)

    async def release(self, lease: Lease, num_tokens: int) -> None:
        self._ask("release")
        await super().release(lease, num_tokens)

    async def renew(self, lease: Lease) -> None:
        self._ask("renew")
