"""A client that goes away must close the backend iterator promptly (that is the cancel signal)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.unit.router.conftest import SCRIPT_TEXT

BODY = {"model": "test-model", "messages": [{"role": "user", "content": "Tell me everything."}]}
PROMPT = "Tell me everything."


@pytest.fixture
def slow_backend(make_backend):
    # ~20 tokens a second for minutes: it only ends early if the router closes it.
    return make_backend(SCRIPT_TEXT * 50, delay_s=0.05)


def assert_closed_soon(backend, seconds: float = 2.0) -> None:
    assert backend.ended.wait(seconds), "the backend iterator was not closed after the client left"
    assert backend.closed == [backend.requests[0].request_id] and backend.finished == []


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", BODY),
                                        ("/v1/completions", {"model": "test-model", "prompt": PROMPT})])
def test_disconnect_mid_stream(serve, slow_backend, path, body):
    url = serve(slow_backend)
    with httpx.Client(timeout=5) as client:
        with client.stream("POST", url + path, json={**body, "stream": True}) as response:
            lines = response.iter_lines()
            texts = []
            while len(texts) < 3:
                line = next(lines)
                if line.startswith("data: {"):
                    texts.append(json.loads(line[6:]))
    left_at = time.monotonic()
    assert_closed_soon(slow_backend)
    assert time.monotonic() - left_at < 2


def test_disconnect_while_the_backend_is_silent(serve, make_backend):
    """No chunk to send means no failed send to notice the disconnect by: the router must watch."""
    backend = make_backend(stall_after=3)
    url = serve(backend)
    with httpx.Client(timeout=5) as client:
        with client.stream("POST", url + "/v1/chat/completions", json={**BODY, "stream": True}) as response:
            lines = response.iter_lines()
            events = [line for line in (next(lines) for _ in range(6)) if line]
    assert len(events) == 3 and all(event.startswith("data: {") for event in events)
    assert_closed_soon(backend)


def test_disconnect_during_non_streaming_request(serve, slow_backend):
    url = serve(slow_backend)
    with httpx.Client(timeout=0.5) as client, pytest.raises(httpx.ReadTimeout):
        client.post(url + "/v1/chat/completions", json=BODY)
    assert_closed_soon(slow_backend)


def test_disconnect_before_the_first_token(serve, make_backend):
    backend = make_backend(delay_s=30)  # a very slow prefill
    url = serve(backend)
    with httpx.Client(timeout=0.5) as client, pytest.raises(httpx.ReadTimeout):
        client.post(url + "/v1/chat/completions", json={**BODY, "stream": True})
    assert_closed_soon(backend)


def test_abandoned_requests_are_counted(serve, slow_backend):
    url = serve(slow_backend)
    with httpx.Client(timeout=0.5) as client, pytest.raises(httpx.ReadTimeout):
        client.post(url + "/v1/chat/completions", json=BODY)
    assert_closed_soon(slow_backend)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:  # the handler records after the backend closed
        metrics = httpx.get(url + "/metrics").text
        if 'endpoint="/v1/chat/completions",status="499"' in metrics:
            return
        time.sleep(0.05)
    pytest.fail("no 499 in /metrics")
