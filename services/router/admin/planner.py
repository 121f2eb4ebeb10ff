"""The admin API's planner routes (see app.py for the whole API).

    GET /admin/planner     mode, paused, overrides, config, each role's last decision (current,
                           desired, reason, inputs), history of the changes
    PUT /admin/planner     {"paused"?: bool, "roles"?: {ROLE: {"min_replicas"?, "max_replicas"?,
                           "override"?: N | null}}}: at once; the next tick decides with it
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict

from services.router.planner.config import ROLES, RoleLimits
from services.router.planner.live import LivePlanner


class RoleChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min_replicas: int | None = None
    max_replicas: int | None = None
    override: int | None = None
    """Hold the role at this many replicas whatever the signals; null clears an override."""


class PlannerChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    paused: bool | None = None
    roles: dict[str, RoleChange] = {}


def add_planner_routes(app: FastAPI, live: LivePlanner, authorized) -> None:
    @app.get("/admin/planner", dependencies=[Depends(authorized)])
    def planner() -> dict[str, Any]:
        return live.state()

    @app.put("/admin/planner", dependencies=[Depends(authorized)])
    async def change_planner(change: PlannerChange) -> dict[str, Any]:
        core = live.planner
        try:
            for role, settings in change.roles.items():   # every change checked before any is made
                if role not in ROLES:
                    raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
                old = core.config.roles.get(role, RoleLimits(0, 0))
                RoleLimits(old.min_replicas if settings.min_replicas is None else settings.min_replicas,
                           old.max_replicas if settings.max_replicas is None else settings.max_replicas)
                if settings.override is not None and settings.override < 0:
                    raise ValueError(f"override: must be an integer >= 0, got {settings.override}")
        except ValueError as exc:
            raise HTTPException(400, f"planner: {exc}") from None
        for role, settings in change.roles.items():
            if settings.min_replicas is not None or settings.max_replicas is not None:
                core.set_limits(role, settings.min_replicas, settings.max_replicas)
            if "override" in settings.model_fields_set:
                core.override(role, settings.override)
        if change.paused is True:
            core.pause()
        elif change.paused is False:
            core.resume()
        return live.state()
