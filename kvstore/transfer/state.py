"""Per-request transfer state machine (STYLE rule 8)::

    WAITING --(a worker picks it up)--> TRANSFERRING --+--> DONE
       |                                    |          +--> FAILED (error says why)
       +------------- cancel() -------------+------------> FAILED ("cancelled")

Workers drive it; the caller only calls ``poll()``, which never blocks, or (an asyncio loop)
awaits ``finished()``, which the worker's final transition wakes: no polling on the loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class TransferState(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


class TransferOp:
    def __init__(self, num_blocks: int, num_bytes: int):
        self.num_blocks = num_blocks
        self.num_bytes = num_bytes
        self._state = TransferState.WAITING
        self._error: str | None = None
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._is_cancelled = False
        self._callbacks: list[Callable[[TransferOp], None]] = []

    @classmethod
    def failed(cls, error: str) -> TransferOp:
        op = cls(0, 0)
        op.finish(error)
        return op

    def poll(self) -> TransferState:
        return self._state

    @property
    def error(self) -> str | None:
        return self._error

    def wait(self, timeout: float | None = None) -> TransferState:
        """Block until final or ``timeout`` seconds pass; returns the state either way."""
        self._finished.wait(timeout)
        return self._state

    async def finished(self) -> TransferState:
        """Wait for the final state without blocking the event loop: the worker's final
        transition wakes the loop (``call_soon_threadsafe``). Cancelling this wait does not
        cancel the transfer (:meth:`cancel` does)."""
        if self._state.is_final:
            return self._state
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def wake(_: TransferOp) -> None:
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                pass

        self.add_done_callback(wake)
        await future
        return self._state

    def cancel(self) -> None:
        """Ask the worker to stop; a transfer not yet started fails at once."""
        with self._lock:
            self._is_cancelled = True
            is_waiting = self._state is TransferState.WAITING
        if is_waiting:
            self.finish("cancelled")

    @property
    def is_cancelled(self) -> bool:
        return self._is_cancelled

    def add_done_callback(self, callback: Callable[[TransferOp], None]) -> None:
        """Run ``callback(op)`` once final, on the worker thread (asyncio: call_soon_threadsafe)."""
        with self._lock:
            if not self._state.is_final:
                self._callbacks.append(callback)
                return
        callback(self)

    # Driven by the transport's worker.

    def start(self) -> bool:
        """WAITING -> TRANSFERRING; False if it was cancelled (or failed) before starting."""
        with self._lock:
            if self._state is not TransferState.WAITING or self._is_cancelled:
                return False
            self._state = TransferState.TRANSFERRING
            return True

    def finish(self, error: str | None = None) -> None:
        """Final transition (first call wins): DONE, or FAILED when ``error`` is given."""
        with self._lock:
            if self._state.is_final:
                return
            self._error = error
            self._state = TransferState.FAILED if error is not None else TransferState.DONE
            callbacks, self._callbacks = self._callbacks, []
        self._finished.set()
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - one broken callback must not starve the others
                log.exception("a transfer's done callback failed")

    def __repr__(self) -> str:
        return f"TransferOp({self._state.value}, {self.num_blocks} blocks, {self.num_bytes} B, error={self._error!r})"


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
