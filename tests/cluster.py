"""A real local cluster for integration tests: the launcher's own code starting real processes."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.common.wire import LoadReport, load_from_proto
from services.launcher import Cluster, UpConfig, free_port
from services.pb import common_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc, prefill_pb2_grpc


@dataclass
class RunningCluster:
    url: str
    cluster: Cluster

    def addresses(self, role: str) -> list[str]:
        """gRPC addresses of the live instances of ``role``."""
        return [c.address for c in self.cluster.children
                if c.name.startswith(role) and c.process.poll() is None]

    def loads(self) -> list[LoadReport]:
        reports = []
        for role, stub_class in (("prefill", prefill_pb2_grpc.PrefillStub), ("decode", decode_pb2_grpc.DecodeStub)):
            for address in self.addresses(role):
                with grpc.insecure_channel(address) as channel:
                    reports.append(load_from_proto(stub_class(channel).GetLoad(common_pb2.LoadRequest(), timeout=5)))
        return reports

    def store_stats(self) -> list[kvstore_pb2.StoreStats]:
        stats = []
        for address in self.addresses("kvstore"):
            with grpc.insecure_channel(address) as channel:
                stats.append(kvstore_pb2_grpc.KVStoreStub(channel).GetStats(kvstore_pb2.StoreStatsRequest(), timeout=5))
        return stats

    def leftovers(self, timeout_s: float = 15.0) -> list[str]:
        """What is still held anywhere once the cluster has had ``timeout_s`` to settle: busy
        engines, leases, blocks out of the pools, store leases. [] when everything is free."""
        deadline = time.monotonic() + timeout_s
        while True:
            held = [f"{r.role} {r.instance_id}: {r}" for r in self.loads() if not is_idle(r)]
            held += [f"store {s.node_id}: {s.num_leases} leases" for s in self.store_stats() if s.num_leases]
            if not held or time.monotonic() > deadline:
                return held
            time.sleep(0.1)

    def metric(self, role: str, name: str, **labels: str) -> float:
        """A counter or gauge summed over every instance whose name starts with ``role`` ("prefill",
        or "prefill-1" for one instance), from their /metrics."""
        total = 0.0
        for child in self.cluster.children:
            if not child.name.startswith(role) or child.process.poll() is not None:
                continue
            for family in text_string_to_metric_families(httpx.get(child.metrics_url, timeout=5).text):
                for sample in family.samples:
                    if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                        total += sample.value
        return total


@contextlib.contextmanager
def running_cluster(model: str, supervise: bool = False, **settings) -> Iterator[RunningCluster]:
    """``epd up`` with ``settings``; store nodes keep to memory (64 MiB) unless told otherwise.
    ``supervise``: a child that dies is restarted, as under ``epd up`` (off: it stays dead)."""
    settings = {"kvstore_dir": "none", "kvstore_capacity_mib": 64, "admin_port": free_port("127.0.0.1"), **settings}
    config = UpConfig(model=model, port=free_port("127.0.0.1"), **settings)
    cluster = Cluster(config)
    try:
        url = asyncio.run(cluster.start())
        if supervise:
            cluster.supervise_in_background()
        yield RunningCluster(url, cluster)
    finally:
        cluster.stop()


def is_idle(report: LoadReport) -> bool:
    """No request, lease or transfer left, every KV block back in the free pool."""
    return (report.num_running == 0 and report.num_waiting == 0 and report.num_leases == 0
            and report.num_transfers_in_flight == 0 and report.num_free_blocks == report.num_total_blocks)


WORDS = "river stone cloud lamp garden winter copper violin meadow harbor lantern orchard".split()


@dataclass
class Outcome:
    started: float
    ended: float
    error: str | None
    """None: a 200 with a choice; else what went wrong."""


@dataclass
class SteadyLoad:
    """New non-streaming chat requests (small, greedy), back to back from ``num_threads``
    threads, each with its own prompt (so new blocks keep reaching the store nodes); every
    outcome is kept. Use it as a context manager around the fault."""

    url: str
    num_threads: int = 2
    headers: dict[str, str] = field(default_factory=dict)
    model: str = "tiny-chat0"
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> SteadyLoad:
        self._threads = [threading.Thread(target=self._send, args=(seed,), daemon=True) for seed in range(self.num_threads)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _send(self, seed: int) -> None:
        rng = random.Random(seed * 7919 + int(time.monotonic() * 1000))
        with httpx.Client(timeout=60, headers=self.headers) as client:
            while not self._stop.is_set():
                content = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(20, 40)))
                started, error = time.monotonic(), None
                try:
                    reply = client.post(self.url + "/v1/chat/completions", json={
                        "model": self.model, "max_tokens": 4, "temperature": 0,
                        "messages": [{"role": "user", "content": content}]})
                    if reply.status_code != 200 or not reply.json()["choices"]:
                        error = f"{reply.status_code}: {reply.text[:300]}"
                except httpx.HTTPError as exc:
                    error = f"{type(exc).__name__}: {exc}"
                self.outcomes.append(Outcome(started, time.monotonic(), error))
                if error is not None:
                    time.sleep(0.05)  # the router is down: do not spin

    def failures(self, since: float = float("-inf"), until: float = float("inf")) -> list[Outcome]:
        """Failed requests sent in [since, until)."""
        return [o for o in list(self.outcomes) if o.error is not None and since <= o.started < until]

    def num_served(self, since: float) -> int:
        return sum(1 for o in list(self.outcomes) if o.error is None and o.started >= since)

    def wait_for(self, num_requests: int, since: float, timeout_s: float = 60.0) -> None:
        """Until ``num_requests`` sent since ``since`` have finished, served or not."""
        deadline = time.monotonic() + timeout_s
        while sum(1 for o in list(self.outcomes) if o.started >= since) < num_requests:
            assert time.monotonic() < deadline, f"fewer than {num_requests} requests finished in {timeout_s} s"
            time.sleep(0.05)
