"""Router fixtures: SmolLM2's real tokenizer, a scripted backend, the app served by uvicorn."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from services.common.tokenizer import Tokenizer, read_tokenizer_config
from services.router.api.app import create_app
from tests.unit.router.fakes import ScriptedBackend, ServerThread

SCRIPT_TEXT = "The capital of France is Paris. It is famous for the Eiffel Tower, café culture and art."


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir) -> Tokenizer:
    # As the engine's loader builds it (services/engine/models/loader.py, _load_tokenizer).
    path = Path(smollm2_dir)
    return Tokenizer.from_file(path / "tokenizer.json", read_tokenizer_config(path))


@pytest.fixture
def make_backend(tokenizer):
    def make(text: str = SCRIPT_TEXT, **kwargs) -> ScriptedBackend:
        return ScriptedBackend(tokenizer, tokenizer.encode(text), **kwargs)
    return make


@pytest.fixture
def serve():
    """serve(backend, served_model_names=None) -> base URL; stopped after the test."""
    servers: list[ServerThread] = []

    def start(backend, served_model_names=None) -> str:
        server = ServerThread(create_app(backend, served_model_names)).__enter__()
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture
def backend(make_backend) -> ScriptedBackend:
    return make_backend()


@pytest.fixture
def base_url(serve, backend) -> str:
    return serve(backend, ["alias"])


@pytest.fixture
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=10) as client:
        yield client
