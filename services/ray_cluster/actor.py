"""``ServiceActor``: one Ray actor owns one epd service process (a store node, an encoder, a
prefill, a decode or the router), started with the command line ``epd up`` would run.

Life cycle of one actor::

    __init__ (also after each restart by Ray) ── kill a leftover of the last incarnation
      ── back-off (restarts) ── spawn the process from a watcher thread of its own
    watcher: the process exits ── stopping? done : free its /dev/shm pools, exit the actor
      (status 1) ── Ray restarts the actor (max_restarts), which starts the process again
    stop(): SIGTERM (the service drains), SIGKILL after the grace period, slot file removed

The process is spawned by the long-lived watcher thread because PR_SET_PDEATHSIG (supervisor.py)
fires when the *thread* that forked the child ends: a Ray worker runs methods on pool threads.
If the actor's worker is killed, the process gets SIGTERM from the kernel; the next incarnation
kills it if it is still draining on the ports it needs.

``NODE_IP`` in the command line becomes the node's address (Ray's view of it); ``argv[0]``
becomes this worker's Python (the same environment on every node, as Ray requires).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from kvstore.transfer.engine import HOST_ID_ENV
from services.ray_cluster import slot as slots
from services.supervisor import Child, Probe, remove_shared_memory_of

logger = logging.getLogger("epd.ray")
NODE_IP = "@node-ip"


@dataclass(frozen=True)
class ServiceSpec:
    """What one actor runs; the same on every restart (Ray keeps the constructor's arguments)."""

    name: str
    argv: tuple[str, ...]
    probe: Probe
    port: int
    host: str = NODE_IP
    """The address it binds; NODE_IP: its node's."""
    metrics_port: int | None = None
    slot: str = ""
    """Unique per actor and cluster run (files, and the marker in the process's environment)."""
    env: dict[str, str] = field(default_factory=dict)


def resolve_argv(argv: tuple[str, ...], node_ip: str, python: str) -> list[str]:
    """The spec's command line on this node (see the module docstring)."""
    return [python, *(node_ip if arg == NODE_IP else arg for arg in argv[1:])]


class ServiceActor:
    def __init__(self, spec: ServiceSpec) -> None:
        import ray.util

        self.spec = spec
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.host_id = os.environ.get(HOST_ID_ENV, "")
        argv = resolve_argv(spec.argv, self.node_ip, sys.executable)
        host = self.node_ip if spec.host == NODE_IP else spec.host
        self.child = Child(spec.name, f"{host}:{spec.port}", argv, spec.probe,
                           env={**spec.env, slots.SLOT_ENV: spec.slot})
        self.is_stopping = False
        self._spawned = threading.Event()
        self._error: BaseException | None = None
        previous = slots.read_state(spec.slot)
        slots.kill_leftover(previous, spec.slot)
        self.child.num_restarts, self.delay_s = slots.next_start(previous, time.time())
        threading.Thread(target=self._watch, name=f"epd-{spec.name}", daemon=True).start()
        self._spawned.wait()
        if self._error is not None:
            raise self._error

    def _watch(self) -> None:
        try:
            time.sleep(self.delay_s)
            process = self.child.spawn()
            slots.write_state(self.spec.slot, slots.SlotState(process.pid, self.child.num_restarts, self.delay_s,
                                                              time.time()))
        except BaseException as exc:   # raised by __init__: the actor fails to start, the driver says so
            self._error = exc
            return
        finally:
            self._spawned.set()
        status = process.wait()
        if self.is_stopping:
            return
        remove_shared_memory_of(process.pid)
        logger.error("%s (pid %d) exited with status %s: ending the actor for Ray to restart it",
                     self.spec.name, process.pid, status)
        os._exit(1)

    def wait_healthy(self, timeout_s: float) -> dict:
        """The process answers its probe: :meth:`info`. ChildFailed if it exits or times out."""
        asyncio.run(self.child.wait_healthy(timeout_s))
        return self.info()

    def info(self) -> dict:
        metrics = f"http://{self.child.address.rsplit(':', 1)[0]}:{self.spec.metrics_port}/metrics" \
            if self.spec.metrics_port else ""
        return {"name": self.spec.name, "address": self.child.address, "metrics_url": metrics,
                "pid": self.child.process.pid, "actor_pid": os.getpid(), "node_id": self.node_id,
                "host_id": self.host_id, "num_restarts": self.child.num_restarts}

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (the service drains), SIGKILL after ``timeout_s``; its exit status."""
        self.is_stopping = True
        process = self.child.process
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in time: killing it", self.spec.name)
            process.kill()
            process.wait()
        remove_shared_memory_of(process.pid)
        slots.forget(self.spec.slot)
        return process.returncode
