"""The engine thread behind the services: streams, early close, hand-off, a dead engine."""

from __future__ import annotations

import asyncio

import pytest

from services.engine import LLM, SamplingParams
from services.engine.serving.async_engine import AsyncEngine, EngineDeadError
from services.engine.seams import Handoff
from tests.factories import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=128)


async def collect(stream) -> list:
    return [item async for item in stream]


def test_concurrent_streams_equal_offline_generate(llm):
    prompts = random_prompts(4, [5, 40, 100, 17], seed=2)
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]

    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            streams = [await engine.add(p, GREEDY, f"s{i}") for i, p in enumerate(prompts)]
            results = await asyncio.gather(*(collect(s) for s in streams))
        finally:
            await engine.stop()
        return [r[-1].token_ids for r in results], [len(r) for r in results]

    tokens, counts = asyncio.run(main())
    assert tokens == expected and counts == [8] * 4


def test_closing_a_stream_aborts_and_detach_hands_off(llm):
    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            stream = await engine.add(random_prompts(1, [50])[0], SamplingParams(max_tokens=1000, ignore_eos=True), "a")
            await stream.__anext__()
            await stream.aclose()
            handoff_stream = await engine.add(random_prompts(1, [40])[0], GREEDY, "b",
                                              detach_after_first_token=True)
            items = await collect(handoff_stream)
            assert isinstance(items[-1], Handoff) and len(items[-1].prompt_token_ids) == 40
            await engine.call(llm.engine.release_handoff, items[-1])
            # A hand-off whose reader left before reading it is released by the engine.
            orphan = await engine.add(random_prompts(1, [40])[0], GREEDY, "c", detach_after_first_token=True)
            await asyncio.sleep(0.5)
            await orphan.aclose()
            await engine.call(lambda: None)
            await engine.call(lambda: None)
        finally:
            await engine.stop()

    asyncio.run(main())  # the autouse fixture asserts every block is free


def test_a_failing_step_fails_every_stream(llm, monkeypatch):
    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
        monkeypatch.setattr(llm.engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
        stream = await engine.add([5, 6, 7], GREEDY, "x")
        with pytest.raises(EngineDeadError):
            await collect(stream)
        with pytest.raises(EngineDeadError):
            await engine.add([5, 6, 7], GREEDY, "y")
        await engine.stop()
        monkeypatch.undo()
        llm.engine.abort_request("x")

    asyncio.run(main())


def test_a_caller_that_leaves_while_its_add_is_queued_leaves_nothing_behind(llm):
    """The add still runs on the engine thread after its caller was cancelled (a client that
    disconnects while decode adds its request): the request must not stay held (load reports
    count held requests as running) or run for nobody."""
    import threading

    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
        busy = threading.Event()
        try:
            engine.call_soon(busy.wait)  # the engine thread is in a step: the add waits in the queue
            adds = [asyncio.create_task(engine.add(random_prompts(1, [40])[0], GREEDY, f"left-{i}",
                                                   output_token_ids=(5,), hold_for_kv=hold))
                    for i, hold in enumerate((True, False))]
            await asyncio.sleep(0.05)
            for add in adds:
                add.cancel()
            busy.set()
            for add in adds:
                with pytest.raises(asyncio.CancelledError):
                    await add
            await engine.call(lambda: None)
            return engine.num_open_streams
        finally:
            busy.set()
            await engine.stop()

    assert asyncio.run(main()) == 0
    stats = llm.engine.stats()  # (the engine thread has stopped)
    assert (stats.num_running, stats.num_waiting, stats.num_held) == (0, 0, 0)


def test_a_hand_off_detached_as_the_engine_stops_is_still_released(llm, monkeypatch):
    """The last step can detach a request whose reader has left: its release is queued behind
    the stop, and must still run (or the hand-off pins its blocks for good)."""
    import threading

    detaching = threading.Event()
    detach = llm.engine.detach

    def slow_detach(request_id):
        detaching.wait()  # (until the stop is queued)
        return detach(request_id)

    monkeypatch.setattr(llm.engine, "detach", slow_detach)

    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
        stream = await engine.add(random_prompts(1, [40])[0], GREEDY, "left", detach_after_first_token=True)
        await stream.aclose()  # the reader leaves while the step that detaches it runs
        stopping = asyncio.create_task(engine.stop())
        await asyncio.sleep(0.05)
        detaching.set()
        await stopping

    asyncio.run(main())
    assert llm.engine._num_handoff_blocks == 0 and not llm.engine._has_lent_blocks()
