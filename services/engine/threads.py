"""Where a CPU engine computes: one OpenMP thread per CPU it may use, each bound to its CPU.

An engine's products, element-wise ops and kernels run on the OpenMP team of the thread that
runs the model (torch, MKL and the C kernels share libgomp's). Unbound, those threads migrate
between cores and, when a core is busy with something else, every parallel region waits at its
barrier for the thread that lost its core: ops of microseconds then take milliseconds (measured:
SiLU over a decode step's rows at ~3.7 ms a call while another process ran). Bound, each thread
keeps its core's caches, and the OS does not pile two of them onto one core.

``cpu_threads`` (EngineConfig, ``--cpu-threads``):

    auto    the CPUs of this process's affinity mask (what ``taskset``, a container's cpuset or
            ``epd up`` gave it), one thread each, bound
    off     torch's own choice, unbound (as before this module)
    0-3,8   those CPUs (a subset of the mask), one thread each, bound

Binding is per thread that runs the model (the engine thread when serving, the caller's thread
offline), done on its first step. Without the C kernels (no compiler) the thread count is still
set, unbound. Processes that share CPUs should not each bind to all of them: two threads bound
to one core cannot move to an idle one, so ``epd up`` gives each CPU engine its own CPUs when
there are enough (launcher.py).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from services.common.errors import InvalidRequestError

logger = logging.getLogger(__name__)


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
    """Binds the model-running thread's team to ``cpus`` on that thread's first step."""

    def __init__(self, cpus: list[int], bind: Callable[[list[int]], int] | None) -> None:
        self.cpus = cpus
        self._bind = bind
        self._threads: set[int] = set()

    def ensure(self) -> None:
        """Call from the thread about to run the model (cheap after its first call)."""
        ident = threading.get_ident()
        if ident in self._threads:
            return
        self._threads.add(ident)
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
