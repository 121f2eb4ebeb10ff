"""The engine seam the services use: lending blocks (hand-over, prefix exports) and taking them
in (reservations), each ended through the seam; a cancelled read never blocks the event loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvstore.transfer.descriptors import Endpoint, KVHandle
from kvstore.transfer.state import TransferOp
from services.common.sampling_params import SamplingParams
from services.engine.seams import Handoff
from services.engine.serving.instance import EngineInstance, ServingConfig
from services.engine.serving.seam import read_kv
from tests.factories import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BS = 16


class InFlightTransfer:
    """A transfer engine whose one read stays in flight until its worker (the test) ends it."""

    def __init__(self) -> None:
        self.op = TransferOp(1, 8)
        self.op.start()

    def read(self, handle, destinations) -> TransferOp:
        return self.op


def test_a_cancelled_read_waits_for_the_copy_to_stop_without_blocking_the_loop():
    async def main():
        transfer = InFlightTransfer()
        safety = threading.Timer(5.0, transfer.op.finish, args=("the test's safety stop",))
        safety.start()
        reader = asyncio.create_task(read_kv(transfer, KVHandle("l", Endpoint("h", ""), (), ()), []))
        await asyncio.sleep(0.01)
        reader.cancel()
        started = time.monotonic()
        await asyncio.sleep(0.05)
        assert time.monotonic() - started < 1.0, "the event loop was blocked"
        assert transfer.op.is_cancelled and not reader.done()  # the copy has not stopped yet
        reader.cancel()  # cancelled again: it still waits for the copy
        await asyncio.sleep(0.05)
        assert not reader.done()
        threading.Timer(0.02, transfer.op.finish, args=("cancelled",)).start()  # the worker stops
        with pytest.raises(asyncio.CancelledError):
            await reader
        safety.cancel()
        return transfer.op.error

    assert asyncio.run(main()) == "cancelled"


def test_lent_blocks_and_reservations_all_come_back_through_the_seam(tiny_llama_dir):
    prompt = random_prompts(1, [70], seed=3)[0]  # 4 full blocks and a partial one

    async def main():
        instance = EngineInstance(ServingConfig(model=str(tiny_llama_dir), num_kv_blocks=32, device="cpu"),
                                  "prefill")
        instance.start()
        seam = instance.seam
        try:
            stream = await seam.add_then_detach(prompt, GREEDY, "p")
            handoff = [item async for item in stream][-1]
            assert isinstance(handoff, Handoff) and len(handoff.block_ids) == 5
            export = await seam.export_handoff(handoff, "lease-1")
            assert export.handle.lease_id == "lease-1" and len(export.handle.blocks) == 5
            assert [b.length for b in export.handle.blocks] == [seam.block_bytes] * 5
            seam.release(export)
            seam.release(export)  # a second release is a no-op (a lease ends once, but still)

            hashes, num_local = await seam.prompt_hashes(prompt)
            assert (len(hashes), num_local) == (4, 4)
            assert await seam.export_prefix(prompt, hashes, 4, "put-1") is None  # nothing past block 4
            put = await seam.export_prefix(prompt, hashes, 1, "put-2")
            assert [b.offset for b in put.handle.blocks] == [i * seam.block_bytes for i in put.pinned.block_ids[1:]]
            seam.release(put)

            # Both kinds of reservation end through the same two calls.
            reservation = await seam.reserve_prefix(prompt, hashes, 4)
            assert (reservation.num_local_blocks, len(reservation.block_ids)) == (4, 4)
            await seam.recompute(reservation)
            held = await seam.add(prompt, GREEDY, "held", output_token_ids=(3,), hold_for_kv=True)
            reservation = await seam.reserve_held("held")
            assert (reservation.request_id, reservation.num_local_blocks, len(reservation.block_ids)) == ("held", 4, 5)
            await seam.recompute(reservation)  # (block 5 was never filled: computed here instead)
            outputs = [out async for out in held]
            assert len(outputs[-1].token_ids) == GREEDY.max_tokens and outputs[-1].num_cached_tokens == 4 * BS
            await instance.engine.call(lambda: None)  # the releases queued before it have run
        finally:
            await instance.close()

    asyncio.run(main())  # the no-leak check after the test sees every block free


def test_a_prompts_hashes_do_not_wait_for_the_running_step(tiny_llama_dir):
    """A request that arrives mid-step gets its hashes (and its store lookup) at once, so it can
    join the very next step: waiting for the step's end here made bursts prefill in waves."""
    prompt = random_prompts(1, [70], seed=3)[0]

    async def main():
        instance = EngineInstance(ServingConfig(model=str(tiny_llama_dir), num_kv_blocks=32, device="cpu"),
                                  "prefill")
        instance.start()
        seam, step_ends = instance.seam, threading.Event()
        try:
            stream = await seam.add_then_detach(prompt, GREEDY, "p")
            seam.release(await seam.export_handoff([item async for item in stream][-1], "lease"))
            running = asyncio.ensure_future(instance.engine.call(step_ends.wait))  # a step that lasts
            await asyncio.sleep(0.05)
            hashes, num_local = await asyncio.wait_for(seam.prompt_hashes(prompt), 5)
            assert not running.done() and (len(hashes), num_local) == (4, 4)
            step_ends.set()
            await running
            await instance.engine.call(lambda: None)
        finally:
            step_ends.set()
            await instance.close()

    asyncio.run(main())
