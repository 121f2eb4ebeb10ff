"""Where and at what priority a CPU engine computes: its team of OpenMP threads, one per CPU it
may use, each bound to its CPU, and the team's nice value.

An engine's products, element-wise ops and kernels run on the OpenMP team of the thread that
runs the model (torch, MKL and the C kernels share libgomp's). When a core is busy with another
process, every parallel region waits at its barrier for the thread that lost its core: ops of
microseconds then take milliseconds (measured: SiLU over a decode step's rows at ~3.7 ms a call
while another process ran). Binding each thread to a CPU of its own (as vLLM's CPU build does)
is for CPUs an engine has to itself (a pod's cpuset); where engines share CPUs, giving the one
that may wait a lower priority is what pays (below).

``cpu_threads`` (EngineConfig, ``--cpu-threads``):

    auto    the CPUs of this process's affinity mask (what ``taskset``, a container's cpuset or
            ``epd up`` gave it), one thread each, bound
    off     torch's own choice, unbound (as before this module)
    0-3,8   those CPUs (a subset of the mask), one thread each, bound

Binding is per thread that runs the model (the engine thread when serving, the caller's thread
offline), done on its first step, with the thread's priority (``nice``: Linux keeps one per
thread, and a thread takes its creator's, so the team libgomp then makes for it has it too).
Without the C kernels (no compiler) the thread count is still set, unbound.

Measured on the 2-core machine (quiet): bound or not, the offline benchmark's speed is the same
(54.2 and 54.2 tok/s bound, 52.7 and 56.2 unbound, alternated); while other processes load the
cores, bound threads cannot move off a busy core and lose (16.4 vs 24.8 tok/s). Under the serving
load of benchmarks/serving.py (epd up, 1 prefill + 1 decode, 8 concurrent chats), a core each
(``epd up --cpu-threads split``) gave 42.2 tok/s and time to first token p99 5.2 s; sharing both
cores unbound 39.5 tok/s and 5.5 s; sharing with the decode engine's threads at nice 10 (epd up's
default, ``--decode-nice``) 43.6-47.4 tok/s and 3.6-4.4 s, inter-token latency unchanged
(~150 ms): when both compete, prefill (whose steps set time to first token) goes first.
Later, on the AMD Zen 4 under aiperf (whose own process keeps a core busy), with the kernels
handing out work as threads come free and the wait policy below: prefill bound and decode
unbound (``epd up``'s default now, ``--cpu-threads prefill``) 56.4 tok/s, p99 5.54 s, inter-token
latency 96 ms; all unbound 46.3 tok/s, 7.07 s, 118 ms; all bound 33.9 tok/s, 5.17 s, 193 ms
(a bound decode thread on a busy core holds every short region of a decode step).

While they wait (at the end of a parallel region, for the next), libgomp's threads spin by
default (GOMP_SPINCOUNT 300,000) before they sleep. On cores shared with other work that spinning
takes the CPU from the very thread it waits for: seven 286-token prompts with the team's two
threads, a busy process in another session on the same two cores, took 6.25 s spinning, 4.89 s
with ``OMP_WAIT_POLICY=passive`` (sleeping at once) and 4.76 s on one thread; alone, 2.35 and
2.41 s. A server shares its cores at least with its own gRPC and transfer threads, and under
``epd up`` with the other engine, so the prefill and decode servers set passive where the
environment has no policy (:func:`sleep_when_idle`). Under benchmarks/serving.py's load (aiperf's
own process keeps a core busy), together with the kernels handing out work as threads come free:
55.2 against 48.0-48.8 tok/s, inter-token latency 99 against 116-119 ms (one run against two,
that one with the policy set for aiperf's processes too).
Offline, on cores of its own, a thread that is woken rather than spinning costs each of a decode
step's many short regions: the offline benchmark (bound, alternated) ran 39.0, 41.0 and 39.1 s
passive against 37.2, 38.6 and 38.1 s spinning, so LLM leaves libgomp's default.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from services.common.errors import InvalidRequestError

logger = logging.getLogger(__name__)


WAIT_POLICY = "OMP_WAIT_POLICY"


def sleep_when_idle() -> None:
    """Have the compute threads sleep while they wait (``OMP_WAIT_POLICY=passive``) unless the
    environment already says otherwise: libgomp's default spins for a while at the end of each
    parallel region, burning CPU time that the other engine, the router or the thread it waits
    for could use. libgomp reads it once, when it loads (with torch), so the prefill and decode
    servers call this before anything else. See the measurements above."""
    os.environ.setdefault(WAIT_POLICY, "passive")


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def parse_cpus(spec: str) -> list[int] | None:
    """The CPUs ``spec`` names ("auto", "off" or a list like "0-3,8"); None for "off"."""
    spec = spec.strip()
    if spec == "off":
        return None
    usable = usable_cpus()
    if spec == "auto":
        return usable
    try:
        cpus = cpu_list(spec)
    except ValueError:
        raise InvalidRequestError(f"{spec!r} is not auto, off or a CPU list such as 0-3,8") from None
    outside = sorted(set(cpus) - set(usable))
    if outside:
        raise InvalidRequestError(f"CPUs {outside} are not usable by this process (it may use {usable})")
    return cpus


def cpu_list(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]`` (the kernel's list format); ValueError if it is not one."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(text)
    return sorted(cpus)


def format_cpus(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (what parse_cpus reads)."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class ThreadPlacement:
    """On the first step of each thread that runs the model: its priority (``nice``), and its
    team's size and CPUs (``cpus``; None leaves torch's threads as they are)."""

    def __init__(self, cpus: list[int] | None, bind: Callable[[list[int]], int] | None, nice: int = 0) -> None:
        self.cpus = cpus
        self.nice = nice
        self._bind = bind
        self._threads: set[int] = set()

    def ensure(self) -> None:
        """Call from the thread about to run the model (cheap after its first call)."""
        ident = threading.get_ident()
        if ident in self._threads:
            return
        self._threads.add(ident)
        if self.nice:
            # Linux keeps a nice value per thread, and threads take their creator's: set before
            # this thread's first parallel region, it holds for the team libgomp makes for it.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            logger.info("compute threads: nice %d", self.nice)
        if self.cpus is None:
            return
        import torch  # here: the launcher reads CPU lists with this module and never needs torch

        torch.set_num_threads(len(self.cpus))
        if self._bind is None:
            logger.info("compute threads: %d, unbound (no CPU kernels to bind them)", len(self.cpus))
            return
        failed = self._bind(self.cpus)
        if failed:
            logger.warning("compute threads: %d of %d could not be bound to CPUs %s", failed,
                           len(self.cpus), format_cpus(self.cpus))
        else:
            logger.info("compute threads: %d, bound to CPUs %s", len(self.cpus), format_cpus(self.cpus))
