"""A real local cluster for integration tests: the launcher's own code starting real processes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

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
