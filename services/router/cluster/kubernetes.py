"""Kubernetes discovery: the instances behind the chart's per-role Services (imperative shell).

The chart gives each role a headless Service labelled ``epd.io/role: <role>`` with a port named
``grpc``; Kubernetes keeps EndpointSlices for it carrying the Service's labels, one endpoint
per Pod with its readiness. This adapter follows them::

    list slices (selector "<label_selector>,epd.io/role")     publish(members_of(slices))
      └─ watch from the list's resourceVersion  ─ each event ─> publish(members_of(slices))
           ends after resync_s, on a closed stream or 410 Gone ─> list again
    API error (refused, 5xx, 403, timeout) ─> keep the last published set, log once per outage,
                                              back off (0.5 s doubling to 10 s), list again

Only :func:`members_of` decides anything, on the slices as the API serves them (JSON dicts).
An unreachable API never publishes an empty set: the pools keep what they had until the API
answers again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config

from services.common.retry import backoff_s
from services.router.cluster.membership import ROLES, Member, Publish

logger = logging.getLogger(__name__)

ROLE_LABEL = "epd.io/role"
PORT_NAME = "grpc"
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

Slice = Mapping[str, Any]
"""A discovery.k8s.io/v1 EndpointSlice as the API serves it (camelCase JSON)."""


# ----- pure core -----------------------------------------------------------------------------
def slice_port(endpoint_slice: Slice) -> int | None:
    """The slice's port named ``grpc``, else its only port; None: no usable port."""
    ports = [p for p in endpoint_slice.get("ports") or () if p.get("port")]
    named = [p for p in ports if p.get("name") == PORT_NAME]
    if named or len(ports) == 1:
        return int((named or ports)[0]["port"])
    return None


def pods_to_look_up(slices: Iterable[Slice]) -> set[str]:
    """The pods whose role :func:`members_of` needs: those of slices whose role label is empty
    (the selector lists only slices that carry it)."""
    refs = [e.get("targetRef") or {} for s in slices if not _labels(s).get(ROLE_LABEL)
            for e in s.get("endpoints") or ()]
    return {ref["name"] for ref in refs if ref.get("kind") == "Pod" and ref.get("name")}


def members_of(slices: Iterable[Slice], pod_roles: Mapping[str, str] = {}) -> list[Member]:
    """The instances the slices name, sorted by role and address.

    The role is the slice's ``epd.io/role`` label, else its endpoint's Pod's (``pod_roles``:
    pod name -> role); roles the router does not route to (kvstore) are skipped, and so are
    slices without a usable port (:func:`slice_port`). An address in several slices (an endpoint
    moving between slices) is one member, ready if any copy is. A dual-stack Service's pod is in
    an IPv4 and an IPv6 slice: two members, as two addresses are.
    """
    members: dict[str, Member] = {}
    for s in sorted(slices, key=lambda s: s.get("metadata", {}).get("name", "")):
        port = slice_port(s)
        if port is None:
            continue
        for endpoint in s.get("endpoints") or ():
            # The API calls an endpoint's addresses fungible and lets clients use the first:
            # every one of them would be the same pod counted twice.
            addresses = endpoint.get("addresses") or ()
            ref = endpoint.get("targetRef") or {}
            role = _labels(s).get(ROLE_LABEL) or pod_roles.get(ref.get("name", ""), "")
            if not addresses or role not in ROLES:
                continue
            address = _host_port(addresses[0], port)
            try:
                member = Member(role, address, ref.get("name") or "", _is_ready(endpoint))
            except ValueError as e:   # an address the API should never have served
                logger.warning("EndpointSlice %s: %s; skipped", s.get("metadata", {}).get("name"), e)
                continue
            if address in members and members[address].is_ready:
                continue
            members[address] = member
    return sorted(members.values(), key=lambda m: (m.role, m.address))


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


def _is_ready(endpoint: Mapping[str, Any]) -> bool:
    """The EndpointSlice API's reading: ``ready`` unset counts as ready; terminating never is."""
    conditions = endpoint.get("conditions") or {}
    return conditions.get("ready") is not False and conditions.get("terminating") is not True


def _host_port(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def selector_with_role(label_selector: str) -> str:
    """Only objects that carry a role label (the selector's own requirements too)."""
    return f"{label_selector},{ROLE_LABEL}" if label_selector else ROLE_LABEL


# ----- configuration -------------------------------------------------------------------------
def resolve_namespace(namespace: str) -> str:
    """``namespace``, or when empty the pod's own (its service account's), else "default"."""
    if namespace:
        return namespace
    try:
        return NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"


async def new_api_client() -> client.ApiClient:
    """In a pod (KUBERNETES_SERVICE_HOST set): its service account; else the kubeconfig
    (KUBECONFIG, default ~/.kube/config). Raises ConfigException when neither is usable."""
    configuration = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        # Read KUBECONFIG now: the library reads it once, when it is imported.
        await config.load_kube_config(config_file=os.environ.get("KUBECONFIG", "~/.kube/config"),
                                      client_configuration=configuration, persist_config=False)
    return client.ApiClient(configuration)


async def read_json(response: aiohttp.ClientResponse) -> Any:
    """The body of a raw (``_preload_content=False``) answer; ApiException unless 2xx."""
    async with response:
        body = await response.read()
        if not 200 <= response.status < 300:
            raise client.ApiException(status=response.status, reason=response.reason)
        return json.loads(body)


def _describe(error: Exception) -> str:
    if isinstance(error, client.ApiException):   # its str() is the whole multi-line answer
        return f"HTTP {error.status} {error.reason}"
    return f"{type(error).__name__}: {error}"


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


# ----- the shell -----------------------------------------------------------------------------
class KubernetesDiscovery:
    """Follows the EndpointSlices of ``namespace`` matching ``label_selector`` (see the module
    docstring); ``api_client`` is for tests, else one is made from the environment and closed
    when :meth:`run` ends."""

    source = "kubernetes"

    def __init__(self, namespace: str = "", label_selector: str = "", resync_s: float = 30.0,
                 api_client: client.ApiClient | None = None, *, request_timeout_s: float = 10.0,
                 retry_base_s: float = 0.5, retry_max_s: float = 10.0) -> None:
        if resync_s <= 0:
            raise ValueError(f"resync_s must be > 0 (got {resync_s})")
        self.namespace = resolve_namespace(namespace)
        self.selector = selector_with_role(label_selector)
        self.resync_s = resync_s
        self.request_timeout_s = request_timeout_s
        self.retry_base_s, self.retry_max_s = retry_base_s, retry_max_s
        self._api_client = api_client
        self.is_available = False
        """The last list or watch succeeded (for the router's metrics)."""
        self.num_outages = 0
        """Times the API failed after answering (or before ever answering)."""
        self._slices: dict[str, Slice] = {}
        self._pod_roles: dict[str, str] = {}

    async def run(self, publish: Publish) -> None:
        """List and watch until cancelled; an API outage only delays the next list."""
        owns_client = self._api_client is None
        failures, outage_since = 0, None
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    if self._api_client is None:
                        self._api_client = await new_api_client()
                    api = client.DiscoveryV1Api(self._api_client)
                    version = await self._list(api, publish)
                    if outage_since is not None:
                        logger.info("Kubernetes API answers again (after %.1f s)", loop.time() - outage_since)
                    failures, outage_since, self.is_available = 0, None, True
                    started = loop.time()
                    try:
                        await self._watch(api, version, publish)
                    except _Gone:
                        logger.info("EndpointSlice watch expired (410 Gone); listing again")
                    # A server that ends every watch at once is not asked again at full speed.
                    await asyncio.sleep(max(0.0, started + self.retry_base_s - loop.time()))
                except Exception as e:   # an outage (or a bug): degrade, never stop the router
                    self.is_available = False
                    if outage_since is None:
                        outage_since = loop.time()
                        self.num_outages += 1
                        logger.warning("Kubernetes API failed (%s); keeping the last %d instances, "
                                       "retrying with back-off", _describe(e),
                                       len(members_of(self._slices.values(), self._pod_roles)))
                    await asyncio.sleep(backoff_s(failures, self.retry_base_s, self.retry_max_s))
                    failures += 1
        finally:
            if owns_client and self._api_client is not None:
                await self._api_client.close()
                self._api_client = None

    async def _list(self, api: client.DiscoveryV1Api, publish: Publish) -> str:
        """Every matching slice now, published; the list's resourceVersion."""
        listing = await read_json(await api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self.selector, _preload_content=False,
            _request_timeout=self.request_timeout_s))
        self._slices = {s["metadata"]["name"]: s for s in listing.get("items") or ()}
        self._pod_roles = {}
        for s in self._slices.values():
            self._check_port(s)
        await self._publish(publish)
        return listing["metadata"]["resourceVersion"]

    async def _watch(self, api: client.DiscoveryV1Api, version: str, publish: Publish) -> None:
        """Apply and publish each change until the server ends the watch (after resync_s)."""
        response = await api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self.selector, watch=True, resource_version=version,
            allow_watch_bookmarks=True, timeout_seconds=max(1, round(self.resync_s)),
            _preload_content=False,
            # A read waiting past the server's own end of the watch means a dead connection.
            _request_timeout=(self.request_timeout_s, self.resync_s + self.request_timeout_s))
        if response.status != 200:
            response.release()
            raise _Gone() if response.status == 410 else client.ApiException(status=response.status,
                                                                             reason=response.reason)
        async with response:
            while line := await response.content.readline():
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise client.ApiException(status=obj.get("code"), reason=obj.get("message"))
                if kind in ("ADDED", "MODIFIED"):
                    self._slices[obj["metadata"]["name"]] = obj
                    self._check_port(obj)
                elif kind == "DELETED":
                    self._slices.pop(obj["metadata"]["name"], None)
                else:   # BOOKMARK: nothing changed
                    continue
                await self._publish(publish)

    async def _publish(self, publish: Publish) -> None:
        core = client.CoreV1Api(self._api_client)
        for pod in pods_to_look_up(self._slices.values()) - self._pod_roles.keys():
            try:
                found = await core.read_namespaced_pod(pod, self.namespace, _request_timeout=self.request_timeout_s)
                self._pod_roles[pod] = (found.metadata.labels or {}).get(ROLE_LABEL, "")
            except client.ApiException as e:
                if e.status != 404:
                    raise
                self._pod_roles[pod] = ""   # gone already: its endpoint goes with it
        publish(members_of(self._slices.values(), self._pod_roles))

    def _check_port(self, endpoint_slice: Slice) -> None:
        if slice_port(endpoint_slice) is None and endpoint_slice.get("endpoints"):
            logger.warning("EndpointSlice %s has no port named %r and not exactly one port; its "
                           "endpoints are ignored", endpoint_slice["metadata"]["name"], PORT_NAME)
