"""``epd up``: the whole cluster on one machine, as child processes, kept running.

Life cycle::

    start KV store nodes --wait for gRPC health SERVING--
    start encoders, prefills, decodes (free ports) --wait for gRPC health SERVING--
    start the router --wait for HTTP /health 200-- print the endpoints
    supervise: a child that dies is restarted on the same ports, with back-off (supervisor.py);
               the others keep serving meanwhile
    scale (--autoscale): processes of a role started and registered with the router, or drained
               and stopped, as the router's planner asks (local_scaling.py)
    stop (Ctrl-C / SIGTERM): SIGTERM to every child (they drain), SIGKILL after the grace period

A child that dies while the cluster is still starting aborts the start (everything is stopped,
exit status 1): a command line that cannot come up once will not come up by retrying. Once the
cluster is up, only the launcher's own SIGINT / SIGTERM stops it.

Children also get SIGTERM from the kernel if the launcher itself dies (PR_SET_PDEATHSIG), so
no process outlives ``epd up``. Settings beyond these flags reach the children through their
own environment variables (EPD_PREFILL_*, EPD_DECODE_*, ...), which they inherit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from services.common.config import config_or_exit
from services.engine.models.config import is_llava_dir
from services.engine.threads import format_cpus, usable_cpus
from services.local_scaling import LocalScaler
from services.supervisor import (BackgroundSupervision, Child, ChildFailed, Probe, Supervisor,
                                 remove_shared_memory_of)
from services.up_config import UpConfig, free_port, vllm_python

logger = logging.getLogger("epd.up")
# Child and remove_shared_memory_of live in supervisor.py, UpConfig and free_port in up_config.py;
# benchmarks and tests import them from here.
__all__ = ["Child", "Cluster", "UpConfig", "free_port", "main", "remove_shared_memory_of", "run"]
_SERVICES = {"encoder": "epd.v1.Encoder", "prefill": "epd.v1.Prefill", "decode": "epd.v1.Decode",
             "kvstore": "epd.v1.KVStore"}
"""Role -> the gRPC service name its health check reports."""


class Cluster:
    def __init__(self, config: UpConfig) -> None:
        self.config = config
        self.children: list[Child] = []
        self.admin_token = config.admin_token or secrets.token_urlsafe(24)
        self.needs_keys: bool | None = False
        """Whether the router turned away a request without an API key (known once started;
        None: the router could not be asked)."""
        self._background: BackgroundSupervision | None = None
        self._planner_file: str | None = None

    def _spawn(self, name: str, module: str, args: list[str]) -> Child:
        host = self.config.host
        port, metrics_port = free_port(host), free_port(host)
        # vLLM's engine runs in vLLM's own venv (make setup-vllm); everything else in this one.
        is_vllm = self.config.engine == "vllm" and module in ("services.prefill", "services.decode")
        argv = [vllm_python() if is_vllm else sys.executable, "-m", module, "--host", host, "--port", str(port),
                "--metrics-port", str(metrics_port), *args]
        child = Child(name, f"{host}:{port}", argv, Probe(grpc_service=_SERVICES[name.split("-")[0]]),
                      metrics_url=f"http://{host}:{metrics_port}/metrics")
        child.spawn()
        self.children.append(child)
        return child

    def _engine_args(self, kvstores: list[Child], role: str, index: int) -> list[str]:
        c = self.config
        args = ["--kv-cache-gib", str(c.kv_cache_gib), "--max-num-batched-tokens",
                str(c.max_num_batched_tokens), "--device", c.device, "--dtype", c.dtype,
                "--kv-transport", c.kv_transport, "--cpu-threads", self._cpu_threads(role, index)]
        args += ["--batch-invariant"] if c.batch_invariant else []
        if c.engine != "epd":
            args += ["--engine", c.engine] + (["--engine-args", c.engine_args] if c.engine_args else [])
            # vLLM's CPU attention takes blocks of a multiple of 32 tokens; 128 is its default there.
            args += ["--block-size", "128"] if c.device != "cuda" else []
        args += [arg for child in kvstores for arg in ("--kvstore", child.address)]
        if kvstores:
            args += ["--kvstore-replicas", str(c.kvstore_replicas), "--swa-ttl-s", str(c.swa_ttl_s)]
        return args + (["--model", c.model] if c.model else [])

    def _kvstore_args(self, node: int) -> list[str]:
        c = self.config
        args = ["--node-id", f"kvstore-{node}", "--host-capacity-mib", str(c.kvstore_capacity_mib),
                "--disk-capacity-gib", str(c.kvstore_disk_gib), "--kv-transport", c.kv_transport,
                "--swa-ttl-s", str(c.swa_ttl_s)]
        if disk_dir := c.kvstore_disk_dir(node):
            args += ["--disk-dir", disk_dir]
        return args + (["--redis-url", c.redis] if c.redis else [])

    def spawn_instance(self, role: str) -> Child:
        """One more process of ``role`` (prefill, decode, encoder), started, not yet healthy."""
        index = 1 + max((int(child.name.rsplit("-", 1)[1]) for child in self.children
                         if child.name.rsplit("-", 1)[0] == role), default=-1)
        name = f"{role}-{index}"
        if role == "encoder":
            return self._spawn(name, "services.encoder", ["--model", self.config.model] if self.config.model else [])
        kvstores = self.role_children("kvstore")
        args = self._engine_args(kvstores, role, index) + ["--instance-id", name]
        if role == "decode" and self.config.device != "cuda" and self.config.decode_nice:
            args += ["--nice", str(self.config.decode_nice)]
        return self._spawn(name, f"services.{role}", args)

    def _cpu_threads(self, role: str, index: int) -> str:
        """An engine process's --cpu-threads: with "prefill", CPU prefills bind to every CPU and
        decodes stay unbound; with "split", the cluster's first prefills and decodes each take
        an equal run of the usable CPUs (prefills first), when every one of them can have at
        least one; anything else shares them unbound."""
        c = self.config
        if c.cpu_threads == "prefill":
            return "auto" if role == "prefill" and c.device != "cuda" else "off"
        if c.cpu_threads != "split":
            return c.cpu_threads
        cpus, num_engines = usable_cpus(), c.prefills + c.decodes
        slot = index if role == "prefill" else c.prefills + index
        if c.device == "cuda" or len(cpus) < num_engines or index >= (c.prefills if role == "prefill" else c.decodes):
            return "off"
        share = len(cpus) // num_engines
        return format_cpus(cpus[slot * share:(slot + 1) * share])

    def role_children(self, role: str) -> list[Child]:
        return [child for child in self.children if child.name.rsplit("-", 1)[0] == role]

    @property
    def router(self) -> Child:
        return self.child("router")

    def router_argv(self) -> list[str]:
        """The router's command line for the instances of now (a router restarted after a
        scaling starts with them)."""
        return self._router(self.role_children("encoder"), self.role_children("prefill"),
                            self.role_children("decode")).argv

    def _router(self, encoders: list[Child], prefills: list[Child], decodes: list[Child]) -> Child:
        c = self.config
        args = [arg for child in prefills for arg in ("--prefill", child.address)]
        args += [arg for child in decodes for arg in ("--decode", child.address)]
        args += [arg for child in encoders for arg in ("--encoder", child.address)]
        args += ["--admin-port", str(c.admin_port)]
        if c.autoscale:
            args += ["--planner", "launcher", "--planner-config", c.planner_config or self._planner_config_file()]
        args += [arg for flag, value in (("--prefill-policy", c.prefill_policy),
                                         ("--decode-policy", c.decode_policy)) if value for arg in (flag, value)]
        args += ["--api-keys-file", c.api_keys] if c.api_keys else []
        args += ["--redis-url", c.redis] if c.redis else []  # keys and limits shared through it
        # Secrets go by environment, not argv: other users can read a process's argv.
        env = {"EPD_ROUTER_ADMIN_TOKEN": self.admin_token}
        if c.api_key:
            env["EPD_ROUTER_API_KEYS"] = ",".join(c.api_key)
        url = f"http://{c.host}:{c.port}"
        return Child("router", f"{c.host}:{c.port}", [
            sys.executable, "-m", "services.router", "--host", c.host, "--port", str(c.port), *args],
            Probe(http_url=url + "/health"), metrics_url=url + "/metrics", env=env)

    def _planner_config_file(self) -> str:
        """--autoscale's default planner settings, in a file of their own (removed at stop)."""
        if self._planner_file is None:
            c = self.config
            roles = {"prefill": {"min_replicas": c.prefills, "max_replicas": c.autoscale_max},
                     "decode": {"min_replicas": c.decodes, "max_replicas": c.autoscale_max}}
            fd, self._planner_file = tempfile.mkstemp(prefix="epd-planner-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump({"roles": roles}, f)
        return self._planner_file

    async def start(self) -> str:
        """Start every process; the router's base URL once everything is healthy. Raises
        ChildFailed (a RuntimeError) if one exits or is not healthy in time."""
        c = self.config
        kvstores = [self._spawn(f"kvstore-{i}", "services.kvstore", self._kvstore_args(i)) for i in range(c.kvstores)]
        await self._wait_healthy(kvstores)
        if c.num_encoders and not is_llava_dir(c.model) and not os.environ.get("EPD_ENCODER_WEIGHTS"):
            logger.warning("the encoders' vision tower is random (no EPD_ENCODER_WEIGHTS): images are "
                           "accepted, but what the model says about them means nothing")
        encoders = [self.spawn_instance("encoder") for _ in range(c.num_encoders)]
        prefills = [self.spawn_instance("prefill") for _ in range(c.prefills)]
        decodes = [self.spawn_instance("decode") for _ in range(c.decodes)]
        await self._wait_healthy(encoders + prefills + decodes)
        router = self._router(encoders, prefills, decodes)
        router.spawn()
        self.children.append(router)
        await self._wait_healthy([router])
        url = f"http://{router.address}"
        try:  # asked, not guessed: keys may also come from Redis
            async with httpx.AsyncClient() as client:
                self.needs_keys = (await client.get(url + "/v1/models", timeout=10)).status_code == 401
        except httpx.HTTPError as exc:  # only the banner needs it: no reason to stop the cluster
            logger.warning("could not ask the router whether its API needs keys: %r", exc)
            self.needs_keys = None
        return url

    async def _wait_healthy(self, children: list[Child]) -> None:
        await asyncio.gather(*(child.wait_healthy(self.config.startup_timeout_s) for child in children))

    def child(self, name: str) -> Child:
        return next(child for child in self.children if child.name == name)

    async def supervise(self, stop: asyncio.Event) -> None:
        """Restart every child that dies, until ``stop`` is set (in this event loop); with
        --autoscale, also start and stop processes as the router's planner asks."""
        scaling = asyncio.ensure_future(LocalScaler(self).follow(stop)) if self.config.autoscale else None
        try:
            await Supervisor(self.children, self.config.startup_timeout_s).run(stop)
        finally:   # a scaling step in progress (a start, a drain) is not waited for: stop() ends it
            if scaling is not None:
                scaling.cancel()
                await asyncio.gather(scaling, return_exceptions=True)

    async def stop_child(self, child: Child) -> None:
        """One child out of supervision and stopped: SIGTERM (it drains), SIGKILL after the grace period."""
        self.children.remove(child)   # first: the supervisor must not restart it
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(child.process.wait, self.config.stop_timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in time: killing it", child.name)
            child.process.kill()
            await asyncio.to_thread(child.process.wait)
        except asyncio.CancelledError:   # the cluster is stopping: stop() waits for it with the rest
            self.children.append(child)
            raise
        remove_shared_memory_of(child.process.pid)

    def supervise_in_background(self) -> None:
        """Restart every child that dies, from a thread of its own, until :meth:`stop`: for a
        caller with no event loop running (tests)."""
        assert self._background is None, "already supervised"
        self._background = BackgroundSupervision(_Supervision(self)).start()

    def stop(self) -> None:
        """No more restarts; SIGTERM everything (router first, so no new work arrives), then
        SIGKILL stragglers."""
        if self._background is not None:
            self._background.stop()
        try:
            for child in reversed(self.children):
                if child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.config.stop_timeout_s
            for child in self.children:
                try:
                    child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in time: killing it", child.name)
                    child.process.kill()
                    child.process.wait()
                remove_shared_memory_of(child.process.pid)
        finally:
            if self._background is not None:
                self._background.close()
            if self._planner_file is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._planner_file)


@dataclass(frozen=True)
class _Supervision:
    """What BackgroundSupervision runs: the cluster's supervision (restarts, and scaling with --autoscale)."""

    cluster: Cluster

    async def run(self, stop: asyncio.Event) -> None:
        await self.cluster.supervise(stop)


async def run(config: UpConfig) -> int:
    return await serve(Cluster(config), announce)


async def serve(cluster: Cluster, announce: Callable[[Cluster, str], None]) -> int:
    """Start ``cluster``, ``announce`` it, supervise until SIGINT / SIGTERM, stop it; the exit
    status. Ctrl-C while it starts stops it too. (services.ray_cluster serves its cluster here.)"""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        starting = asyncio.ensure_future(cluster.start())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            return 0
        announce(cluster, starting.result())
        await cluster.supervise(stop)
        return 0
    except ChildFailed as exc:
        logger.error("%s: stopping the cluster", exc)
        return 1
    finally:
        await asyncio.to_thread(cluster.stop)


def announce(cluster: Cluster, url: str) -> None:
    config = cluster.config
    for child in cluster.children:
        print(f"  {child.name:<10} {child.address}  (pid {child.process.pid})", flush=True)
    print(f"  admin API  http://127.0.0.1:{config.admin_port}/admin/  token {cluster.admin_token}"
          f"  (export EPD_ROUTER_ADMIN_TOKEN=... for epd admin)", flush=True)
    if cluster.needs_keys:
        print("  API keys   required: Authorization: Bearer KEY or x-api-key: KEY"
              "  (epd admin keys create TENANT adds one)", flush=True)
    elif cluster.needs_keys is None:
        print("  API keys   unknown: the router did not answer GET /v1/models", flush=True)
    else:
        print(f"  API keys   none: the API is open to anyone who can reach {config.host}"
              "  (add some: --api-key KEY, or --api-keys FILE / --redis URL and epd admin keys create)", flush=True)
    print(f"epd is up: {url}/v1  (OpenAI API; a process that dies is restarted; Ctrl-C stops everything)",
          flush=True)


def parse(argv: list[str] | None = None) -> UpConfig:
    """``epd up``'s settings; logging set up for it (the caller then runs :func:`main` with them,
    or services.ray_cluster's with --ray)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return config_or_exit(UpConfig, argv, "up", prog="epd up")


def main(config: UpConfig) -> int:
    return asyncio.run(run(config))
