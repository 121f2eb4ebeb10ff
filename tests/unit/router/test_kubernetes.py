"""Kubernetes discovery and the planner's Kubernetes actuator, against an API emulator.

``members_of`` is checked on plain slices; the adapters run against ``k8s_emulator`` (a real
HTTP server speaking the API's list / watch / get / scale), with their real client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from services.router.cluster import kubernetes
from services.router.cluster.kubernetes import KubernetesDiscovery, members_of, pods_to_look_up, slice_port
from services.router.cluster.membership import Member
from services.router.planner.kubernetes_actuator import KubernetesActuator
from tests.unit.router.k8s_emulator import (K8sEmulator, api_client_for, endpoint, endpoint_slice, pod,
                                            running_emulator, workload, write_kubeconfig)

SELECTOR = "app.kubernetes.io/instance=r1"
LOGGER = "services.router.cluster.kubernetes"


# ----- members_of ----------------------------------------------------------------------------
def test_members_follow_the_endpoint_conditions():
    s = endpoint_slice("r1-decode-abc", "decode", [
        endpoint("10.0.0.1", "decode-0", ready=True),
        endpoint("10.0.0.2", "decode-1", ready=False),
        endpoint("10.0.0.3", "decode-2", ready=True, terminating=True),
        endpoint("10.0.0.4", "decode-3", ready=None),          # unset: ready, says the API
        endpoint("10.0.0.5", ready=True),                      # no targetRef
    ])
    assert members_of([s]) == [
        Member("decode", "10.0.0.1:50051", "decode-0", True),
        Member("decode", "10.0.0.2:50051", "decode-1", False),
        Member("decode", "10.0.0.3:50051", "decode-2", False),
        Member("decode", "10.0.0.4:50051", "decode-3", True),
        Member("decode", "10.0.0.5:50051", "", True),
    ]


def test_the_role_comes_from_the_slice_else_from_the_pod_and_kvstore_is_skipped():
    slices = [
        endpoint_slice("r1-prefill-a", "prefill", [endpoint("10.0.1.1", "prefill-0")]),
        endpoint_slice("r1-kvstore-a", "kvstore", [endpoint("10.0.2.1", "kvstore-0")]),
        endpoint_slice("r1-odd-a", "", [endpoint("10.0.3.1", "encoder-0"), endpoint("10.0.3.2", "kvstore-1"),
                                        endpoint("10.0.3.3", "unknown-0"), endpoint("10.0.3.4")]),
    ]
    assert pods_to_look_up(slices) == {"encoder-0", "kvstore-1", "unknown-0"}
    assert members_of(slices, {"encoder-0": "encoder", "kvstore-1": "kvstore"}) == [
        Member("encoder", "10.0.3.1:50051", "encoder-0", True),
        Member("prefill", "10.0.1.1:50051", "prefill-0", True),
    ]


def test_the_port_named_grpc_else_the_only_one():
    only = endpoint_slice("a", "decode", [endpoint("10.0.0.1", "d-0")], port=7000, port_name="")
    named = endpoint_slice("b", "decode", [endpoint("10.0.0.2", "d-1")])
    named["ports"] = [{"name": "metrics", "port": 9000}, {"name": "grpc", "port": 7001}]
    ambiguous = endpoint_slice("c", "decode", [endpoint("10.0.0.3", "d-2")])
    ambiguous["ports"] = [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}]
    portless = endpoint_slice("d", "decode", [endpoint("10.0.0.4", "d-3")])
    portless["ports"] = None
    assert [slice_port(s) for s in (only, named, ambiguous, portless)] == [7000, 7001, None, None]
    assert members_of([only, named, ambiguous, portless]) == [
        Member("decode", "10.0.0.1:7000", "d-0", True), Member("decode", "10.0.0.2:7001", "d-1", True)]


def test_ipv6_addresses_are_bracketed_and_an_address_in_two_slices_is_one_member():
    v6 = endpoint_slice("r1-prefill-v6", "prefill", [endpoint("fd00::1", "prefill-0")], address_type="IPv6")
    moving = [endpoint_slice("r1-decode-a", "decode", [endpoint("10.0.0.9", "decode-0", ready=False)]),
              endpoint_slice("r1-decode-b", "decode", [endpoint("10.0.0.9", "decode-0", ready=True)])]
    assert members_of([v6, *moving]) == [Member("decode", "10.0.0.9:50051", "decode-0", True),
                                         Member("prefill", "[fd00::1]:50051", "prefill-0", True)]
    assert members_of(moving[::-1]) == [Member("decode", "10.0.0.9:50051", "decode-0", True)]


# ----- discovery against the emulator --------------------------------------------------------
async def eventually(predicate: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.01)


class Published:
    """What discovery publishes, every set in order."""

    def __init__(self, discovery: KubernetesDiscovery | None = None) -> None:
        self.sets: list[list[Member]] = []
        self.discovery = discovery

    def __call__(self, members) -> None:
        self.sets.append(list(members))

    async def until(self, expected: list[Member]) -> None:
        await eventually(lambda: self.sets and self.sets[-1] == expected,
                         f"published {expected}, last {self.sets[-1:] or 'nothing'}")


@asynccontextmanager
async def discovering(k8s: K8sEmulator, **kwargs) -> AsyncIterator[Published]:
    api = api_client_for(k8s.url)
    options = dict(resync_s=60.0, request_timeout_s=2.0, retry_base_s=0.02, retry_max_s=0.1) | kwargs
    published = Published(KubernetesDiscovery("default", SELECTOR, api_client=api, **options))
    task = asyncio.create_task(published.discovery.run(published))
    try:
        yield published
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api.close()


async def watching(k8s: K8sEmulator) -> None:
    """Until the adapter's watch is open (its list is published before it asks for the watch)."""
    await eventually(lambda: k8s.num_open_watches == 1, "an open watch")


def lists(k8s: K8sEmulator) -> list:
    return [r for r in k8s.requests_to("GET", "/endpointslices") if "watch" not in r.query]


def watches(k8s: K8sEmulator) -> list:
    return [r for r in k8s.requests_to("GET", "/endpointslices") if "watch" in r.query]


DECODE_0 = Member("decode", "10.0.0.1:50051", "decode-0", True)
DECODE_1 = Member("decode", "10.0.0.2:50051", "decode-1", True)
PREFILL_0 = Member("prefill", "10.0.1.1:50051", "prefill-0", True)


def prefill_slice() -> dict:
    return endpoint_slice("r1-prefill-p1", "prefill", [endpoint("10.0.1.1", "prefill-0")])


def decode_slice(*, ready_1: bool = True) -> dict:
    return endpoint_slice("r1-decode-x1", "decode", [endpoint("10.0.0.1", "decode-0"),
                                                     endpoint("10.0.0.2", "decode-1", ready=ready_1)])


def test_slices_appearing_turning_not_ready_and_vanishing_are_published():
    async def test():
        async with running_emulator() as k8s, discovering(k8s) as published:
            await published.until([])
            k8s.put("endpointslices", endpoint_slice("r2-decode-y1", "decode", [endpoint("10.9.9.9", "x")],
                                                     instance="r2"))     # another release's
            k8s.put("endpointslices", decode_slice())
            await published.until([DECODE_0, DECODE_1])
            k8s.put("endpointslices", decode_slice(ready_1=False))
            await published.until([DECODE_0, Member("decode", "10.0.0.2:50051", "decode-1", False)])
            k8s.delete("endpointslices", "r1-decode-x1")
            await published.until([])
            assert [m for s in published.sets for m in s if m.address == "10.9.9.9:50051"] == []
            assert {r.query["labelSelector"] for r in lists(k8s) + watches(k8s)} == {f"{SELECTOR},epd.io/role"}
            assert len(lists(k8s)) == 1 and len(watches(k8s)) == 1
            assert watches(k8s)[0].query["resourceVersion"] == "0"
            assert watches(k8s)[0].query["timeoutSeconds"] == "60"
    asyncio.run(test())


def test_an_empty_selector_asks_only_for_the_role_label():
    assert kubernetes.selector_with_role("") == "epd.io/role"
    assert kubernetes.selector_with_role("a=b,c") == "a=b,c,epd.io/role"


def test_the_role_is_read_from_the_pod_when_the_slice_has_none():
    async def test():
        async with running_emulator() as k8s:
            k8s.put("pods", pod("prefill-0", "prefill"))
            k8s.put("endpointslices", endpoint_slice("r1-any-a", "", [endpoint("10.0.1.1", "prefill-0"),
                                                                     endpoint("10.0.1.2", "gone-0")]))
            async with discovering(k8s) as published:
                await published.until([PREFILL_0])
            assert sorted(r.path for r in k8s.requests_to("GET", "/pods/")) == [
                "/api/v1/namespaces/default/pods/gone-0", "/api/v1/namespaces/default/pods/prefill-0"]
    asyncio.run(test())


def test_a_closed_watch_is_followed_by_a_new_list(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)

    async def test():
        async with running_emulator() as k8s, discovering(k8s) as published:
            k8s.put("endpointslices", decode_slice())
            await published.until([DECODE_0, DECODE_1])
            await watching(k8s)
            k8s.close_watches()
            await eventually(lambda: len(watches(k8s)) == 2, "a second watch")
            k8s.put("endpointslices", prefill_slice())
            await published.until([DECODE_0, DECODE_1, PREFILL_0])
            assert len(lists(k8s)) == 2
            assert all(published.sets)
    asyncio.run(test())
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_an_expired_watch_410_is_followed_by_a_new_list(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)

    async def test():
        async with running_emulator() as k8s, discovering(k8s) as published:
            k8s.put("endpointslices", decode_slice())
            await published.until([DECODE_0, DECODE_1])
            k8s.num_watches_gone = 1
            await watching(k8s)
            k8s.close_watches()
            await eventually(lambda: len(watches(k8s)) == 3, "a watch after the expired one")
            k8s.delete("endpointslices", "r1-decode-x1")
            await published.until([])
            assert len(lists(k8s)) == 3
            assert [s for s in published.sets[1:] if not s] == [[]]   # the deletion's, no other
    asyncio.run(test())
    assert [r.getMessage() for r in caplog.records] == ["EndpointSlice watch expired (410 Gone); listing again"]


def test_the_watch_ends_every_resync_s_and_the_slices_are_listed_again():
    async def test():
        async with running_emulator() as k8s, discovering(k8s, resync_s=1.0) as published:
            k8s.put("endpointslices", decode_slice())
            await eventually(lambda: len(lists(k8s)) >= 3, "two resyncs", timeout_s=6.0)
            assert {r.query["timeoutSeconds"] for r in watches(k8s)} == {"1"}
            assert published.sets[-1] == [DECODE_0, DECODE_1]
    asyncio.run(test())


def outage_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == LOGGER]


def test_an_unreachable_api_keeps_the_last_set_and_is_listed_again_when_back(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)

    async def test():
        async with running_emulator() as k8s:
            k8s.put("endpointslices", decode_slice())
            async with discovering(k8s) as published:
                await published.until([DECODE_0, DECODE_1])
                num_published = len(published.sets)
                await k8s.go_down()
                await eventually(lambda: outage_warnings(caplog), "the outage logged")
                # While it is down, the cluster changes (controllers keep working).
                k8s.delete("endpointslices", "r1-decode-x1")
                k8s.put("endpointslices", prefill_slice())
                await asyncio.sleep(0.3)         # several refused attempts (back-off 0.02 .. 0.1 s)
                assert len(published.sets) == num_published
                assert not published.discovery.is_available
                await k8s.come_up()
                await published.until([PREFILL_0])
                assert published.discovery.is_available and published.discovery.num_outages == 1
            assert all(published.sets)       # never an empty set for an unreachable API
    asyncio.run(test())
    # Refused, or the watch cut mid-stream as the server went: one warning for the outage either way.
    assert len(outage_warnings(caplog)) == 1
    assert outage_warnings(caplog)[0].startswith("Kubernetes API failed (Client")
    assert outage_warnings(caplog)[0].endswith("keeping the last 2 instances, retrying with back-off")
    assert any(r.getMessage().startswith("Kubernetes API answers again") for r in caplog.records)


@pytest.mark.parametrize("status", [503, 403])
def test_api_errors_keep_the_last_set_and_are_retried_with_back_off(caplog, status):
    caplog.set_level(logging.INFO, logger=LOGGER)

    async def test():
        async with running_emulator() as k8s:
            k8s.put("endpointslices", decode_slice())
            async with discovering(k8s) as published:
                await published.until([DECODE_0, DECODE_1])
                num_published = len(published.sets)
                await watching(k8s)
                k8s.fail_status = status
                k8s.close_watches()
                await eventually(lambda: len(lists(k8s)) >= 5, "four failed lists")
                assert len(published.sets) == num_published
                assert not published.discovery.is_available and published.discovery.num_outages == 1
                k8s.put("endpointslices", decode_slice(ready_1=False))
                k8s.fail_status = None
                await published.until([DECODE_0, Member("decode", "10.0.0.2:50051", "decode-1", False)])
            assert all(published.sets)
    asyncio.run(test())
    assert len(outage_warnings(caplog)) == 1
    reason = {503: "Service Unavailable", 403: "Forbidden"}[status]
    assert outage_warnings(caplog) == [f"Kubernetes API failed (HTTP {status} {reason}); keeping the last 2 "
                                       "instances, retrying with back-off"]


def test_a_kubeconfig_points_the_adapters_at_the_api(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(kubernetes, "NAMESPACE_FILE", tmp_path / "no-such-file")

    async def test():
        async with running_emulator() as k8s:
            monkeypatch.setenv("KUBECONFIG", write_kubeconfig(tmp_path / "config", k8s.url))
            k8s.put("endpointslices", decode_slice())
            k8s.put("deployments", workload("r1-decode", "decode", 2))
            discovery = KubernetesDiscovery(namespace="", label_selector=SELECTOR, resync_s=60.0)
            assert discovery.namespace == "default"
            published = Published()
            task = asyncio.create_task(discovery.run(published))
            try:
                await published.until([DECODE_0, DECODE_1])
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            actuator = KubernetesActuator(label_selector=SELECTOR)
            try:
                assert await actuator.current() == {"decode": 2}
            finally:
                await actuator.close()
    asyncio.run(test())


def test_the_namespace_defaults_to_the_pods_own(tmp_path, monkeypatch):
    (tmp_path / "namespace").write_text("epd-prod\n")
    monkeypatch.setattr(kubernetes, "NAMESPACE_FILE", tmp_path / "namespace")
    assert kubernetes.resolve_namespace("") == "epd-prod"
    assert kubernetes.resolve_namespace("other") == "other"


# ----- the actuator --------------------------------------------------------------------------
def a_release(k8s: K8sEmulator) -> None:
    k8s.put("deployments", workload("r1-prefill", "prefill", 2))
    k8s.put("deployments", workload("r1-decode", "decode", 1))
    k8s.put("statefulsets", workload("r1-kvstore", "kvstore", 3))
    k8s.put("deployments", workload("r2-decode", "decode", 5, instance="r2"))


@asynccontextmanager
async def actuating(k8s: K8sEmulator) -> AsyncIterator[KubernetesActuator]:
    api = api_client_for(k8s.url)
    try:
        yield KubernetesActuator("default", SELECTOR, api, request_timeout_s=2.0)
    finally:
        await api.close()


def test_scale_patches_the_deployments_scale_subresource():
    async def test():
        async with running_emulator() as k8s, actuating(k8s) as actuator:
            a_release(k8s)
            await actuator.scale("decode", 3)
            [patch] = k8s.requests_to("PATCH", "/")
            assert (patch.path, patch.content_type, patch.body) == (
                "/apis/apps/v1/namespaces/default/deployments/r1-decode/scale",
                "application/strategic-merge-patch+json", {"spec": {"replicas": 3}})
            assert {r.query["labelSelector"] for r in k8s.requests_to("GET", "/")} == {f"{SELECTOR},epd.io/role=decode"}
            assert k8s.objects["deployments", "default", "r1-decode"]["spec"]["replicas"] == 3
            assert k8s.objects["deployments", "default", "r2-decode"]["spec"]["replicas"] == 5
            assert await actuator.current() == {"prefill": 2, "decode": 3, "kvstore": 3}
    asyncio.run(test())


def test_scale_of_the_kvstore_patches_its_statefulset():
    async def test():
        async with running_emulator() as k8s, actuating(k8s) as actuator:
            a_release(k8s)
            await actuator.scale("kvstore", 0)
            [patch] = k8s.requests_to("PATCH", "/")
            assert (patch.path, patch.body) == ("/apis/apps/v1/namespaces/default/statefulsets/r1-kvstore/scale",
                                                {"spec": {"replicas": 0}})
            assert k8s.objects["statefulsets", "default", "r1-kvstore"]["spec"]["replicas"] == 0
    asyncio.run(test())


def test_scale_needs_exactly_one_workload_for_the_role():
    async def test():
        async with running_emulator() as k8s, actuating(k8s) as actuator:
            a_release(k8s)
            with pytest.raises(RuntimeError, match=r"scaling 'encoder': exactly one Deployment or StatefulSet "
                               r"in namespace 'default' must match 'app.kubernetes.io/instance=r1,"
                               r"epd.io/role=encoder'; found none"):
                await actuator.scale("encoder", 1)
            k8s.put("statefulsets", workload("r1-decode-old", "decode", 1))
            with pytest.raises(RuntimeError, match=r"scaling 'decode': .*; found deployment/r1-decode, "
                               r"statefulset/r1-decode-old$"):
                await actuator.scale("decode", 2)
            with pytest.raises(RuntimeError, match=r"role 'decode' has more than one"):
                await actuator.current()
            with pytest.raises(ValueError, match="replicas must be >= 0"):
                await actuator.scale("prefill", -1)
            assert k8s.requests_to("PATCH", "/") == []
    asyncio.run(test())
