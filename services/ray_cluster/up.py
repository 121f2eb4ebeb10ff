"""``epd up --ray``: connect to Ray (or start a local Ray), start the cluster as actors, print
where everything runs, keep it running, and on Ctrl-C / SIGTERM stop every actor it started and
remove its placement group (a Ray this command started is stopped too).

Every ``epd up`` flag keeps its meaning; with --ray, each instance binds its Ray node's address
(what other nodes reach), and the router binds --host on the node this command runs on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from services.launcher import UpConfig, serve

logger = logging.getLogger("epd.ray")


def connect(config: UpConfig) -> str:
    """ray.init: --ray-address (host:port of a running cluster, or "auto": the one ``ray start``
    made on this machine); empty: RAY_ADDRESS, else a new local Ray for this command alone (never
    a stale ``ray start`` left behind). The node id this driver runs on."""
    try:
        import ray
    except ImportError:
        sys.exit("epd up --ray: Ray is not installed (pip install 'ray==2.60.0')")
    from services.ray_cluster.placement import local_num_cpus

    address = config.ray_address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, namespace="epd", logging_level=logging.WARNING)
    else:
        most = max(config.autoscale_max, config.prefills, config.decodes) if config.autoscale else 0
        roles = {"kvstore": config.kvstores, "router": 1, "encoder": config.num_encoders,
                 "prefill": max(config.prefills, most), "decode": max(config.decodes, most)}
        ray.init(address="local", namespace="epd", logging_level=logging.WARNING, include_dashboard=False,
                 num_cpus=local_num_cpus(roles, os.cpu_count() or 1))
    return ray.get_runtime_context().get_node_id()


def banner(cluster) -> None:
    from services.ray_cluster.cluster import child_line

    for child in cluster.children:
        print(child_line(child), flush=True)
    cluster.is_up = True
    print(f"  admin API  http://127.0.0.1:{cluster.config.admin_port}/admin/  token {cluster.admin_token}"
          f"  (export EPD_ROUTER_ADMIN_TOKEN=... for epd admin)", flush=True)
    keys = {True: "required (Authorization: Bearer KEY)", None: "unknown (GET /v1/models did not answer)",
            False: f"none: the API is open to anyone who can reach {cluster.config.host}"}[cluster.needs_keys]
    print(f"  API keys   {keys}", flush=True)


def main(config: UpConfig) -> int:
    node_id = connect(config)   # in the main thread: Ray sets its signal handlers there
    return asyncio.run(run(config, node_id))


async def run(config: UpConfig, node_id: str) -> int:
    import ray

    from services.ray_cluster.cluster import RayCluster

    def announce(cluster: RayCluster, url: str) -> None:
        banner(cluster)
        print(f"epd is up on Ray: {url}/v1  (OpenAI API; Ray restarts what dies; Ctrl-C stops every actor)",
              flush=True)

    try:
        return await serve(RayCluster(config, ray.cluster_resources(), node_id), announce)
    finally:
        ray.shutdown()
        print("epd on Ray stopped: every actor and placement group it started is gone", flush=True)
