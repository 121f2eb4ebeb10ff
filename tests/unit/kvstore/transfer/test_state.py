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
