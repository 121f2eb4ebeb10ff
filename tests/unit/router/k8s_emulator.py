"""A tiny Kubernetes API server for the router's Kubernetes adapters (aiohttp, in memory).

It serves only what they use, as the real API server does it: namespaced list of EndpointSlices,
Pods, Deployments and StatefulSets with label selectors (``k``, ``!k``, ``k=v``, ``k==v``,
``k!=v``); watch (``?watch=true``) as chunked JSON lines from a ``resourceVersion``, ending
after ``timeoutSeconds``, answering an ERROR event with code 410 for a version older than it
is told to expire;
get of one object; PATCH of the ``scale`` subresource of Deployments and StatefulSets.
Every request is recorded (:attr:`K8sEmulator.requests`). Tests change objects as Kubernetes'
controllers would (:meth:`K8sEmulator.put`, :meth:`K8sEmulator.delete`) and break it on purpose:
:meth:`close_watches` (an API server restarting), :attr:`fail_status` (every request answered
403 / 503), :attr:`num_watches_gone` (the next watches expire: 410), :meth:`go_down` /
:meth:`come_up` (connection refused, then back on the same port).

In a test's own event loop: ``async with running_emulator() as k8s``; for a router in another
process: ``with EmulatorThread() as k8s`` and ``k8s.call(k8s.emulator.put, ...)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from kubernetes_asyncio import client

GROUP_VERSIONS = {"endpointslices": "discovery.k8s.io/v1", "pods": "v1", "deployments": "apps/v1",
                  "statefulsets": "apps/v1"}
KINDS = {"endpointslices": "EndpointSlice", "pods": "Pod", "deployments": "Deployment",
         "statefulsets": "StatefulSet"}
SCALABLE = ("deployments", "statefulsets")
PARSE_BOOL_TRUE = ("1", "t", "T", "true", "TRUE", "True")
"""What the API server's query parsing (Go's strconv.ParseBool) reads as true: the Python
client sends ``watch=True``."""


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    query: Mapping[str, str]
    content_type: str
    body: Any
    """The JSON body, None without one."""


def matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Kubernetes' equality-based label selector (what the adapters send)."""
    for requirement in filter(None, (r.strip() for r in selector.split(","))):
        if "!=" in requirement:
            key, value = requirement.split("!=", 1)
            ok = labels.get(key) != value
        elif "=" in requirement:
            key, value = requirement.replace("==", "=").split("=", 1)
            ok = labels.get(key) == value
        elif requirement.startswith("!"):
            ok = requirement[1:] not in labels
        else:
            ok = requirement in labels
        if not ok:
            return False
    return True


def status(code: int, reason: str, message: str = "") -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "code": code, "reason": reason, "message": message or reason}


class K8sEmulator:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}
        """(plural, namespace, name) -> the object as served."""
        self.requests: list[Recorded] = []
        self.version = 0
        """The last resourceVersion given out."""
        self.fail_status: int | None = None
        """Answer every request with this status (403, 503, ...) while set."""
        self.num_watches_gone = 0
        """The next this-many watches get an ERROR event 410 (their version expired)."""
        self._history: list[tuple[int, str, dict]] = []
        """(resourceVersion, plural, event) of every change, for watches from a version."""
        self._watches: set[asyncio.Queue] = set()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ----- lifecycle --------------------------------------------------------------------------
    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, shutdown_timeout=1.0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.url

    async def go_down(self) -> None:
        """Stop listening and drop every connection: clients get 'connection refused'."""
        self.close_watches()
        async with asyncio.timeout(5):
            while self._watches:   # each stream ends cleanly before its connection is cut
                await asyncio.sleep(0.01)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def come_up(self) -> None:
        """Listen again, on the same port."""
        await self.start()

    stop = go_down

    # ----- what controllers do ----------------------------------------------------------------
    def put(self, plural: str, obj: dict) -> dict:
        """Create or replace ``obj`` (ADDED / MODIFIED to the watches); the stored copy."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        key = (plural, meta["namespace"], meta["name"])
        self._change(plural, "MODIFIED" if key in self.objects else "ADDED", obj)
        self.objects[key] = obj
        return obj

    def delete(self, plural: str, name: str, namespace: str = "default") -> None:
        obj = self.objects.pop((plural, namespace, name))
        self._change(plural, "DELETED", obj)

    @property
    def num_open_watches(self) -> int:
        return len(self._watches)

    def close_watches(self) -> None:
        """End every open watch stream (the API server restarting, a load balancer's idle cut)."""
        for queue in self._watches:
            queue.put_nowait(None)

    def requests_to(self, method: str, path_part: str) -> list[Recorded]:
        return [r for r in self.requests if r.method == method and path_part in r.path]

    def _change(self, plural: str, kind: str, obj: dict) -> None:
        self.version += 1
        if kind != "DELETED":
            obj["metadata"]["resourceVersion"] = str(self.version)
            obj.setdefault("apiVersion", GROUP_VERSIONS[plural])
            obj.setdefault("kind", KINDS[plural])
        event = {"type": kind, "object": copy.deepcopy(obj)}
        self._history.append((self.version, plural, event))
        for queue in self._watches:
            queue.put_nowait((plural, event))

    # ----- the API ----------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(Recorded(request.method, request.path, dict(request.query),
                                      request.content_type, json.loads(body) if body else None))
        if self.fail_status is not None:
            return web.json_response(status(self.fail_status, "Failure"), status=self.fail_status)
        parts = request.path.strip("/").split("/")
        # /api/v1/namespaces/NS/PLURAL[/NAME[/SUB]]  or  /apis/GROUP/VERSION/namespaces/NS/...
        rest = parts[2:] if parts[0] == "api" else parts[3:]
        if len(rest) < 3 or rest[0] != "namespaces" or rest[2] not in KINDS:
            return web.json_response(status(404, "NotFound", f"no route {request.path}"), status=404)
        namespace, plural, name, sub = rest[1], rest[2], *(rest[3:5] + [None, None])[:2]
        if name is None and request.method == "GET":
            if request.query.get("watch") in PARSE_BOOL_TRUE:
                return await self._watch(request, plural, namespace)
            return web.json_response(self._list(plural, namespace, request.query.get("labelSelector", "")))
        obj = self.objects.get((plural, namespace, name))
        if obj is None:
            return web.json_response(status(404, "NotFound", f'{plural} "{name}" not found'), status=404)
        if sub is None and request.method == "GET":
            return web.json_response(obj)
        if sub == "scale" and plural in SCALABLE and request.method == "PATCH":
            obj = copy.deepcopy(obj)
            obj.setdefault("spec", {})["replicas"] = json.loads(body)["spec"]["replicas"]
            obj = self.put(plural, obj)
            return web.json_response(self._scale(obj))
        return web.json_response(status(405, "MethodNotAllowed"), status=405)

    def _list(self, plural: str, namespace: str, selector: str) -> dict:
        items = [o for (p, ns, _), o in sorted(self.objects.items())
                 if p == plural and ns == namespace and matches(selector, o["metadata"].get("labels") or {})]
        return {"kind": f"{KINDS[plural]}List", "apiVersion": GROUP_VERSIONS[plural],
                "metadata": {"resourceVersion": str(self.version)}, "items": items}

    @staticmethod
    def _scale(obj: dict) -> dict:
        meta = obj["metadata"]
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                             "resourceVersion": meta["resourceVersion"]},
                "spec": {"replicas": obj["spec"]["replicas"]},
                "status": {"replicas": obj.get("status", {}).get("replicas", 0)}}

    async def _watch(self, request: web.Request, plural: str, namespace: str) -> web.StreamResponse:
        selector = request.query.get("labelSelector", "")
        since = int(request.query.get("resourceVersion") or self.version)
        timeout_s = float(request.query.get("timeoutSeconds") or 1800)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        def wanted(event: dict) -> bool:
            meta = event["object"]["metadata"]
            return meta["namespace"] == namespace and matches(selector, meta.get("labels") or {})

        async def send(event: dict) -> None:
            await response.write(json.dumps(event).encode() + b"\n")

        if self.num_watches_gone:
            self.num_watches_gone -= 1
            with contextlib.suppress(ConnectionResetError):
                await send({"type": "ERROR", "object": status(410, "Expired", "too old resource version")})
                await response.write_eof()
            return response
        queue: asyncio.Queue = asyncio.Queue()
        backlog = [event for version, p, event in self._history if version > since and p == plural]
        self._watches.add(queue)
        try:
            with contextlib.suppress(TimeoutError):   # the server's end of a watch: the stream ends
                async with asyncio.timeout(timeout_s):
                    for event in backlog:
                        if wanted(event):
                            await send(event)
                    while (item := await queue.get()) is not None:
                        if item[0] == plural and wanted(item[1]):
                            await send(item[1])
            await response.write_eof()
        except ConnectionResetError:
            pass   # the client went away
        finally:
            self._watches.discard(queue)
        return response


@contextlib.asynccontextmanager
async def running_emulator() -> AsyncIterator[K8sEmulator]:
    emulator = K8sEmulator()
    await emulator.start()
    try:
        yield emulator
    finally:
        await emulator.stop()


def api_client_for(url: str) -> client.ApiClient:
    return client.ApiClient(client.Configuration(host=url))


def write_kubeconfig(path, url: str, namespace: str = "default") -> str:
    """A kubeconfig whose current context is the emulator (JSON is YAML)."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": "unused"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                       "namespace": namespace}}]}))
    return str(path)


class EmulatorThread:
    """The emulator on its own event loop in a thread, for processes other than the test's."""

    def __init__(self) -> None:
        self.emulator = K8sEmulator()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> EmulatorThread:
        self._thread.start()
        self.run(self.emulator.start())
        return self

    def __exit__(self, *exc) -> None:
        self.run(self.emulator.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    @property
    def url(self) -> str:
        return self.emulator.url

    def run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        async def call() -> Any:
            return fn(*args)
        return self.run(call())


# ----- objects as the chart and Kubernetes' controllers make them ---------------------------------
def endpoint(address: str, pod: str = "", *, ready: bool | None = True, terminating: bool | None = None) -> dict:
    conditions = {k: v for k, v in (("ready", ready), ("terminating", terminating)) if v is not None}
    ref = {"targetRef": {"kind": "Pod", "name": pod, "namespace": "default"}} if pod else {}
    return {"addresses": [address], "conditions": conditions, **ref}


def endpoint_slice(name: str, role: str, endpoints: list[dict], *, port: int = 50051, port_name: str = "grpc",
                   instance: str = "r1", namespace: str = "default", address_type: str = "IPv4",
                   labels: Mapping[str, str] | None = None) -> dict:
    """A slice of the chart's Service for ``role`` (role "": the label present but empty)."""
    base = {"epd.io/role": role, "app.kubernetes.io/instance": instance,
            "kubernetes.io/service-name": f"{instance}-{role or 'unknown'}"}
    return {"metadata": {"name": name, "namespace": namespace, "labels": {**base, **(labels or {})}},
            "addressType": address_type, "endpoints": endpoints,
            "ports": [{"name": port_name, "port": port, "protocol": "TCP"}]}


def pod(name: str, role: str, namespace: str = "default") -> dict:
    return {"metadata": {"name": name, "namespace": namespace, "labels": {"epd.io/role": role}}}


def workload(name: str, role: str, replicas: int = 1, *, instance: str = "r1", namespace: str = "default") -> dict:
    """A Deployment or StatefulSet of the chart (the fields the client's models require)."""
    labels = {"epd.io/role": role, "app.kubernetes.io/instance": instance}
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": role, "image": "epd:test"}]}}},
            "status": {"replicas": replicas}}
