"""The instances the router sends work to, what it knows of their load, and who picks among them.

Each instance streams load reports (``WatchLoad``) to its pool; the pool turns the latest into
an :class:`InstanceView` snapshot and lets the role's policy (``services/router/policies``)
pick. An instance is **unhealthy** while its report stream is broken, when no report came for
``health_timeout_s``, or right after an RPC to it failed as unavailable; an instance never heard
from yet counts as healthy (so a router starting with its instances works at once). Unhealthy
and drained instances get no new requests; requests already there finish.

Between two reports the pool counts the requests it sent (``num_sent``), so a burst does not
all land on the instance that looked idlest at the last report.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc
import grpc.aio

from services.common.cost_model import PrefillCost
from services.common.errors import UnavailableError
from services.common.server import MAX_MESSAGE_BYTES
from services.common.wire import LoadReport, load_from_proto
from services.pb import common_pb2
from services.router.policies import InstanceView, Pick, Policy, RequestView

logger = logging.getLogger(__name__)

S = TypeVar("S")
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
_RECONNECT_S = 0.5


@dataclass
class Instance(Generic[S]):
    address: str
    channel: grpc.aio.Channel
    stub: S
    instance_id: str = ""
    """From its load reports; its address until the first one."""
    load: LoadReport | None = None
    report_at: float = float("-inf")
    is_broken: bool = False
    """Its report stream failed, or an RPC found it unavailable, since its last report."""
    is_drained: bool = False
    """Drained through the admin API: no new requests."""
    num_sent: int = 0
    """Requests sent since its last report."""

    def __post_init__(self) -> None:
        self.instance_id = self.instance_id or self.address

    def is_healthy(self, now: float, health_timeout_s: float) -> bool:
        if self.is_broken:
            return False
        return self.load is None or now - self.report_at <= health_timeout_s

    def view(self, role: str, now: float, health_timeout_s: float, cost: PrefillCost,
             block_size: int = 16) -> InstanceView:
        load = self.load or LoadReport(self.instance_id, role)
        num_queued = load.num_queued_prefill_tokens
        return InstanceView(
            instance_id=self.instance_id, role=role, machine=self.address.rsplit(":", 1)[0],
            num_running=load.num_running, num_waiting=load.num_waiting + self.num_sent,
            num_queued_prefill_tokens=num_queued,
            # The instance's own estimate when it has one (its fitted model), else the reference's.
            queued_compute_s=load.queued_prefill_compute_s or cost.seconds(num_queued),
            num_kv_tokens=load.num_kv_tokens_in_use,
            kv_capacity_tokens=load.num_total_blocks * block_size, num_patches_in_flight=load.num_patches_in_flight,
            is_healthy=self.is_healthy(now, health_timeout_s),
            is_draining=self.is_drained or load.is_draining)


class InstancePool(Generic[S]):
    def __init__(self, role: str, addresses: tuple[str, ...], stub_class: type[S], policy: Policy,
                 health_timeout_s: float = 3.0, report_interval_s: float = 0.5,
                 cost: PrefillCost = PrefillCost()) -> None:
        self.role = role
        self.policy = policy
        self.health_timeout_s = health_timeout_s
        self.report_interval_s = report_interval_s
        self.cost = cost
        self.block_size = 16
        """Tokens per KV block (the router learns it from the model)."""
        self.instances: list[Instance[S]] = [
            Instance(a, channel := grpc.aio.insecure_channel(a, options=_CHANNEL_OPTIONS), stub_class(channel))
            for a in addresses]
        self.picks: Counter[str] = Counter()
        """Picks per policy name (the admin API's per-policy stats)."""
        self.last_pick: Pick | None = None
        self._watchers: list[asyncio.Task] = []

    def __len__(self) -> int:
        return len(self.instances)

    def views(self) -> list[InstanceView]:
        now = time.monotonic()
        return [i.view(self.role, now, self.health_timeout_s, self.cost, self.block_size) for i in self.instances]

    def pick(self, request: RequestView | None = None) -> Instance[S]:
        """The policy's pick among healthy, undrained instances; UnavailableError if none."""
        if not self.instances:
            raise UnavailableError(f"no {self.role} instance is configured")
        request = request or RequestView("", 0)
        chosen = self.policy.pick(request, self.views())
        if chosen is None:
            raise UnavailableError(f"no {self.role} instance is available (all unhealthy or drained)")
        self.policy.on_pick(request, chosen)
        self.picks[self.policy.name] += 1
        self.last_pick = chosen
        instance = self.find(chosen.instance_id)
        instance.num_sent += 1
        logger.debug("%s pick %s for %s: %s", self.role, instance.address, request.request_id, dict(chosen.breakdown))
        return instance

    def find(self, instance_id_or_address: str) -> Instance[S]:
        for instance in self.instances:
            if instance_id_or_address in (instance.instance_id, instance.address):
                return instance
        raise KeyError(instance_id_or_address)

    def mark_unavailable(self, instance: Instance[S]) -> None:
        """An RPC found it unavailable: no new work until it reports again."""
        instance.is_broken = True

    # ----- load reports ------------------------------------------------------------------------
    def start_watching(self) -> None:
        self._watchers = [asyncio.get_running_loop().create_task(self._watch(i)) for i in self.instances]

    async def _watch(self, instance: Instance[S]) -> None:
        request = common_pb2.WatchLoadRequest(interval_s=self.report_interval_s)
        while True:
            try:
                async for message in instance.stub.WatchLoad(request, wait_for_ready=True):
                    report = load_from_proto(message)
                    instance.load, instance.report_at = report, time.monotonic()
                    instance.instance_id = report.instance_id or instance.address
                    instance.is_broken, instance.num_sent = False, 0
            except grpc.aio.AioRpcError as exc:
                if not instance.is_broken:
                    logger.warning("%s %s stopped reporting (%s): no new work for it",
                                   self.role, instance.address, exc.code().name)
            instance.is_broken = True
            await asyncio.sleep(_RECONNECT_S)

    async def close(self) -> None:
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        for instance in self.instances:
            await instance.channel.close()
