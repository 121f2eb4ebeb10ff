"""Shared fixtures: tiny random checkpoints, and the no-leak check every engine test gets."""

from __future__ import annotations

import weakref

import pytest

from tests.factories import make_tiny_chat_model_dir, make_tiny_model_dir

_long_lived_engines: "weakref.WeakSet" = weakref.WeakSet()
"""Engines built by module- or session-scoped fixtures: checked after every test while they live."""
_test_engines: list = []
"""Engines built by the running test (or its function-scoped fixtures): held until its
teardown, so one the test dropped is still checked, then let go."""
_num_wide_fixtures_in_setup = 0


def pytest_sessionstart(session) -> None:
    """The suite's first line (with -q too): the CPU it found, what ``--dtype auto`` resolves to
    on it, and the precisions the guarantee tests run in (they follow the machine)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for line in _machine_lines():
        if reporter is not None:
            reporter.write_line(line)


def _machine_lines() -> list[str]:
    try:
        import torch

        from services.engine.kernels import cpu, select
        from services.engine.model_runner import cpu_computes_bf16, resolve_dtype
        from tests.factories import machine_dtypes
    except ImportError:  # a torch-free run
        return []
    flags = cpu.cpu_flags() or frozenset()
    features = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    kernels = cpu.kernels()
    auto = str(resolve_dtype("auto", torch.device("cpu"), "bfloat16")).removeprefix("torch.")
    return [f"epd: CPU {select.cpu_vendor() or '?'} {cpu.cpu_model() or '?'}; features {' '.join(features) or 'none'}; "
            f"C kernels {'built' if kernels else 'absent'}, bf16 product {(kernels and kernels.bf16_product) or 'none'}; "
            f"--dtype auto: {auto} for a 16-bit model (bf16 pays: {cpu_computes_bf16()}), float32 for an fp32 one; "
            f"guarantee tests in {', '.join(machine_dtypes())}"]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def smollm2_dir():
    """The default model converted to a Hugging Face directory (once per machine, then cached)."""
    from services.engine.models.loader import load_model
    return load_model(None).path


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory, smollm2_dir):
    """A tiny random Llama with SmolLM2's tokenizer and chat template (fast, but speaks text)."""
    return make_tiny_chat_model_dir(tmp_path_factory.mktemp("tiny-chat"), smollm2_dir)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server for the session (installed from Debian's packages when missing)."""
    import shutil
    import socket
    import subprocess
    import time

    import redis

    if shutil.which("redis-server") is None:
        subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "redis-server"],
                       check=False, capture_output=True)
    if shutil.which("redis-server") is None:
        pytest.fail("these tests need redis-server: apt-get install redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path_factory.mktemp("redis"))],
                              stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                server.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    client.close()
    yield url
    server.terminate()
    server.wait(10)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Tell engines built by wider-scoped fixtures from those a single test builds."""
    global _num_wide_fixtures_in_setup
    is_wide = fixturedef.scope != "function"
    _num_wide_fixtures_in_setup += is_wide
    try:
        yield
    finally:
        _num_wide_fixtures_in_setup -= is_wide


@pytest.fixture(scope="session", autouse=True)
def _track_engines():
    """Record every LLMEngine built during the session (module-scoped ones included)."""
    try:
        from services.engine.engine import LLMEngine
    except ImportError:  # torch-free test runs
        yield
        return
    original = LLMEngine.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if _num_wide_fixtures_in_setup:
            _long_lived_engines.add(self)
        else:
            _test_engines.append(self)

    LLMEngine.__init__ = init
    yield
    LLMEngine.__init__ = original


@pytest.fixture(autouse=True)
def no_leaked_blocks():
    """After every test (and its function-scoped fixtures' teardown), every engine it could
    reach has no request left (running, waiting, or held for KV), nothing lent out, and every
    KV block free."""
    yield
    engines, _test_engines[:] = [*_long_lived_engines, *_test_engines], []
    for engine in engines:
        bm, stats = engine.block_manager, engine.stats()
        assert not engine.has_unfinished_requests() and not engine._states, "a request was left in the engine"
        assert (stats.num_running, stats.num_waiting, stats.num_held) == (0, 0, 0), (
            f"the engine still reports load: {stats}")
        assert engine._num_handoff_blocks == 0, "a hand-off was never released"
        assert bm.num_free_blocks == bm.num_blocks, (
            f"{bm.num_blocks - bm.num_free_blocks} KV blocks still held after the test")
