"""``epd up``'s children, kept running: one that dies is started again with the same command
line (so the same address and ports) while the others keep serving.

Life cycle of one child::

    spawn ── wait for health ──► up ── exits (any status, any signal) ──► down
      ▲                                                                     │ log it, remove its
      │                                                                     │ shared-memory pools
      └──── back-off: 0.5 s, doubling up to 30 s; 0.5 s again once ◄────────┘
            a run stayed up 60 s

A restart that does not come up (it exits, or is not healthy within the startup timeout and is
killed) is one more death: the back-off doubles and it is tried again, forever. The number of
restarts goes to the child in EPD_RESTART_COUNT (``services.common.metrics.restart_count``), which
it shows on /metrics and in its load report. Nothing else is stopped or restarted: the router
finds a restarted instance on its own (its load stream reconnects) and an instance finds a
restarted store node on its own (gRPC channels reconnect). Only the owner of the supervision
stops it, by setting the event given to :meth:`Supervisor.run`.

The children die with the launcher: PR_SET_PDEATHSIG sends them SIGTERM when the thread that
started them ends: the launcher's main thread in ``epd up``, or for a restart the thread of
:class:`BackgroundSupervision` once it is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from kvstore.transfer.memory import SHM_PREFIX
from services.common.metrics import RESTART_COUNT_ENV
from services.common.server import check_health

logger = logging.getLogger("epd.up")
SHM_DIR = "/dev/shm"  # where MemoryRegion puts KV pools by default
_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"          # PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"     # the parent died before that
    "os.execv(sys.argv[2], sys.argv[2:])\n")
"""Run first in a child, before its real program (the signal setting survives the exec). Not a
``preexec_fn``: that runs Python between fork and exec, where gRPC's threads in the launcher
(health checks) have left locks and pollers in a state the child cannot use; children then died
of SIGABRT while starting, now and then. Without it the child is started by vfork and exec."""


class ChildFailed(RuntimeError):
    """A child exited, or did not become healthy in time, while it was starting."""


def remove_shared_memory_of(pid: int) -> None:
    """A child that was killed could not unlink its KV pool from /dev/shm: do it for it (its
    restart would too, in MemoryRegion.allocate, but the memory is free sooner this way)."""
    for path in glob.glob(os.path.join(SHM_DIR, f"{SHM_PREFIX}{pid}-*")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@dataclass(frozen=True)
class Probe:
    """How to tell a child is up: the standard gRPC health of ``grpc_service`` at its address
    is SERVING, or ``http_url`` answers 200."""

    grpc_service: str = ""
    http_url: str = ""

    async def is_healthy(self, address: str) -> bool:
        if not self.http_url:
            return await check_health(address, self.grpc_service, timeout_s=1.0) == "SERVING"
        try:
            async with httpx.AsyncClient() as client:
                return (await client.get(self.http_url, timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False


@dataclass(frozen=True)
class Backoff:
    """The wait before restarting a child: ``initial_s``, doubling after each quick death up to
    ``max_s``; ``initial_s`` again after a run that stayed healthy ``reset_after_s``."""

    initial_s: float = 0.5
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def next_delay(self, last_delay_s: float, up_for_s: float) -> float:
        """``up_for_s``: how long the run that just ended was healthy (0: it never was)."""
        if last_delay_s <= 0 or up_for_s >= self.reset_after_s:
            return self.initial_s
        return min(self.max_s, 2 * last_delay_s)


@dataclass
class Child:
    """One supervised process slot: what to run, and the process running it now."""

    name: str
    address: str
    argv: list[str]
    probe: Probe
    metrics_url: str = ""
    env: dict[str, str] = field(default_factory=dict, repr=False)
    """Set on top of the launcher's own environment (which the child inherits)."""
    process: subprocess.Popen | None = None
    num_restarts: int = 0
    healthy_since: float | None = None
    """time.monotonic() when the running process was found healthy; None: not (yet)."""
    delay_s: float = 0.0
    """The last back-off waited before a restart (0: never restarted)."""

    def spawn(self) -> subprocess.Popen:
        env = {**os.environ, **self.env, RESTART_COUNT_ENV: str(self.num_restarts)}
        self.process = subprocess.Popen([sys.executable, "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *self.argv],
                                        env=env)
        self.healthy_since = None
        return self.process

    async def wait_healthy(self, timeout_s: float) -> None:
        """Return once the child answers its probe; ChildFailed if it exits or times out first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ChildFailed(f"{self.name} exited with status {self.process.returncode} while starting")
            if await self.probe.is_healthy(self.address):
                self.healthy_since = time.monotonic()
                return
            await asyncio.sleep(0.1)
        raise ChildFailed(f"{self.name} was not healthy within {timeout_s:.0f} s")


class Supervisor:
    """Watches ``children`` (already started) and restarts each one that dies, each restart in
    its own task so a slow one holds up no other."""

    def __init__(self, children: list[Child], startup_timeout_s: float, backoff: Backoff = Backoff(),
                 poll_s: float = 0.1) -> None:
        self.children = children
        self.startup_timeout_s = startup_timeout_s
        self.backoff = backoff
        self.poll_s = poll_s

    async def run(self, stop: asyncio.Event) -> None:
        """Supervise until ``stop`` is set; restarts in progress are then abandoned (a process
        they started stays in its child's ``process``, for the owner to stop)."""
        restarting: dict[str, asyncio.Task[None]] = {}
        try:
            while not stop.is_set():
                for child in self.children:
                    if child.name not in restarting and child.process.poll() is not None:
                        restarting[child.name] = asyncio.create_task(self._restart(child), name=child.name)
                for name in [name for name, task in restarting.items() if task.done()]:
                    restarting.pop(name).result()  # a bug in _restart surfaces here
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.poll_s)
        finally:
            for task in restarting.values():
                task.cancel()
            await asyncio.gather(*restarting.values(), return_exceptions=True)

    async def _restart(self, child: Child) -> None:
        dead = child.process
        up_for_s = 0.0 if child.healthy_since is None else time.monotonic() - child.healthy_since
        child.healthy_since = None
        logger.error("%s (pid %d) exited with status %s after %.1f s up", child.name, dead.pid,
                     dead.returncode, up_for_s)
        remove_shared_memory_of(dead.pid)
        while True:
            child.delay_s = self.backoff.next_delay(child.delay_s, up_for_s)
            logger.warning("restarting %s in %.1f s (restart %d)", child.name, child.delay_s, child.num_restarts + 1)
            await asyncio.sleep(child.delay_s)
            child.num_restarts += 1
            started = time.monotonic()
            try:
                child.spawn()
                await child.wait_healthy(self.startup_timeout_s)
            except (ChildFailed, OSError) as exc:  # OSError: it could not even be started (fork, exec)
                logger.error("restart %d of %s failed: %s", child.num_restarts, child.name, exc)
                if child.process.poll() is None:
                    child.process.kill()
                    await asyncio.to_thread(child.process.wait)
                remove_shared_memory_of(child.process.pid)
                up_for_s = 0.0
                continue
            logger.warning("%s is back: pid %d, restart %d, healthy %.1f s after its start", child.name,
                           child.process.pid, child.num_restarts, time.monotonic() - started)
            return


class BackgroundSupervision:
    """:meth:`Supervisor.run` in a thread of its own, with its own event loop: for a caller that
    has no loop running (tests drive a started cluster from plain threads).

    The processes it restarts are its thread's children as far as PR_SET_PDEATHSIG goes (the
    kernel sends them SIGTERM when the thread that forked them ends), so the thread outlives
    :meth:`stop` until :meth:`close`: their owner stops them in between, each with one SIGTERM
    and its full drain."""

    def __init__(self, supervisor: Supervisor) -> None:
        """``supervisor``: a Supervisor, or anything else with ``async run(stop: asyncio.Event)``."""
        self._supervisor = supervisor
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready, self._stopped, self._released = threading.Event(), threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._main, name="epd-supervisor", daemon=True)

    def start(self) -> BackgroundSupervision:
        self._thread.start()
        self._ready.wait()
        return self

    def _main(self) -> None:
        try:
            asyncio.run(self._supervise())
        finally:
            self._stopped.set()
            self._released.wait()

    async def _supervise(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        await self._supervisor.run(self._stop)

    def stop(self) -> None:
        """No restart from now on: returns once supervision has ended."""
        if self._loop is None:
            return  # never started
        with contextlib.suppress(RuntimeError):  # the loop already closed: run() ended by itself
            self._loop.call_soon_threadsafe(self._stop.set)
        self._stopped.wait()

    def close(self) -> None:
        """Stop, and let the thread end (SIGTERM to any child it started that still runs)."""
        self.stop()
        self._released.set()
        if self._thread.ident is not None:
            self._thread.join()
