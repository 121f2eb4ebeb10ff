"""The shared gRPC server: health, /metrics, graceful drain on SIGTERM, EPDError ↔ status.

A demo service with raw-bytes methods (no generated stubs) runs in-process for the error mapping
and in a subprocess for the signal tests.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest

from services.common import errors
from services.common.config import ConfigError, check, parse_config
from services.common.errors import (EPDError, InvalidRequestError, PromptTooLongError,
                                    UnavailableError)
from services.common.grpc_errors import ERROR_CLASS_KEY, error_from_rpc
from services.common.server import ServerOptions, check_health, serve, wait_for_health

ROOT = Path(__file__).resolve().parents[3]
SERVICE = "test.Demo"
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


async def _slow(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    """Waits until the file named by the request exists."""
    while not Path(request.decode()).exists():
        await asyncio.sleep(0.01)
    return b"done"


async def _raise(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    name = request.decode()
    if name == "ValueError":
        raise ValueError("bug")
    if name == "downstream":
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                   grpc.aio.Metadata(), details="peer down")
    raise getattr(errors, name)(f"boom {name}")


async def _stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"first"
    raise InvalidRequestError("bad after one")


async def _watch(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    """Reports every 10 ms for as long as the caller listens, as a router's load watch does."""
    while True:
        yield b"report"
        await asyncio.sleep(0.01)


def add_demo(server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Slow": grpc.unary_unary_rpc_method_handler(_slow),
        "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
        "Release": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
        "Raise": grpc.unary_unary_rpc_method_handler(_raise),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream),
        "WatchLoad": grpc.unary_stream_rpc_method_handler(_watch),
    }),))


def main_for_subprocess() -> int:
    async def on_drain() -> None:
        print("DRAINING", flush=True)

    def ready(port: int, metrics_port: int | None) -> None:
        print(f"READY {port} {metrics_port}", flush=True)

    return asyncio.run(serve(add_demo, ServerOptions(port=0, metrics_port=0), SERVICE,
                             on_drain=on_drain, ready=ready))


async def call(address: str, method: str, request: bytes, timeout_s: float = 10) -> bytes:
    async with grpc.aio.insecure_channel(address) as channel:
        return await channel.unary_unary(f"/{SERVICE}/{method}")(request, timeout=timeout_s)


async def with_server(scenario: Callable[[str], Awaitable[None]],
                      options: ServerOptions = ServerOptions()) -> None:
    """Run ``scenario(address)`` against an in-process demo server, then cancel the server."""
    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    server = asyncio.ensure_future(serve(add_demo, options, SERVICE,
                                         ready=lambda port, _: bound.set_result(port)))
    await asyncio.wait({bound, server}, return_when=asyncio.FIRST_COMPLETED)
    assert not server.done(), server.result()
    try:
        await scenario(f"127.0.0.1:{bound.result()}")
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)


@pytest.mark.parametrize("name, code, cls", [
    ("InvalidRequestError", grpc.StatusCode.INVALID_ARGUMENT, InvalidRequestError),
    ("PromptTooLongError", grpc.StatusCode.INVALID_ARGUMENT, PromptTooLongError),
    ("ModelNotFoundError", grpc.StatusCode.NOT_FOUND, errors.ModelNotFoundError),
    ("UnavailableError", grpc.StatusCode.UNAVAILABLE, UnavailableError),
    ("DrainingError", grpc.StatusCode.UNAVAILABLE, errors.DrainingError),
    ("DeadlineExceededError", grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceededError),
    ("EPDError", grpc.StatusCode.INTERNAL, EPDError),
])
def test_epd_error_becomes_its_status_and_comes_back(name, code, cls):
    async def scenario(address: str) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(address, "Raise", name.encode())
        assert (info.value.code(), info.value.details()) == (code, f"boom {name}")
        back = error_from_rpc(info.value)
        assert type(back) is cls and str(back) == f"boom {name}"
        assert back.http_status == cls.http_status

    asyncio.run(with_server(scenario))


def test_bug_becomes_internal_and_downstream_status_passes_on(caplog):
    async def scenario(address: str) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(address, "Raise", b"ValueError")
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert info.value.details() == "internal error: ValueError: bug"
        back = error_from_rpc(info.value)
        assert type(back) is EPDError and back.http_status == 500
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(address, "Raise", b"downstream")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == "peer down"

    asyncio.run(with_server(scenario))
    assert "Traceback" in caplog.text and "ValueError: bug" in caplog.text


def test_streaming_error_after_a_response():
    async def scenario(address: str) -> None:
        received = []
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for item in channel.unary_stream(f"/{SERVICE}/Stream")(b"", timeout=10):
                    received.append(item)
        assert received == [b"first"]
        assert type(error_from_rpc(info.value)) is InvalidRequestError

    asyncio.run(with_server(scenario))


def test_error_from_rpc_without_server():
    def rpc_error(code: grpc.StatusCode, details: str, trailing=()) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing),
                                    details=details)

    transport = error_from_rpc(rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    assert type(transport) is UnavailableError and transport.retryable
    cancelled = error_from_rpc(rpc_error(grpc.StatusCode.CANCELLED, "gone"))
    assert type(cancelled) is EPDError and str(cancelled) == "CANCELLED: gone"
    # A class name that disagrees with the status is ignored; the status wins.
    lying = error_from_rpc(rpc_error(grpc.StatusCode.NOT_FOUND, "x",
                                     [(ERROR_CLASS_KEY, "PromptTooLongError")]))
    assert type(lying) is errors.ModelNotFoundError


def test_every_grpc_status_name_is_real():
    def tree(cls: type[EPDError]) -> list[type[EPDError]]:
        return [cls] + [c for sub in cls.__subclasses__() for c in tree(sub)]

    for cls in tree(EPDError):
        assert cls.grpc_status in grpc.StatusCode.__members__, cls


def test_health_and_metrics_in_process():
    async def scenario(address: str) -> None:
        assert await wait_for_health(address, SERVICE, timeout_s=5)
        assert await check_health(address) == "SERVING"
        assert await check_health(address, "no.Such") is None  # NOT_FOUND
        assert await call(address, "Echo", b"hi") == b"hi"

    asyncio.run(with_server(scenario))


def test_wait_for_health_gives_up():
    assert asyncio.run(wait_for_health("127.0.0.1:1", timeout_s=0.3)) is False


def test_taken_port_is_fatal():
    async def scenario(address: str) -> None:
        port = int(address.rsplit(":", 1)[1])
        assert await serve(add_demo, ServerOptions(port=port), SERVICE) == 1

    asyncio.run(with_server(scenario))


def test_dead_background_task_is_fatal():
    async def engine_loop() -> None:
        raise RuntimeError("engine died")

    assert asyncio.run(serve(add_demo, ServerOptions(), SERVICE, background=[engine_loop()])) == 1


@dataclass(frozen=True)
class DemoConfig:
    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 50061
    """gRPC port."""
    metrics_port: int | None = 9061
    """Metrics port."""
    drain_timeout_s: float = 30.0
    """Drain time."""
    max_num_seqs: int = 8
    """Own field."""

    def __post_init__(self) -> None:
        ServerOptions.from_config(self)
        check(self.max_num_seqs > 0, "max_num_seqs", "must be > 0")


def test_server_options_from_a_service_config():
    config = parse_config(DemoConfig, ["--metrics-port", "none"], "prefill", {})
    assert ServerOptions.from_config(config) == ServerOptions(port=50061, metrics_port=None)
    with pytest.raises(ConfigError, match=r"^--port / EPD_PREFILL_PORT: must be in 0\.\.65535"):
        parse_config(DemoConfig, [], "prefill", {"EPD_PREFILL_PORT": "70000"})
    with pytest.raises(ConfigError, match="^--metrics-port / EPD_PREFILL_METRICS_PORT: must dif"):
        parse_config(DemoConfig, ["--metrics-port", "50061"], "prefill", {})


class DemoProcess:
    """The demo server in a subprocess; ``release`` is the file that lets a Slow call finish."""

    def __init__(self, tmp_path: Path) -> None:
        self.release = tmp_path / "release"
        code = "import sys; from tests.unit.common.test_server import main_for_subprocess as m; " \
               "sys.exit(m())"
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = self.proc.stdout.readline()
        assert line.startswith("READY"), line + self.proc.stderr.read()
        _, port, metrics_port = line.split()
        self.address = f"127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    async def metrics(self) -> str:
        def get() -> str:
            with urllib.request.urlopen(self.metrics_url, timeout=5) as reply:
                return reply.read().decode()
        return await asyncio.to_thread(get)

    async def start_slow_call(self) -> asyncio.Future[bytes]:
        slow = asyncio.ensure_future(call(self.address, "Slow", str(self.release).encode(), 20))
        for _ in range(500):
            if "epd_grpc_requests_in_flight 1.0" in await self.metrics():
                return slow
            await asyncio.sleep(0.01)
        raise AssertionError("the slow call never arrived")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


@pytest.fixture
def demo_process(tmp_path):
    process = DemoProcess(tmp_path)
    yield process
    process.close()


async def until_health(address: str, status: str) -> None:
    for _ in range(500):
        if await check_health(address, SERVICE) == status:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"health never became {status}")


def test_sigterm_drains_in_flight_refuses_new_and_exits_0(demo_process):
    async def scenario() -> None:
        assert await wait_for_health(demo_process.address, SERVICE, timeout_s=10)
        assert "epd_grpc_requests_in_flight 0.0" in await demo_process.metrics()
        slow = await demo_process.start_slow_call()
        demo_process.proc.send_signal(signal.SIGTERM)
        await until_health(demo_process.address, "NOT_SERVING")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(demo_process.address, "Echo", b"late")
        assert (info.value.code(), info.value.details()) == (UNAVAILABLE, "draining")
        assert type(error_from_rpc(info.value)) is errors.DrainingError  # no fault: the caller goes elsewhere
        # A Release ends work already lent out (KV under a lease): still served.
        assert await call(demo_process.address, "Release", b"lease-1") == b"lease-1"
        async with grpc.aio.insecure_channel(demo_process.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in channel.unary_stream(f"/{SERVICE}/Stream")(b"", timeout=10):
                    pass
        assert (info.value.code(), info.value.details()) == (UNAVAILABLE, "draining")
        assert not slow.done()
        demo_process.release.touch()
        assert await slow == b"done"

    asyncio.run(scenario())
    out, _ = demo_process.proc.communicate(timeout=20)
    assert demo_process.proc.returncode == 0
    assert "DRAINING" in out


def test_a_load_watch_reports_through_the_drain_without_holding_it(demo_process):
    """A router watches every instance for as long as both live: the drain goes on without
    waiting for that stream (it once ran to its 30 s timeout on every SIGTERM), and the watch
    goes on reporting while the last request ends."""
    async def scenario() -> None:
        assert await wait_for_health(demo_process.address, SERVICE, timeout_s=10)
        async with grpc.aio.insecure_channel(demo_process.address) as channel:
            watch = channel.unary_stream(f"/{SERVICE}/WatchLoad")(b"")
            assert await watch.read() == b"report"
            slow = await demo_process.start_slow_call()
            demo_process.proc.send_signal(signal.SIGTERM)
            await until_health(demo_process.address, "NOT_SERVING")
            assert await watch.read() == b"report"  # while the slow call drains
            demo_process.release.touch()
            assert await slow == b"done"
            with pytest.raises(grpc.aio.AioRpcError):  # the stop cuts it
                while await watch.read() == b"report":
                    pass

    asyncio.run(scenario())
    # Well inside the server's drain_timeout_s (30 s): the watch did not hold the drain.
    assert demo_process.proc.wait(timeout=15) == 0


def test_second_signal_stops_at_once(demo_process):
    async def scenario() -> None:
        assert await wait_for_health(demo_process.address, SERVICE, timeout_s=10)
        slow = await demo_process.start_slow_call()
        demo_process.proc.send_signal(signal.SIGTERM)
        await until_health(demo_process.address, "NOT_SERVING")
        demo_process.proc.send_signal(signal.SIGINT)
        with pytest.raises(grpc.aio.AioRpcError):
            await slow

    asyncio.run(scenario())
    assert demo_process.proc.wait(timeout=20) == 0


def test_metrics_are_created_once():
    from services.common import metrics

    first = metrics.histogram("epd_test_ttft_seconds", "TTFT.", ["model"], metrics.TTFT_BUCKETS_S)
    assert metrics.histogram("epd_test_ttft_seconds", "TTFT.", ["model"]) is first
    with pytest.raises(RuntimeError, match="already exists as Histogram"):
        metrics.counter("epd_test_ttft_seconds", "TTFT.", ["model"])
