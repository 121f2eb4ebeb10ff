from __future__ import annotations

from kvstore.transfer import TransferOp, TransferState


def test_progression_to_done():
    op = TransferOp(num_blocks=2, num_bytes=16)
    assert op.poll() is TransferState.WAITING
    assert op.start()
    assert op.poll() is TransferState.TRANSFERRING
    op.finish()
    assert op.poll() is TransferState.DONE and op.error is None
    assert op.wait(0) is TransferState.DONE


def test_failure_keeps_the_first_outcome():
    op = TransferOp(1, 8)
    op.start()
    op.finish("peer died")
    op.finish()
    assert op.poll() is TransferState.FAILED and op.error == "peer died"


def test_cancel_before_start_fails_at_once_and_never_starts():
    op = TransferOp(1, 8)
    op.cancel()
    assert op.poll() is TransferState.FAILED and op.error == "cancelled"
    assert not op.start()


def test_cancel_while_transferring_is_a_request_to_the_worker():
    op = TransferOp(1, 8)
    op.start()
    op.cancel()
    assert op.is_cancelled and op.poll() is TransferState.TRANSFERRING


def test_wait_times_out_without_a_final_state():
    assert TransferOp(1, 8).wait(0.01) is TransferState.WAITING


def test_done_callbacks_run_once_even_when_added_late():
    seen = []
    op = TransferOp(1, 8)
    op.add_done_callback(lambda o: seen.append(("early", o.poll())))
    op.start()
    op.finish()
    op.finish("again")
    op.add_done_callback(lambda o: seen.append(("late", o.poll())))
    assert seen == [("early", TransferState.DONE), ("late", TransferState.DONE)]


def test_failed_constructor():
    op = TransferOp.failed("no route")
    assert op.poll() is TransferState.FAILED and op.error == "no route"


def test_finished_is_woken_by_the_workers_final_transition():
    import asyncio
    import threading

    async def main():
        op = TransferOp(1, 8)
        op.start()
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        ticker = asyncio.create_task(tick())
        threading.Timer(0.05, op.finish).start()  # the worker ends it from its own thread
        state = await asyncio.wait_for(op.finished(), 5)
        ticker.cancel()
        return state, ticks, await op.finished()

    state, ticks, again = asyncio.run(main())
    assert state is again is TransferState.DONE
    assert ticks > 5  # the loop kept running while the op was in flight


def test_a_cancelled_wait_leaves_the_transfer_running_and_a_broken_callback_harms_no_other():
    import asyncio

    async def main():
        op = TransferOp(1, 8)
        op.start()
        waiter = asyncio.create_task(op.finished())
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert op.poll() is TransferState.TRANSFERRING and not op.is_cancelled
        seen = []
        op.add_done_callback(lambda o: 1 / 0)
        op.add_done_callback(lambda o: seen.append(o.poll()))
        second = asyncio.create_task(op.finished())
        await asyncio.sleep(0)
        op.finish("peer died")
        return seen, await second

    assert asyncio.run(main()) == ([TransferState.FAILED], TransferState.FAILED)
