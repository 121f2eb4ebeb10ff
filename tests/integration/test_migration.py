"""A decode instance that dies or freezes mid-stream: the client's stream goes on, token for token.

Real processes (``epd up``'s own code): 1 prefill, 2 decodes, a KV store node, the tiny chat
model, in each precision the machine computes natively (tests/factories.machine_dtypes). Each
case is first run undisturbed, then again while the decode instance serving it is frozen and
killed (SIGSTOP, then SIGKILL: no token leaves it after the router has read a few) or only
frozen; the second client stream must equal the first, usage and logprobs included, bit for bit:
the resumed instance computes the output tail again as the decode steps did (attention's
role rule). Four streams at once, one of their decodes killed, equal both the same four run
undisturbed and each run alone (the CPU's kernels are batch-invariant).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from tests.cluster import running_cluster
from tests.factories import machine_dtypes

pytestmark = pytest.mark.timeout(300)

IDLE_TIMEOUT_S = 2.0
AFTER_CHUNKS = 150
"""The fault comes after this many chunks: several blocks of output are in the KV store by then."""
PROMPT = "Write a very long story about a lighthouse keeper and the sea."
SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}, "chapters": {"type": "integer"}},
          "required": ["story", "chapters"], "additionalProperties": False}
CASES = {
    "greedy": {"temperature": 0, "max_tokens": 1200, "ignore_eos": True},
    "seeded": {"temperature": 0.8, "top_k": 20, "seed": 1234, "max_tokens": 1200, "ignore_eos": True},
    "json-schema": {"temperature": 0, "max_tokens": 1200,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}},
    "n=2": {"temperature": 0.8, "top_k": 20, "seed": 99, "n": 2, "max_tokens": 1200, "ignore_eos": True},
    "penalties-logprobs-stop": {"temperature": 0.7, "top_k": 20, "seed": 5, "presence_penalty": 0.6,
                                "frequency_penalty": 0.4, "repetition_penalty": 1.1, "logprobs": True,
                                "top_logprobs": 2, "stop": ["lighthouse keeper"], "max_tokens": 1200,
                                "ignore_eos": True},
}


@pytest.fixture(scope="module", params=machine_dtypes())
def cluster(request, tiny_chat_model_dir):
    os.environ["EPD_ROUTER_DECODE_IDLE_TIMEOUT_S"] = str(IDLE_TIMEOUT_S)
    try:
        with running_cluster(str(tiny_chat_model_dir), supervise=True, prefills=1, decodes=2, encoders=0,
                             kvstores=1, kv_cache_gib=0.05, dtype=request.param) as running:
            yield running
    finally:
        del os.environ["EPD_ROUTER_DECODE_IDLE_TIMEOUT_S"]


def body(case: str) -> dict:
    return {"model": "tiny-chat0", "messages": [{"role": "user", "content": PROMPT}], "stream": True,
            "stream_options": {"include_usage": True}, **CASES[case]}


def stream(url: str, request: dict, after_tokens=None) -> tuple[dict[int, str], dict, list[str], list[tuple]]:
    """(text per choice, usage, finish reasons, logprobs) of one streamed chat completion;
    ``after_tokens(n)`` is called once the stream has brought n > AFTER_CHUNKS content chunks."""
    texts: dict[int, str] = {}
    logprobs: list[tuple] = []
    usage, finishes, num_chunks, called = {}, [], 0, False
    with httpx.stream("POST", url + "/v1/chat/completions", json=request, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("usage"):  # (cached prompt tokens differ: a repeated prompt hits the cache)
                usage = {k: v for k, v in event["usage"].items() if k != "prompt_tokens_details"}
            for choice in event["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
                for entry in (choice.get("logprobs") or {}).get("content") or ():
                    logprobs.append((entry["token"], entry["logprob"],
                                     tuple(top["token"] for top in entry["top_logprobs"])))
                num_chunks += 1
                if choice.get("finish_reason"):
                    finishes.append(choice["finish_reason"])
            if after_tokens is not None and not called and num_chunks > AFTER_CHUNKS:
                called = True
                after_tokens(num_chunks)
    return texts, usage, finishes, logprobs


def assert_same_stream(disturbed: tuple, undisturbed: tuple) -> None:
    """Texts, usage, finish reasons, and every logprob (token, value, alternatives) equal: the
    recomputed tail attends as the decode steps it replaces did, so even the values are the same."""
    assert disturbed[:3] == undisturbed[:3], "the migrated stream differs from the undisturbed one"
    assert disturbed[3] == undisturbed[3], "the migrated stream's logprobs differ from the undisturbed one's"


def serving_decode(cluster):
    """The decode child that runs the cluster's one request (its load report says so)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        busy = [r.instance_id for r in cluster.loads() if r.role == "decode" and r.num_running]
        if busy:
            return next(c for c in cluster.cluster.children if c.name == busy[0])
        time.sleep(0.01)
    raise AssertionError("no decode instance reports the request as running")


def router_metric(cluster, name: str, **labels: str) -> float:
    return cluster.metric("router", name, **labels)


def resumed(cluster, name: str, source: str = "cached") -> float:
    """Context tokens of requests resumed on decode instance ``name``, by where their KV came from."""
    return cluster.metric(name, "epd_decode_resumed_tokens_total", source=source)


def wait_for_decodes(cluster, num: int = 2) -> None:
    """Until ``num`` decode instances answer (a killed one restarted by the supervisor)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            if sum(r.role == "decode" for r in cluster.loads()) >= num:
                return
        except grpc.RpcError:  # alive, not serving yet
            pass
        assert time.monotonic() < deadline, "the killed decode instance did not come back"
        time.sleep(0.1)


@pytest.mark.parametrize("case", list(CASES))
def test_a_killed_decode_mid_stream_resumes_token_identical(cluster, case):
    wait_for_decodes(cluster)
    undisturbed = stream(cluster.url, body(case))
    assert len(undisturbed[2]) == CASES[case].get("n", 1)
    assert bool(undisturbed[3]) is bool(CASES[case].get("logprobs"))
    moved_before = router_metric(cluster, "epd_router_migrations_total", outcome="moved")
    decodes = [c.name for c in cluster.cluster.children if c.name.startswith("decode")]
    cached_before = {name: resumed(cluster, name) for name in decodes}
    recomputed_before = {name: resumed(cluster, name, "recomputed") for name in decodes}
    killed = []

    def kill(num_chunks: int) -> None:
        child = serving_decode(cluster)
        os.kill(child.process.pid, signal.SIGSTOP)   # nothing more leaves it ...
        os.kill(child.process.pid, signal.SIGKILL)   # ... then it is gone
        child.process.wait()
        killed.append(child.name)

    disturbed = stream(cluster.url, body(case), after_tokens=kill)
    assert killed, "the stream ended before a decode instance could be killed"
    assert_same_stream(disturbed, undisturbed)
    assert router_metric(cluster, "epd_router_migrations_total", outcome="moved") > moved_before
    # The survivor resumed from the KV store: the prompt and nearly all output came from there.
    cached = sum(resumed(cluster, name) - cached_before[name] for name in decodes if name not in killed)
    recomputed = sum(resumed(cluster, name, "recomputed") - recomputed_before[name]
                     for name in decodes if name not in killed)
    print(f"resumed context: {cached:.0f} tokens cached, {recomputed:.0f} recomputed")
    # Written back block by block as it ran: only the tail is recomputed (its last, partial
    # block; a block or so more when the last write was still in flight; per choice).
    assert cached >= 16 * 4, f"only {cached} tokens of the resumed context were cached"
    assert recomputed <= 4 * 16 * CASES[case].get("n", 1), f"{recomputed} tokens were recomputed"
    wait_for_decodes(cluster)
    assert cluster.leftovers() == []


FOUR = [{**body(case), "messages": [{"role": "user", "content": prompt}], "logprobs": True, "top_logprobs": 2,
         "max_tokens": 400}
        for case, prompt in (("greedy", PROMPT), ("seeded", "Describe a storm at sea, at length."),
                             ("greedy", "Tell me about lighthouses, in detail."),
                             ("seeded", "Write a long letter from a keeper to his sister."))]
"""Four streams at once: two greedy, two seeded, each its own prompt, with logprobs."""


def stream_all(url: str, requests: list[dict], after_tokens=None) -> list[tuple]:
    """The streams of ``requests`` run at once; ``after_tokens`` is called once, by the first to
    pass AFTER_CHUNKS."""
    once = threading.Lock()
    called = []

    def first(num_chunks: int) -> None:
        with once:
            if not called:
                called.append(num_chunks)
                after_tokens(num_chunks)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: stream(url, r, first if after_tokens else None), requests))


def test_a_killed_decode_under_four_streams_resumes_each_as_it_ran_together_and_alone(cluster):
    wait_for_decodes(cluster)
    alone = [stream(cluster.url, r) for r in FOUR]
    together = stream_all(cluster.url, FOUR)
    for got, want in zip(together, alone):
        assert_same_stream(got, want)   # batched or alone: the same bits
    killed = []

    def kill(num_chunks: int) -> None:
        child = serving_decode(cluster)
        os.kill(child.process.pid, signal.SIGKILL)
        child.process.wait()
        killed.append(child.name)

    disturbed = stream_all(cluster.url, FOUR, after_tokens=kill)
    assert killed, "the streams ended before a decode instance could be killed"
    for got, want in zip(disturbed, together):
        assert_same_stream(got, want)
    wait_for_decodes(cluster)
    assert cluster.leftovers() == []


def test_a_frozen_decode_loses_its_streams_within_the_idle_deadline(cluster):
    case = "greedy"
    wait_for_decodes(cluster)
    undisturbed = stream(cluster.url, body(case))
    frozen = []

    def freeze(num_chunks: int) -> None:
        child = serving_decode(cluster)
        os.kill(child.process.pid, signal.SIGSTOP)
        frozen.append((child, time.monotonic()))

    try:
        started = time.monotonic()
        disturbed = stream(cluster.url, body(case), after_tokens=freeze)
        finished = time.monotonic()
        assert frozen, "the stream ended before a decode instance could be frozen"
        assert_same_stream(disturbed, undisturbed)
        # Moved on after the idle deadline, not after the freeze ended (the test thaws it later).
        assert finished - frozen[0][1] < IDLE_TIMEOUT_S + 30
        assert router_metric(cluster, "epd_router_migrations_total", reason="silent", outcome="moved") >= 1
        assert finished - started < 60
    finally:
        for child, _ in frozen:
            os.kill(child.process.pid, signal.SIGCONT)
    # Thawed, the old instance finds its call cancelled and frees the request.
    assert cluster.leftovers() == []
