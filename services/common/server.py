"""The one asyncio gRPC server every service process runs through (STYLE rule 12).

Life cycle of a server process::

    serve()  bind gRPC port ─ start /metrics ─ health SERVING ─ ready(port, metrics_port)
       │ SIGTERM / SIGINT
       ▼
    drain    new RPCs → UNAVAILABLE "draining" (Release RPCs still served) ─ health NOT_SERVING
       │     ─ on_drain() ─ wait for in-flight RPCs (load watches are not) ─ until_settled()
       │     (both within drain_timeout_s) ─ stop ─ return 0
       │ a second signal: stop now, return 0
       │ a background task dies (dead engine): stop now, return 1

Servicers just raise: every servicer method runs inside a wrapper that turns an ``EPDError`` into
its gRPC status (``grpc_errors.abort_with``) and anything else into INTERNAL with the traceback
logged. The standard ``grpc.health.v1.Health`` service reports "" and the service's name.

Settings: serve() takes a :class:`ServerOptions`. parse_config only knows flat fields, so each
service config declares the same four fields itself (each becomes that service's
``--port`` / ``EPD_<SERVICE>_PORT`` ...) and checks them through ``ServerOptions.from_config(self)``
in ``__post_init__``, which raises ConfigError naming the service's own flag and env var::

    host: str = "127.0.0.1"
    \"\"\"Address to bind gRPC and /metrics to; 0.0.0.0 in a container.\"\"\"
    port: int = 50061
    \"\"\"gRPC port; 0 picks a free one.\"\"\"
    metrics_port: int | None = 9061
    \"\"\"Prometheus /metrics HTTP port; 0 picks a free one, none disables it.\"\"\"
    drain_timeout_s: float = 30.0
    \"\"\"On SIGTERM, how long in-flight requests get to finish.\"\"\"
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import start_http_server

from services.common import metrics
from services.common.config import check
from services.common.errors import DrainingError, EPDError
from services.common.grpc_errors import abort_with, error_from_rpc

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
"""Every client channel between epd services: big messages, and reconnects at most a second
apart (gRPC's default back-off grows to two minutes: a peer restarted after a crash would be
taken back seconds late)."""
_HEALTH_PREFIX = "/grpc.health.v1.Health/"
_WATCH_SUFFIX = "/WatchLoad"
"""Not work a drain waits for (else every drain ran to its timeout): a load watch lasts as long as
its watcher, a router; it reports on while the instance drains, and the stop cuts it."""
_RELEASE_SUFFIX = "/Release"
"""Served while draining: a Release ends work already in flight (KV or rows lent under a lease)."""
_STOP_GRACE_S = 1.0
"""server.stop()'s grace once our own drain is done: time to flush the last responses."""

IN_FLIGHT = metrics.gauge("epd_grpc_requests_in_flight", "RPCs being served now (health excluded).")


@dataclass(frozen=True)
class ServerOptions:
    """What serve() needs from a service config (see the module docstring); a service config
    may also inherit these fields (and their checks) instead of declaring them."""

    host: str = "127.0.0.1"
    """Address to bind gRPC and /metrics to; 0.0.0.0 in a container."""
    port: int = 0
    """gRPC port; 0 picks a free one."""
    metrics_port: int | None = None
    """Prometheus /metrics HTTP port; 0 picks a free one, none disables it."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests get to finish."""

    def __post_init__(self) -> None:
        check(bool(self.host), "host", "must not be empty")
        check(0 <= self.port <= 65535, "port", "must be in 0..65535 (0: a free port)")
        check(self.metrics_port is None or 0 <= self.metrics_port <= 65535, "metrics_port",
              "must be in 0..65535 (0: a free port) or none")
        check(self.metrics_port in (None, 0) or self.metrics_port != self.port, "metrics_port",
              "must differ from the gRPC port")
        check(self.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0")

    @classmethod
    def from_config(cls, config: Any) -> ServerOptions:
        """The fields of that name on ``config``; raises ConfigError (naming the field) if bad."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})


async def serve(add_servicers: Callable[[grpc.aio.Server], None], options: ServerOptions,
                service_name: str, *, on_drain: Callable[[], Awaitable[None]] | None = None,
                until_settled: Callable[[], Awaitable[None]] | None = None,
                ready: Callable[[int, int | None], None] | None = None,
                background: Sequence[Coroutine[Any, Any, None]] = ()) -> int:
    """Serve until a signal; return the process exit code (0: asked to stop, 1: fatal).

    ``add_servicers(server)`` registers the service's servicers. ``on_drain()`` runs once draining
    starts, before in-flight RPCs are waited for: stop taking new work there (the engine keeps
    running for the RPCs in flight). ``until_settled()`` is awaited once they have ended: work that
    outlives its RPC (KV or rows lent under leases until their readers release them), within the
    same drain_timeout_s. ``ready(port, metrics_port)`` gets the bound ports (0 resolved;
    metrics_port None when disabled). ``background`` coroutines (an engine loop) run alongside and
    are cancelled at the end; one that ends first is fatal: the server stops and serve returns 1.
    """
    drain = _Drain()
    server = grpc.aio.server(interceptors=[_Interceptor(drain)], options=[
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0)])  # a second server on a taken port must fail, not share it
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    add_servicers(server)
    try:
        port = server.add_insecure_port(f"{options.host}:{options.port}")
        httpd = None if options.metrics_port is None else start_http_server(
            options.metrics_port, addr=options.host)[0]
    except (RuntimeError, OSError) as e:
        logger.error("%s: cannot bind %s:%s (metrics %s): %s", service_name, options.host,
                     options.port, options.metrics_port, e)
        await server.stop(None)
        return 1
    metrics_port = None if httpd is None else httpd.server_port
    running = _Running(server, health, drain, options, on_drain, until_settled)
    tasks: list[asyncio.Task[None]] = []
    try:
        await server.start()
        running.signals.install()
        await health.set(service_name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("%s serving gRPC on %s:%d, metrics %s", service_name, options.host, port,
                    "off" if metrics_port is None else
                    f"on http://{options.host}:{metrics_port}/metrics")
        if ready is not None:
            ready(port, metrics_port)
        tasks = [asyncio.ensure_future(c) for c in background]
        return await running.until_stopped(tasks)
    finally:
        running.signals.remove()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.stop(None)  # no-op after a clean stop; cuts everything when cancelled
        if httpd is not None:
            await asyncio.to_thread(httpd.shutdown)
            httpd.server_close()


@dataclass
class _Running:
    """A started server, from its first signal (or dead background task) to its stop."""

    server: grpc.aio.Server
    health: health_aio.HealthServicer
    drain: _Drain
    options: ServerOptions
    on_drain: Callable[[], Awaitable[None]] | None
    until_settled: Callable[[], Awaitable[None]] | None
    signals: _Signals = field(default_factory=lambda: _Signals())

    async def until_stopped(self, tasks: list[asyncio.Task[None]]) -> int:
        first_signal = asyncio.ensure_future(self.signals.first.wait())
        done, _ = await asyncio.wait({first_signal, *tasks}, return_when=asyncio.FIRST_COMPLETED)
        if first_signal not in done:
            first_signal.cancel()
            task = done.pop()
            error = None if task.cancelled() else task.exception()
            logger.error("background task %s ended (%r); stopping", task.get_name(), error,
                         exc_info=error)
            await self.health.enter_graceful_shutdown()
            await self.server.stop(None)
            return 1
        draining = asyncio.ensure_future(self.drain_then_stop())
        second_signal = asyncio.ensure_future(self.signals.second.wait())
        await asyncio.wait({draining, second_signal}, return_when=asyncio.FIRST_COMPLETED)
        second_signal.cancel()
        if draining.done():
            return draining.result()
        logger.warning("second signal: stopping now, cutting %d RPCs in flight",
                       self.drain.num_in_flight)
        draining.cancel()
        await asyncio.gather(draining, return_exceptions=True)
        await self.server.stop(None)
        return 0

    async def drain_then_stop(self) -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.drain_timeout_s
        self.drain.is_draining = True
        await self.health.enter_graceful_shutdown()
        logger.info("draining: %d RPCs in flight, up to %.1f s", self.drain.num_in_flight,
                    self.options.drain_timeout_s)
        exit_code = 0
        if self.on_drain is not None:
            try:
                await self.on_drain()
            except Exception:
                logger.exception("on_drain failed")
                exit_code = 1
        if not await self.drain.wait_idle(max(0.0, deadline - loop.time())):
            logger.warning("drain timed out: cutting %d RPCs in flight", self.drain.num_in_flight)
        elif self.until_settled is not None:
            try:
                await asyncio.wait_for(self.until_settled(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                logger.warning("drain timed out: stopping with work lent out (its leases end with the process)")
        await self.server.stop(_STOP_GRACE_S)
        return exit_code


class _Drain:
    """Counts the RPCs in flight, and says whether new ones are still welcome."""

    def __init__(self) -> None:
        self.is_draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.num_in_flight += 1
        IN_FLIGHT.inc()
        self._idle.clear()
        try:
            yield
        finally:
            self.num_in_flight -= 1
            IN_FLIGHT.dec()
            if self.num_in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False


class _Signals:
    """SIGTERM / SIGINT as two events: the first asks for a drain, the second for a stop."""

    NAMES = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.first = asyncio.Event()
        self.second = asyncio.Event()
        self._installed: list[signal.Signals] = []

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread gets signals (tests may serve from another)
        loop = asyncio.get_running_loop()
        for sig in self.NAMES:
            loop.add_signal_handler(sig, self._on_signal, sig)
            self._installed.append(sig)

    def remove(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._installed:
            loop.remove_signal_handler(sig)
        self._installed.clear()

    def _on_signal(self, sig: signal.Signals) -> None:
        logger.info("got %s", sig.name)
        (self.second if self.first.is_set() else self.first).set()


_KINDS = {  # (request_streaming, response_streaming) → behaviour attribute, handler factory
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class _Interceptor(grpc.aio.ServerInterceptor):
    """Wraps every servicer method: drain refusal, in-flight count, errors → status."""

    def __init__(self, drain: _Drain) -> None:
        self._drain = drain

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_HEALTH_PREFIX):
            return handler
        attr, make = _KINDS[(handler.request_streaming, handler.response_streaming)]
        track = contextlib.nullcontext if details.method.endswith(_WATCH_SUFFIX) else self._drain.track
        is_refused = self._drain.is_draining and not details.method.endswith(_RELEASE_SUFFIX)
        behaviour = _refuse if is_refused else _guarded(getattr(handler, attr), track)
        return make(behaviour, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await abort_with(context, DrainingError("draining"))


def _guarded(method: Callable[..., Any], track: Callable[[], contextlib.AbstractContextManager]) -> Callable[..., Any]:
    """``method`` inside ``track()`` (in flight or not), errors turned into statuses; same shape."""
    if inspect.isasyncgenfunction(method):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with track():
                try:
                    async with contextlib.aclosing(method(request, context)) as responses:
                        async for response in responses:
                            yield response
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    await _abort_for(context, e, method)
        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with track():
            try:
                result = method(request, context)
                return await result if inspect.isawaitable(result) else result
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await _abort_for(context, e, method)
    return unary


async def _abort_for(context: grpc.aio.ServicerContext, error: Exception,
                     method: Callable[..., Any]) -> None:
    if isinstance(error, grpc.aio.AioRpcError):
        error = error_from_rpc(error)  # a downstream call failed: pass its status on
    if isinstance(error, EPDError):
        await abort_with(context, error)
    logger.error("%s failed", getattr(method, "__qualname__", method), exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL,
                        f"internal error: {type(error).__name__}: {error}")


async def check_health(address: str, service_name: str = "", timeout_s: float = 1.0) -> str | None:
    """The health status name ("SERVING", "NOT_SERVING", ...), or None if the call failed."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service_name), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def wait_for_health(address: str, service_name: str = "", timeout_s: float = 30.0) -> bool:
    """Poll until ``address`` reports ``service_name`` SERVING; False after ``timeout_s`` (a poll
    for readiness, not a retry of failed work, so it does not go through retry.py)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (remaining := deadline - loop.time()) > 0:
        if await check_health(address, service_name, min(1.0, remaining)) == "SERVING":
            return True
        await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))
    return False
