"""The driver's view of Ray's restarts: each actor asked who it is every few seconds; one that
comes back with another worker pid was restarted by Ray (its process died, or its worker did).

It is only reported (and its address and metrics kept current): the router takes the instance
back by itself once its load stream reconnects, as with ``epd up``'s own restarts. An actor that
Ray placed on another node comes back at another address: that is logged as an error, as neither
the router's static list nor the engines' store list follow it (pin roles with epd_* resources).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Callable, Sequence

logger = logging.getLogger("epd.ray")
_POLL_S = 2.0


def restart_line(info: dict[str, Any]) -> str:
    return (f"{info['name']} restarted by Ray: actor pid {info['actor_pid']}, pid {info['pid']}, "
            f"restart {info['num_restarts']}, {info['address']}")


async def _ask(child: Any) -> dict[str, Any] | None:
    import ray
    import ray.exceptions

    try:
        return await asyncio.to_thread(ray.get, child.handle.info.remote(), timeout=10.0)
    except (ray.exceptions.RayError, TimeoutError):
        return None   # restarting, or being stopped: asked again next round


async def watch_restarts(children: Sequence[Any], stop: asyncio.Event, announce: Callable[[Any], None],
                         poll_s: float = _POLL_S) -> None:
    """Until ``stop``: report each restart, then ``announce(child)`` (its line, with the new pids)."""
    while not stop.is_set():
        known = [child for child in list(children) if child.info]
        for child, info in zip(known, await asyncio.gather(*(_ask(child) for child in known))):
            if info is None or info["actor_pid"] == child.info["actor_pid"]:
                continue
            if info["address"] != child.address:
                logger.error("%s came back at %s, not %s: the router will not find it there",
                             child.name, info["address"], child.address)
            child.info, child.address = info, info["address"]
            child.metrics_url = info["metrics_url"] or child.metrics_url
            print(restart_line(info), flush=True)
            announce(child)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), poll_s)
