"""The router's admin API: see and steer the balancers at run time (a separate port, bearer token).

    GET  /admin/instances                      every instance: id, role, health, drain, load, bucket,
                                               restarts (by its supervisor; None before its first report),
                                               whether its load is stale (reports stopped) and how old,
                                               failures in a row and outlier ejection
    GET  /admin/router                         this router: pid, restarts (by its supervisor)
    POST /admin/instances                      {"role", "address", "instance_id"?, "source"?}: a new
                                               instance; it gets work after its first load report
    DELETE /admin/instances/{id}[?wait=true]   it leaves: no new requests, removed once this router's
                                               requests on it are done (wait: answer then, 200;
                                               else at once, 202); Kubernetes' own are refused (409)
    POST /admin/instances/{id}/drain           no new requests for it (in-flight ones finish)
    POST /admin/instances/{id}/undrain
    GET  /admin/policies                       each role's policy, picks per policy, last pick
    PUT  /admin/policies/{role}                {"policy": name}: switch at once
    GET  /admin/prefill/buckets                bounds, caps, round period, room, allocation, last
                                               round's demand and backlog, requests waiting
    GET  /admin/planner, PUT /admin/planner    the planner: decisions, pause, limits, overrides (planner.py)
    PUT  /admin/prefill/buckets                {"bounds"?, "caps"?, "round_s"?, "room_s"?}: at once
    POST /admin/keys, GET /admin/keys, POST /admin/keys/{id}/revoke    API keys (admin_keys.py)

Every path needs ``Authorization: Bearer <admin token>`` (401 otherwise). Errors use the same
``{"error": {"message", "type", ...}}`` body as the public API. ``/admin/openapi.json`` (and
``/admin/docs``) describe it all. The ``epd admin`` command calls these paths.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict

from services.common.metrics import restart_count
from services.router.admin.keys import add_key_routes
from services.router.access.auth import KeyStore
from services.router.cluster.instances import InstancePool
from services.router.cluster.membership import Member
from services.router.cluster.pipeline import ClusterBackend
from services.router.admin.planner import add_planner_routes
from services.router.planner.live import LivePlanner
from services.router.policies import POLICIES, Policy, make_policy

ROLES = ("prefill", "decode", "encoder")


class NewInstance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    address: str
    """host:port of its gRPC server."""
    instance_id: str = ""
    source: str = "admin"
    """Who adds it: admin (by hand) or launcher (epd up scaling a role)."""


class PolicyChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy: str


class BucketChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bounds: list[int] | None = None
    """Three ascending prompt-length bounds (tokens) giving four buckets."""
    caps: list[int] | None = None
    """Most prefill instances per bucket (four numbers; 0: no cap)."""
    round_s: float | None = None
    """Seconds between reallocations."""
    room_s: float | None = None
    """Queued prefill seconds under which an instance takes a request waiting at the router."""


def create_admin_app(pools: dict[str, InstancePool], token: str,
                     prepare: Callable[[Policy], None] = lambda policy: None, keys: KeyStore | None = None,
                     cluster: ClusterBackend | None = None, planner: LivePlanner | None = None) -> FastAPI:
    """``pools``: role -> the router's instance pool for it; ``prepare(policy)`` gives a policy
    switched in through the API the router's settings (bucket bounds scaled to the model...);
    ``keys``: the API key store the /admin/keys routes manage (admin_keys.py; None: no such routes);
    ``cluster``: the backend whose membership POST / DELETE /admin/instances change (None: no such routes);
    ``planner``: the router's planner (planner.py's routes; None: 404 there)."""
    if not token:
        raise ValueError("the admin API needs a token")
    app = FastAPI(title="epd router admin API", openapi_url="/admin/openapi.json", docs_url="/admin/docs",
                  redoc_url=None)
    bearer = HTTPBearer(auto_error=False)

    def authorized(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), token.encode()):
            raise HTTPException(401, "a valid admin bearer token is required", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(HTTPException)
    async def error_body(request: Request, exc: HTTPException) -> JSONResponse:
        kind = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
                503: "service_unavailable_error"}.get(exc.status_code, "invalid_request_error")
        return JSONResponse({"error": {"message": exc.detail, "type": kind, "param": None, "code": None}},
                            status_code=exc.status_code, headers=exc.headers)

    def pool_of(role: str) -> InstancePool:
        if role not in pools:
            raise HTTPException(404, f"unknown role {role!r} ({', '.join(pools)})")
        return pools[role]

    def find(instance_id: str):
        """(pool, instance)."""
        for pool in pools.values():
            try:
                return pool, pool.find(instance_id)
            except KeyError:
                continue
        raise HTTPException(404, f"no instance {instance_id!r}")

    def buckets_policy():
        policy = pools["prefill"].policy
        if not hasattr(policy, "configure"):
            raise HTTPException(409, f"the prefill policy is {policy.name}, which has no buckets "
                                     "(PUT /admin/policies/prefill {\"policy\": \"prefill_buckets\"})")
        return policy

    @app.get("/admin/instances", dependencies=[Depends(authorized)])
    def instances() -> list[dict[str, Any]]:
        out = []
        for role, pool in pools.items():
            bucket_of = _bucket_of_instances(pool.policy) if role == "prefill" else {}
            now = time.monotonic()
            for instance, view in zip(pool.instances, pool.views()):
                load = instance.load
                out.append({"id": view.instance_id, "address": instance.address, "role": role,
                            "source": getattr(instance, "source", "static"),
                            "healthy": view.is_healthy, "draining": view.is_draining, "drained": instance.is_drained,
                            "ready": instance.is_ready, "leaving": instance.is_leaving,
                            "in_flight": getattr(instance, "num_in_flight", 0),
                            # "load" is its last report: stale once reports stop (dead, frozen, restarting)
                            "stale": load is not None and not instance.is_reporting(now, pool.health_timeout_s),
                            "report_age_s": None if load is None else round(now - instance.report_at, 3),
                            "failures_in_a_row": instance.num_failures,
                            "ejected_for_s": round(max(0.0, instance.ejected_until - now), 3),
                            "bucket": bucket_of.get(view.instance_id),
                            "restarts": None if load is None else load.num_restarts,
                            "load": None if load is None else {
                                "num_running": load.num_running, "num_waiting": load.num_waiting,
                                "num_queued_prefill_tokens": load.num_queued_prefill_tokens,
                                "num_kv_tokens_in_use": load.num_kv_tokens_in_use,
                                "num_free_blocks": load.num_free_blocks, "num_total_blocks": load.num_total_blocks,
                                "num_patches_in_flight": load.num_patches_in_flight,
                                "num_sent_since_report": instance.num_sent}})
        return out

    if cluster is not None:
        add_membership_routes(app, cluster, find, authorized)
    if planner is not None:
        add_planner_routes(app, planner, authorized)

    @app.get("/admin/router", dependencies=[Depends(authorized)])
    def router() -> dict[str, Any]:
        return {"pid": os.getpid(), "restarts": restart_count()}

    @app.post("/admin/instances/{instance_id}/drain", dependencies=[Depends(authorized)])
    async def drain(instance_id: str) -> dict[str, Any]:
        pool, instance = find(instance_id)
        pool.set_drained(instance, True)
        return {"id": instance.instance_id, "drained": True}

    @app.post("/admin/instances/{instance_id}/undrain", dependencies=[Depends(authorized)])
    async def undrain(instance_id: str) -> dict[str, Any]:
        pool, instance = find(instance_id)
        pool.set_drained(instance, False)
        return {"id": instance.instance_id, "drained": False}

    @app.get("/admin/policies", dependencies=[Depends(authorized)])
    def policies() -> dict[str, Any]:
        return {"available": sorted(POLICIES), "roles": {role: {
            "policy": pool.policy.name, "picks": dict(pool.picks),
            "last_pick": None if pool.last_pick is None else {
                "instance_id": pool.last_pick.instance_id, "score": pool.last_pick.score,
                "breakdown": dict(pool.last_pick.breakdown)}} for role, pool in pools.items()}}

    @app.put("/admin/policies/{role}", dependencies=[Depends(authorized)])
    async def switch_policy(role: str, change: PolicyChange) -> dict[str, Any]:
        pool = pool_of(role)
        try:
            policy = make_policy(change.policy)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        prepare(policy)
        pool.set_policy(policy)
        return {"role": role, "policy": pool.policy.name}

    @app.get("/admin/prefill/buckets", dependencies=[Depends(authorized)])
    def buckets() -> dict[str, Any]:
        buckets_policy()
        return _buckets_body(pools["prefill"])

    @app.put("/admin/prefill/buckets", dependencies=[Depends(authorized)])
    async def change_buckets(change: BucketChange) -> dict[str, Any]:
        policy = buckets_policy()
        try:
            policy.configure(bounds=None if change.bounds is None else tuple(change.bounds),
                             caps=None if change.caps is None else tuple(change.caps), round_s=change.round_s,
                             room_s=change.room_s)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        pools["prefill"].set_policy(policy)  # waiting requests re-queue by the new bounds
        return _buckets_body(pools["prefill"])

    if keys is not None:
        add_key_routes(app, keys, authorized)
    return app


def add_membership_routes(app: FastAPI, cluster: ClusterBackend, find, authorized) -> None:
    @app.post("/admin/instances", dependencies=[Depends(authorized)], status_code=201)
    async def add_instance(new: NewInstance) -> dict[str, Any]:
        if new.source not in ("admin", "launcher"):
            raise HTTPException(400, f"source must be admin or launcher, got {new.source!r}")
        try:
            member = Member(new.role, new.address, new.instance_id)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        owner = cluster.membership.owner(new.address)
        if owner is not None:
            raise HTTPException(409, f"{new.address} is already an instance (from {owner})")
        cluster.apply(cluster.membership.add(new.source, member))
        return {"id": new.instance_id or new.address, "address": new.address, "role": new.role,
                "source": new.source}

    @app.delete("/admin/instances/{instance_id}", dependencies=[Depends(authorized)])
    async def remove_instance(instance_id: str, wait: bool = False) -> JSONResponse:
        _, instance = find(instance_id)
        source = cluster.membership.owner(instance.address)
        if source == "kubernetes":
            raise HTTPException(409, f"{instance_id} is Kubernetes' (an endpoint of its Service): scale its "
                                     "workload down, or drain it here")
        if source is None:
            raise HTTPException(409, f"{instance_id} is leaving already")
        leaving = cluster.apply(cluster.membership.remove(source, instance.address))
        if wait:
            await asyncio.gather(*leaving)
        body = {"id": instance.instance_id, "address": instance.address, "leaving": not wait, "removed": wait}
        return JSONResponse(body, status_code=200 if wait else 202)


def _buckets_body(pool: InstancePool) -> dict[str, Any]:
    policy = pool.policy
    return {"bounds": list(policy.bounds), "caps": list(policy.caps), "round_s": policy.round_s,
            "room_s": policy.room_s, "allocation": {str(b): list(ids) for b, ids in dict(policy.allocation).items()},
            "last_demand_s": list(policy.last_demand_s), "last_backlog_s": list(policy.last_backlog_s),
            "waiting": {str(b): n for b, n in pool.waiting.sizes().items()}}


def _bucket_of_instances(policy) -> dict[str, int]:
    allocation = getattr(policy, "allocation", None)
    if allocation is None:
        return {}
    return {instance_id: int(bucket) for bucket, ids in dict(allocation).items() for instance_id in ids}
