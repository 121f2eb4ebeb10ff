"""A real local cluster for integration tests: the launcher's own code starting real processes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.common.wire import LoadReport, load_from_proto
from services.launcher import Cluster, UpConfig, free_port
from services.pb import common_pb2, decode_pb2_grpc, prefill_pb2_grpc


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

    def metric(self, role: str, name: str, **labels: str) -> float:
        """A counter or gauge summed over every instance of ``role`` (from their /metrics)."""
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
def running_cluster(model: str, **settings) -> Iterator[RunningCluster]:
    config = UpConfig(model=model, port=free_port("127.0.0.1"), **settings)
    cluster = Cluster(config)
    try:
        url = asyncio.run(cluster.start())
        yield RunningCluster(url, cluster)
    finally:
        cluster.stop()


def is_idle(report: LoadReport) -> bool:
    """No request, lease or transfer left, every KV block back in the free pool."""
    return (report.num_running == 0 and report.num_waiting == 0 and report.num_leases == 0
            and report.num_transfers_in_flight == 0 and report.num_free_blocks == report.num_total_blocks)
