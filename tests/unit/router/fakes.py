"""A scripted Backend and a uvicorn server in a thread: the router tested without any engine."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import openai
import pytest
import uvicorn

from services.common.sampling_params import TokenLogprobs
from services.common.tokenizer import Tokenizer
from services.router.cluster.backend import GenerateChunk, GenerateRequest


@dataclass
class ScriptedBackend:
    """Yields ``script`` (token ids) as if generated, then EOS; honours max_tokens, stop token ids,
    EOS and ignore_eos the way the engine does, but not stop strings (the router must cut those).

    Every request is recorded; ``closed`` gets the id of each request whose iterator was closed or
    cancelled before it finished, and ``ended`` is set whenever any generation ends.
    """

    tokenizer: Tokenizer
    script: list[int]
    model_name: str = "test-model"
    max_model_len: int = 2048
    image_token_id: int | None = None
    tokens_per_chunk: int = 1
    delay_s: float = 0.0
    """Sleep before each chunk (a slow model), so a client can go away mid-generation."""
    stall_after: int | None = None
    """Before this chunk, wait (nearly) forever: a client leaving during the wait must still close us."""
    num_cached_tokens: int = 0
    error: Exception | None = None
    """Raised after ``error_after`` chunks."""
    error_after: int = 0
    abort_after: int | None = None
    """Send finish_reason="abort" after this many chunks."""
    healthy: bool = True
    requests: list[GenerateRequest] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)

    async def is_healthy(self) -> bool:
        return self.healthy

    def _tokens(self, request: GenerateRequest) -> tuple[list[int], str, int | None]:
        """All output tokens with the finish reason and stop reason, as the engine would decide."""
        params = request.params
        eos = self.tokenizer.eos_token_ids[0]
        output: list[int] = []
        for token_id in [*self.script, eos]:
            output.append(token_id)
            can_stop = len(output) >= params.min_tokens
            if can_stop and not params.ignore_eos and token_id in self.tokenizer.eos_token_ids:
                return output, "stop", None
            if can_stop and token_id in params.stop_token_ids:
                return output, "stop", token_id
            if len(output) >= params.max_tokens:
                return output, "length", None
        return output, "length", None

    @staticmethod
    def _logprobs(request: GenerateRequest, ids: tuple[int, ...]) -> tuple[TokenLogprobs, ...]:
        """Made-up logprobs: the token's is -id/1000, its alternatives the next ids, each 1 lower."""
        n = request.params.logprobs
        if n is None:
            return ()
        return tuple(TokenLogprobs(t, -t / 1000, tuple((t + k, -t / 1000 - k) for k in range(n))) for t in ids)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.requests.append(request)
        output, finish_reason, stop_reason = self._tokens(request)
        num_prompt = len(request.prompt_token_ids)
        try:
            for n, start in enumerate(range(0, len(output), self.tokens_per_chunk)):
                await asyncio.sleep(3600 if n == self.stall_after else self.delay_s)
                if self.error is not None and n == self.error_after:
                    raise self.error
                if self.abort_after is not None and n == self.abort_after:
                    yield GenerateChunk((), "abort", None, num_prompt, self.num_cached_tokens)
                    return
                ids = tuple(output[start:start + self.tokens_per_chunk])
                last = start + self.tokens_per_chunk >= len(output)
                yield GenerateChunk(ids, finish_reason if last else None, stop_reason if last else None,
                                    num_prompt, self.num_cached_tokens, self._logprobs(request, ids))
            self.finished.append(request.request_id)
        except (GeneratorExit, asyncio.CancelledError):
            await asyncio.sleep(0.01)  # cleanup may await (the real backend sends cancel RPCs)
            self.closed.append(request.request_id)
            raise
        finally:
            self.ended.set()


class ServerThread:
    """uvicorn serving ``app`` on a free local port from a background thread."""

    def __init__(self, app) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                return self
            self.thread.join(0.01)
        raise RuntimeError("uvicorn did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        self.socket.close()



def openai_error(call, *words: str, status=openai.BadRequestError) -> dict:
    """Run ``call`` (an openai SDK call) expecting ``status``; its error body, whose message
    must hold every one of ``words``."""
    with pytest.raises(status) as info:
        call()
    message = info.value.body["message"]
    assert all(word in message for word in words), message
    return info.value.body
