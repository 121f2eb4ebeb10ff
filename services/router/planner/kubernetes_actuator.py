"""The planner's Kubernetes actuator: a role's replica count is its workload's scale (adapter).

Each role runs as one Deployment or StatefulSet labelled ``epd.io/role: <role>`` (plus the
release's labels, ``label_selector``). Scaling patches the workload's ``scale`` subresource, as
``kubectl scale`` and the HorizontalPodAutoscaler do, so the planner needs only the RBAC verbs
``list`` on deployments/statefulsets and ``patch`` on their ``/scale``. API failures raise
(ApiException, TimeoutError, aiohttp.ClientError): the planner's loop counts them and decides
again on its next tick.
"""

from __future__ import annotations

from kubernetes_asyncio import client

from services.router.cluster.kubernetes import ROLE_LABEL, new_api_client, resolve_namespace, selector_with_role


class KubernetesActuator:
    name = "kubernetes"

    def __init__(self, namespace: str = "", label_selector: str = "",
                 api_client: client.ApiClient | None = None, *, request_timeout_s: float = 10.0) -> None:
        self.namespace = resolve_namespace(namespace)
        self.label_selector = label_selector
        self.request_timeout_s = request_timeout_s
        self._api_client = api_client
        self._owns_client = api_client is None

    async def scale(self, role: str, replicas: int) -> None:
        """Set ``role``'s workload to ``replicas`` pods (RuntimeError unless exactly one matches)."""
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0 (got {replicas})")
        selector = f"{self.label_selector},{ROLE_LABEL}={role}" if self.label_selector else f"{ROLE_LABEL}={role}"
        found = await self._workloads(selector)
        if len(found) != 1:
            names = ", ".join(f"{kind}/{w.metadata.name}" for kind, w in found) or "none"
            raise RuntimeError(f"scaling {role!r}: exactly one Deployment or StatefulSet in namespace "
                               f"{self.namespace!r} must match {selector!r}; found {names}")
        kind, workload = found[0]
        apps = client.AppsV1Api(await self._api())
        patch = (apps.patch_namespaced_deployment_scale if kind == "deployment"
                 else apps.patch_namespaced_stateful_set_scale)
        await patch(workload.metadata.name, self.namespace, {"spec": {"replicas": replicas}},
                    _request_timeout=self.request_timeout_s)

    async def current(self) -> dict[str, int]:
        """Role -> its workload's desired replicas, for each role that has a workload."""
        replicas: dict[str, int] = {}
        for kind, workload in await self._workloads(selector_with_role(self.label_selector)):
            role = workload.metadata.labels[ROLE_LABEL]
            if role in replicas:
                raise RuntimeError(f"role {role!r} has more than one Deployment or StatefulSet in namespace "
                                   f"{self.namespace!r} matching {self.label_selector!r}")
            # spec.replicas unset means 1 (the API server's default).
            replicas[role] = 1 if workload.spec.replicas is None else workload.spec.replicas
        return replicas

    async def close(self) -> None:
        if self._owns_client and self._api_client is not None:
            await self._api_client.close()
            self._api_client = None

    async def _workloads(self, selector: str) -> list[tuple[str, client.V1Deployment | client.V1StatefulSet]]:
        apps = client.AppsV1Api(await self._api())
        deployments = await apps.list_namespaced_deployment(self.namespace, label_selector=selector,
                                                            _request_timeout=self.request_timeout_s)
        stateful_sets = await apps.list_namespaced_stateful_set(self.namespace, label_selector=selector,
                                                                _request_timeout=self.request_timeout_s)
        return [*(("deployment", d) for d in deployments.items), *(("statefulset", s) for s in stateful_sets.items)]

    async def _api(self) -> client.ApiClient:
        if self._api_client is None:
            self._api_client = await new_api_client()
        return self._api_client
