"""The engine behind a service: an :class:`LLMEngine` on its own thread, driven from asyncio.

The engine is not thread-safe and a step can take seconds on a CPU, so it gets one thread
that alternates between running queued calls and running steps::

    asyncio callers --call()/call_soon()--> command queue --> [engine thread]
                                                                run every queued call
                                                                step() if anything is running
    per-request asyncio.Queue <--outputs (call_soon_threadsafe)----+

Every mutation of the engine (add, abort, detach, KV hand-over) therefore happens between
steps, and the event loop never blocks on the model. If a step raises, the engine is dead:
every open stream gets the error and :attr:`error` is set, so the service exits non-zero.

Services do not call into the engine through this directly: :class:`~services.engine.serving.seam.EngineSeam`
names every call they make.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from services.common.sampling_params import SamplingParams
from services.engine.engine import EngineStats, LLMEngine
from services.engine.seams import Handoff
from services.engine.outputs import RequestOutput
from services.engine.sequence import MultiModalInput

logger = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_WAIT_S = 0.05


class EngineDeadError(RuntimeError):
    """The engine thread failed; the process should exit and be restarted."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, num_step_samples: int = 32) -> None:
        self.engine = engine
        self.error: BaseException | None = None
        self.step_time_samples: deque[tuple[int, float]] = deque(maxlen=num_step_samples)
        """(tokens in the step, seconds) of recent steps: the load reports carry them."""
        self.stats: EngineStats = engine.stats()
        """Refreshed by the engine thread after every round of calls and steps."""
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._detach_after_first_token: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ----- life cycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        if self.engine.grammar_compiler is not None:
            threading.Thread(target=self.engine.grammar_compiler.warm_up, name="grammar-warm-up", daemon=True).start()

    async def stop(self) -> None:
        """Stop the engine thread; what was queued behind the stop still runs, here (the last
        step can hand back a hand-off whose reader had left: its release comes after the stop).
        A dead engine runs nothing more."""
        if self._thread is not None:
            self._commands.put(None)
            await asyncio.to_thread(self._thread.join)
            self._thread = None
            while self.error is None:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    return
                if command is not None:
                    command()

    # ----- calls into the engine -----------------------------------------------------------
    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine thread between steps; its result or its exception."""
        self._check_alive()
        future: asyncio.Future = self._loop.create_future()

        def command() -> None:
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self._loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                self._loop.call_soon_threadsafe(_set_result, future, result)

        self._commands.put(command)
        return await future

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` for the engine thread without waiting (safe from any thread)."""
        self._commands.put(lambda: fn(*args))

    async def add(self, prompt: list[int], params: SamplingParams, request_id: str,
                  output_token_ids: tuple[int, ...] = (), hold_for_kv: bool = False,
                  detach_after_first_token: bool = False,
                  mm_inputs: tuple[MultiModalInput, ...] = (), cache_salt: str = "") -> "RequestStream":
        """Add a request (see :meth:`LLMEngine.add_request`); its outputs arrive on the stream.

        With ``detach_after_first_token`` the request leaves the engine right after its first
        token unless that token finished it, and the stream's last item is its :class:`Handoff`.
        A structured-output grammar is compiled first, in a worker thread: the engine keeps
        stepping the other requests meanwhile, and this one joins it ready to run.
        """
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        added: list[str] = []
        try:
            grammar = None
            if params.structured is not None:
                self._check_alive()
                grammar = await asyncio.to_thread(self.engine.compile_grammar, params.structured)
            await self.call(self._add, prompt, params, request_id, output_token_ids, hold_for_kv,
                            detach_after_first_token, mm_inputs, cache_salt, grammar, added)
        except BaseException:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            # A caller cancelled while its add waited in the queue leaves the add to run anyway:
            # abort what it added, right behind it (a held request would count as load forever).
            self.call_soon(self._abort_added, added)
            raise
        return stream

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    # ----- the engine thread ---------------------------------------------------------------
    def _add(self, prompt, params, request_id, output_token_ids, hold_for_kv, detach, mm_inputs,
             cache_salt, grammar, added: list[str]) -> None:
        self.engine.add_request(prompt, params, request_id, output_token_ids, hold_for_kv, mm_inputs,
                                cache_salt, grammar)
        added.append(request_id)
        if detach:
            self._detach_after_first_token.add(request_id)

    def _abort_added(self, added: list[str]) -> None:
        """Abort the request an add whose caller left did add (nothing if the add failed: the
        id may belong to another request)."""
        for request_id in added:
            self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        self._detach_after_first_token.discard(request_id)
        self.engine.abort_request(request_id)

    def _run(self) -> None:
        try:
            while True:
                for command in self._queued_commands():
                    if command is None:
                        return
                    command()
                if self.engine.has_unfinished_requests():
                    self._step()
                self.stats = self.engine.stats()
        except BaseException as exc:  # noqa: BLE001 - a dead engine fails every stream
            logger.exception("engine thread failed")
            self.error = exc
            self._loop.call_soon_threadsafe(self._fail_streams, exc)

    def _queued_commands(self) -> list[Callable[[], None] | None]:
        """Every queued command up to the stop, if one is queued (what comes after it is
        :meth:`stop`'s to run); waits a little for one when the engine is idle, or when its
        last step could schedule nothing (its requests wait for blocks another engine holds)."""
        commands = []
        if not self.engine.has_unfinished_requests() or self.engine.last_step_num_tokens == 0:
            try:
                commands.append(self._commands.get(timeout=_IDLE_WAIT_S))
            except queue.Empty:
                return commands
        while not commands or commands[-1] is not None:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        return commands

    def _step(self) -> None:
        start = time.perf_counter()
        outputs = self.engine.step()
        if self.engine.last_step_num_tokens:
            self.step_time_samples.append((self.engine.last_step_num_tokens, time.perf_counter() - start))
        for out in outputs:
            item: RequestOutput | Handoff = out
            if out.request_id in self._detach_after_first_token:
                self._detach_after_first_token.discard(out.request_id)
                if not out.finished:
                    item = self.engine.detach(out.request_id)
            self._loop.call_soon_threadsafe(self._deliver, out.request_id, item)

    # ----- on the event loop ---------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | Handoff) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(item)
        elif isinstance(item, Handoff):  # its reader left while it was being detached
            self.call_soon(self.engine.release_handoff, item)

    def _fail_streams(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(exc)

    def _close_stream(self, stream: "RequestStream", finished: bool) -> None:
        self._streams.pop(stream.request_id, None)
        while not stream.queue.empty():  # a hand-off nobody will read: give its blocks back
            item = stream.queue.get_nowait()
            if isinstance(item, Handoff):
                self.call_soon(self.engine.release_handoff, item)
        if not finished and self.error is None:
            self.call_soon(self._abort, stream.request_id)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError("the engine failed") from self.error


class RequestStream:
    """One request's outputs (cumulative :class:`RequestOutput` s, or a final :class:`Handoff`).

    Iterate it to the end, or :meth:`aclose` it early: that aborts the request in the engine.
    """

    def __init__(self, owner: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self._owner = owner
        self._finished = False
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput | Handoff:
        if self._finished or self._closed:
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            await self.aclose()
            raise EngineDeadError("the engine failed") from item
        if isinstance(item, Handoff) or item.finished:
            self._finished = True
            await self.aclose()
        return item

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._owner._close_stream(self, self._finished)


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
