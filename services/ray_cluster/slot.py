"""What an actor leaves on its node for its next incarnation: the pid of the process it runs
(a restarted actor kills a leftover one before it takes the same ports) and the back-off of its
restarts. One small JSON file per actor under the node's temp directory, removed at a clean stop.

    actor starts ── leftover pid still ours? SIGKILL it, free its /dev/shm pools
                 ── back-off (restarts only: 0.5 s doubling to 30 s, 0.5 s again after 60 s up)
                 ── spawn the service, write {pid, num_restarts, delay_s, started}
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from services.supervisor import Backoff, remove_shared_memory_of

SLOT_ENV = "EPD_RAY_SLOT"
"""Set in each service process's environment: how a restarted actor knows a leftover is its own."""


@dataclass(frozen=True)
class SlotState:
    pid: int = 0
    num_restarts: int = 0
    delay_s: float = 0.0
    started: float = 0.0
    """time.time() of the last start."""


def slot_path(slot: str) -> Path:
    return Path(tempfile.gettempdir()) / "epd-ray" / f"{slot}.json"


def read_state(slot: str) -> SlotState | None:
    try:
        return SlotState(**json.loads(slot_path(slot).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def write_state(slot: str, state: SlotState) -> None:
    path = slot_path(slot)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state)))
    tmp.replace(path)


def forget(slot: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        slot_path(slot).unlink()


def next_start(previous: SlotState | None, now: float, backoff: Backoff = Backoff()) -> tuple[int, float]:
    """(restart number, seconds to wait first) for a start after ``previous`` (None: the first)."""
    if previous is None:
        return 0, 0.0
    return previous.num_restarts + 1, backoff.next_delay(previous.delay_s, now - previous.started)


def is_ours(pid: int, slot: str) -> bool:
    """Whether ``pid`` runs and carries ``slot`` in its environment (pids are reused)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{SLOT_ENV}={slot}".encode() in environ


def kill_leftover(previous: SlotState | None, slot: str, timeout_s: float = 10.0) -> None:
    """The process a killed actor left behind (it got SIGTERM and may still be draining, holding
    the ports): killed now, its shared memory removed."""
    if previous is None or not previous.pid:
        return
    if is_ours(previous.pid, slot):
        with contextlib.suppress(ProcessLookupError):
            os.kill(previous.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while is_ours(previous.pid, slot) and time.monotonic() < deadline:
            time.sleep(0.05)
    remove_shared_memory_of(previous.pid)
