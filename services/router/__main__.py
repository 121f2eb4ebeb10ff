"""The router: the cluster's HTTP front door (OpenAI API) in front of prefill and decode.

    python -m services.router --prefill 127.0.0.1:50061 --decode 127.0.0.1:50071 [--port 8000]

Every flag is also an EPD_ROUTER_* environment variable; ``--help`` lists them.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import grpc.aio
import uvicorn

from services.common.config import ConfigError, config_or_exit
from services.router.config import RouterConfig
from services.router.api.app import create_app
from services.router.api.image_urls import ImageFetcher, ImageUrlPolicy
from services.router.cluster.metrics import register_pool_metrics
from services.router.admin.app import create_admin_app
from services.router.access.gate import Gate, build_gate
from services.router.cluster.pipeline import ClusterBackend
from services.router.planner import Planner, PlannerConfig
from services.router.planner.live import LivePlanner, Publisher
from services.router.policies import Policy, make_policy
from services.router.policies.prefill_buckets import scale_bounds

logger = logging.getLogger("services.router")


def policies(config: RouterConfig) -> dict[str, Policy]:
    return {"prefill": make_policy(config.prefill_policy), "decode": make_policy(config.decode_policy),
            "encoder": make_policy(config.encoder_policy)}


def configure_buckets(policy: Policy, config: RouterConfig, max_model_len: int) -> None:
    """Bucket bounds, caps, round period and room from the config (bounds scaled to the model)."""
    if hasattr(policy, "configure"):
        policy.configure(bounds=config.bucket_bounds or scale_bounds(max_model_len),
                         caps=config.bucket_caps or None, round_s=config.round_s, room_s=config.room_s)


async def run(config: RouterConfig) -> int:
    try:
        gate = await build_gate(config)  # first: a router that may not start says so at once
    except ConfigError as exc:
        logger.error("%s", exc)
        return 2
    try:
        return await _run(config, gate)
    finally:
        await gate.close()


def build_planner(config: RouterConfig, backend: ClusterBackend) -> LivePlanner | None:
    """The planner --planner asks for (ConfigError: its settings file is wrong)."""
    if config.planner == "off":
        return None
    try:
        settings = PlannerConfig.from_json(Path(config.planner_config).read_text()) if config.planner_config \
            else PlannerConfig()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--planner-config / EPD_ROUTER_PLANNER_CONFIG: {exc}", "planner_config", str(exc)) from None
    if config.planner == "kubernetes":
        from services.router.planner.kubernetes_actuator import KubernetesActuator  # the client only where used
        actuator = KubernetesActuator(namespace=config.k8s_namespace, label_selector=config.k8s_label_selector)
    else:
        actuator = Publisher(config.planner)
    pools = {"prefill": backend.prefills, "decode": backend.decodes, "encoder": backend.encoders}
    return LivePlanner(Planner(settings), pools, actuator, config.kvstore)


async def _run(config: RouterConfig, gate: Gate) -> int:
    backend = ClusterBackend(config.prefill, config.decode, config.encoder, policies(config),
                             health_timeout_s=config.health_timeout_s,
                             decode_idle_timeout_s=config.decode_idle_timeout_s,
                             max_migrations=config.max_migrations, leave_timeout_s=config.leave_timeout_s,
                             stage_timeout_s=config.stage_timeout_s)
    try:
        planner = build_planner(config, backend)
    except ConfigError as exc:
        logger.error("%s", exc)
        await backend.close()
        return 2
    if config.discovery == "kubernetes":
        from services.router.cluster.kubernetes import KubernetesDiscovery  # the client only where used
        backend.discover(KubernetesDiscovery(namespace=config.k8s_namespace, label_selector=config.k8s_label_selector,
                                             resync_s=config.k8s_resync_s))
    try:
        await backend.connect(timeout_s=config.connect_timeout_s)
    except (grpc.aio.AioRpcError, TimeoutError) as exc:
        logger.error("no instance described the model within %.0f s: %s", config.connect_timeout_s, exc)
        await backend.close()
        return 1
    register_pool_metrics({"prefill": backend.prefills, "decode": backend.decodes, "encoder": backend.encoders})
    configure_buckets(backend.prefills.policy, config, backend.max_model_len)
    app = create_app(backend, served_model_names=list(config.served_model_name), gate=gate,
                     cors_allow_origins=config.cors_allow_origin, image_urls=ImageFetcher(ImageUrlPolicy(
                         config.allow_image_urls, config.image_url_max_bytes, config.image_url_timeout_s)))
    servers = [uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level="warning",
        timeout_graceful_shutdown=config.drain_timeout_s))]
    logger.info("router serving %s on http://%s:%d/v1", backend.model_name, config.host, config.port)
    if config.admin_port is not None and config.admin_token:
        admin = create_admin_app({"prefill": backend.prefills, "decode": backend.decodes,
                                  "encoder": backend.encoders}, config.admin_token,
                                 prepare=lambda policy: configure_buckets(policy, config, backend.max_model_len),
                                 keys=gate.store, cluster=backend, planner=planner)
        servers.append(uvicorn.Server(uvicorn.Config(admin, host=config.admin_host, port=config.admin_port,
                                                     log_level="warning")))
        logger.info("admin API on http://%s:%d/admin/ (bearer token)", config.admin_host, config.admin_port)
    elif config.admin_port is not None:
        logger.warning("no admin token (--admin-token / EPD_ROUTER_ADMIN_TOKEN): the admin API is off")
    if planner is not None:
        planner.start()
        logger.info("planner on (%s), every %g s", planner.mode, planner.planner.config.interval_s)
    try:
        await _serve_all(servers)
    finally:
        if planner is not None:
            await planner.close()
        await backend.close()
    return 0


async def _serve_all(servers: list[uvicorn.Server]) -> None:
    """Run the servers together; when one stops (a signal, a bind failure) the others stop too."""
    tasks = [asyncio.ensure_future(server.serve()) for server in servers]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(config_or_exit(RouterConfig, argv, "router", prog="python -m services.router")))


if __name__ == "__main__":
    sys.exit(main())
