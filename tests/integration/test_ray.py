"""``epd up --ray`` on a two-node Ray cluster on this machine: a head node (prefill, store node,
router; host id node-a) and a worker node (decode; host id node-b), told apart by custom resources
and by EPD_HOST_ID in each raylet's environment. One ``epd up --ray`` for the module, driven as a
user would (a subprocess, SIGTERM at the end); the tests run in order:

    answers equal the offline engine, KV over TCP between the nodes
    a decode actor's worker, or its service process, killed: Ray restarts the actor, it rejoins,
    new requests succeed
    epd admin scale decode 3: a third decode actor serves; scale decode 2: it drains, then stops
    SIGTERM: every actor dead, the placement group removed, no /dev/shm pool, no slot file left
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.transfer.memory import SHM_PREFIX
from services.engine import LLM, SamplingParams
from services.launcher import free_port
from services.ray_cluster.slot import slot_path
from services.supervisor import SHM_DIR
from tests.cluster import SteadyLoad
from tests.factories import random_prompts
from tests.integration.test_cluster import completions

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
TOKEN = "ray-token"
NODES = {"node-a": {"epd_prefill": 8, "epd_kvstore": 4, "epd_router": 2}, "node-b": {"epd_decode": 8}}
LINE = re.compile(r"^  (\S+)\s+(\S+)  \(pid (\d+), actor pid (\d+), node (\w+), host id (\S+)\)  metrics (\S*)$")
WAIT_S = 180.0
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
"""For every Ray process here (nodes, epd up, this one): no token file of an earlier Ray on this
machine decides whether this cluster wants one."""
PLANNER = {"roles": {"prefill": {"min_replicas": 2, "max_replicas": 2},
                     "decode": {"min_replicas": 2, "max_replicas": 3}},
           "decode_max_running": 64}   # no scaling of its own during the tests: only `epd admin scale`


def ray_start(args: list[str], host_id: str, resources: dict, log: Path) -> subprocess.Popen:
    """One Ray node in the foreground (``--block``): SIGTERM to it stops that node only."""
    env = {**os.environ, **RAY_ENV, "EPD_HOST_ID": host_id}
    with log.open("w") as out:   # the child keeps its own descriptor
        return subprocess.Popen([RAY, "start", "--block", *args, "--num-cpus", "4", "--resources",
                                 json.dumps(resources), "--object-store-memory", str(100 * 2**20),
                                 "--disable-usage-stats"], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def is_listening(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        return True


def wait_until(condition, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError, OSError, StopIteration, KeyError):
            if value := condition():
                return value
        assert time.monotonic() < deadline, f"not in {timeout_s:.0f} s: {what}"
        time.sleep(0.2)


@contextlib.contextmanager
def two_ray_nodes(tmp: Path, patch: pytest.MonkeyPatch):
    for name, value in RAY_ENV.items():
        patch.setenv(name, value)
    port = free_port("127.0.0.1")
    address = f"127.0.0.1:{port}"
    nodes = [ray_start(["--head", "--port", str(port), "--include-dashboard=false"], "node-a", NODES["node-a"],
                       tmp / "ray-head.log")]
    try:
        wait_until(lambda: is_listening(port), "the Ray head")
        nodes.append(ray_start(["--address", address], "node-b", NODES["node-b"], tmp / "ray-worker.log"))
        ray.init(address=address, logging_level="error", log_to_driver=False)
        wait_until(lambda: sum(n["Alive"] for n in ray.nodes()) == 2, "two Ray nodes")
        yield address
    finally:
        ray.shutdown()
        for node in nodes:
            node.send_signal(signal.SIGTERM)
        for node in nodes:
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.kill()


class EpdUp:
    """``epd up --ray`` as a subprocess; its stdout read by a thread (Ray streams every actor's
    log to it), the lines where each actor runs parsed."""

    def __init__(self, address: str, model_dir: Path, tmp: Path) -> None:
        planner = tmp / "planner.json"
        planner.write_text(json.dumps(PLANNER))
        self.port, self.admin_port = free_port("127.0.0.1"), free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: list[str] = []
        self.stderr = tmp / "epd-up.err"
        with self.stderr.open("w") as err:
            self.process = self._start(address, model_dir, planner, err)
        threading.Thread(target=self._read, daemon=True).start()

    def _start(self, address: str, model_dir: Path, planner: Path, err) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--ray", "--ray-address", address, "--model", str(model_dir),
             "--prefills", "2", "--decodes", "2", "--kvstores", "1", "--port", str(self.port),
             "--admin-port", str(self.admin_port), "--admin-token", TOKEN, "--kv-cache-gib", "0.05",
             "--device", "cpu", "--kvstore-dir", "none", "--kvstore-capacity-mib", "32", "--autoscale",
             "--planner-config", str(planner), "--autoscale-max", "3", "--stop-timeout-s", "20"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, **RAY_ENV})

    def _read(self) -> None:
        with self.process.stdout:
            for line in self.process.stdout:
                self.lines.append(line.rstrip("\n"))

    def wait_up(self) -> None:
        def up():
            assert self.process.poll() is None, f"epd up --ray exited: {self.stderr.read_text()[-3000:]}"
            return any(line.startswith("epd is up on Ray") for line in self.lines)
        wait_until(up, "epd up --ray is up", timeout_s=300)

    def actors(self) -> dict[str, dict]:
        """Each actor's last announced line: address, pid, actor pid, node, host id, metrics."""
        found = {}
        for line in list(self.lines):
            if match := LINE.match(line):
                name, address, pid, actor_pid, node, host_id, metrics = match.groups()
                found[name] = {"address": address, "pid": int(pid), "actor_pid": int(actor_pid), "node": node,
                               "host_id": host_id, "metrics": metrics}
        return found

    def admin(self, method: str, path: str) -> httpx.Response:
        return httpx.request(method, f"http://127.0.0.1:{self.admin_port}/admin{path}",
                             headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)

    def instances(self) -> dict[str, dict]:
        return {i["id"]: i for i in self.admin("GET", "/instances").json()}

    def metric(self, name: str, metric: str, **labels: str) -> float:
        text = httpx.get(self.actors()[name]["metrics"], timeout=5).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def up(tiny_chat_model_dir):
    tmp = Path(tempfile.mkdtemp(prefix="epd-ray-test-"))
    try:
        with pytest.MonkeyPatch.context() as patch, two_ray_nodes(tmp, patch) as address:
            running = EpdUp(address, tiny_chat_model_dir, tmp)
            try:
                running.wait_up()
                yield running
            finally:
                if running.process.poll() is None:
                    running.process.send_signal(signal.SIGTERM)
                    running.process.wait(timeout=120)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def mapped_pools_of_others(pid: int) -> list[str]:
    """KV pools of other processes this one maps: shared memory does that, TCP never does."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({line.split()[-1] for line in maps if SHM_PREFIX in line and f"{SHM_PREFIX}{pid}-" not in line})


def test_prefill_and_decode_on_two_nodes_answer_like_the_offline_engine_over_tcp(up, tiny_chat_model_dir):
    actors = up.actors()
    nodes = {name: (a["node"], a["host_id"]) for name, a in actors.items()}
    assert {nodes["prefill-0"], nodes["prefill-1"], nodes["kvstore-0"]} == {nodes["router"]}
    assert nodes["decode-0"] == nodes["decode-1"] != nodes["prefill-0"]
    assert nodes["prefill-0"][1] == "node-a" and nodes["decode-0"][1] == "node-b"
    prompts = random_prompts(4, [5, 300, 64, 150], vocab=49152, seed=43)
    params = dict(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in LLM(str(tiny_chat_model_dir), num_kv_blocks=1024).generate(
        prompts, SamplingParams(**params))]
    done = sum(up.metric(d, "epd_kv_transfers_total", result="done") for d in ("decode-0", "decode-1"))
    assert asyncio.run(completions(up.url, prompts, **params)) == expected
    # Every prompt's KV crossed from node-a to node-b, and no decode maps a prefill's pool: TCP.
    assert sum(up.metric(d, "epd_kv_transfers_total", result="done") for d in ("decode-0", "decode-1")) \
        == done + len(prompts)
    assert sum(up.metric(d, "epd_kv_transfers_total", result="failed") for d in ("decode-0", "decode-1")) == 0
    assert all(mapped_pools_of_others(actors[d]["pid"]) == [] for d in ("decode-0", "decode-1"))
    # And the metric says which transport moved the bytes.
    for transport, expected_nonzero in (("tcp", True), ("shm", False)):
        moved = sum(up.metric(d, "epd_kv_transfer_bytes_total", transport=transport) for d in ("decode-0", "decode-1"))
        assert (moved > 0) == expected_nonzero, (transport, moved)


@pytest.mark.parametrize("name, which", [("decode-0", "actor_pid"), ("decode-1", "pid")],
                         ids=["the-actors-worker", "the-service-process"])
def test_a_killed_decode_is_restarted_by_ray_and_rejoins(up, name, which):
    """SIGKILL to the actor's worker, or to the service process it owns (the actor then exits):
    either way Ray restarts the actor, which starts the service again on the same address."""
    old = up.actors()[name]
    with SteadyLoad(up.url, num_threads=2) as load:
        load.wait_for(4, since=0)
        killed_at = time.monotonic()
        os.kill(old[which], signal.SIGKILL)
        wait_until(lambda: any(line.startswith(f"{name} restarted by Ray") for line in up.lines),
                   f"{name} restarted by Ray")
        new = up.actors()[name]   # its line, printed again with the new pids
        wait_until(lambda: up.instances()[name]["healthy"] and up.instances()[name]["restarts"] == 1,
                   f"{name} healthy again in the router")
        wait_until(lambda: up.metric(name, "epd_kv_transfers_total", result="done") > 0, f"{name} serves again")
        back_at = time.monotonic()
        load.wait_for(6, since=back_at)
    in_flight = [o.error for o in load.failures(until=killed_at)]
    after = [o.error for o in load.failures(since=killed_at)]
    print(f"\n{name}: {which} killed: {len(in_flight)} in-flight and {len(after)} later request(s) failed, "
          f"{len(load.outcomes)} sent")
    assert new["actor_pid"] != old["actor_pid"] and new["pid"] != old["pid"] and new["address"] == old["address"]
    assert not Path(f"/proc/{old['pid']}").exists()   # the old process is gone, not left draining
    assert after == [], after       # the router's rules: only requests already on the dead decode may fail
    assert len(in_flight) <= 2      # at most one in flight per load thread
    assert load.num_served(back_at) > 0


def test_epd_admin_scale_adds_a_decode_actor_that_serves_and_drains_it_after(up):
    env = {**os.environ, "EPD_ROUTER_ADMIN_TOKEN": TOKEN}
    admin = [sys.executable, "-m", "services.cli", "admin", "--url", f"http://127.0.0.1:{up.admin_port}"]
    with SteadyLoad(up.url, num_threads=2) as load:
        subprocess.run([*admin, "scale", "decode", "3"], env=env, check=True, cwd=ROOT, capture_output=True)
        wait_until(lambda: "decode-2" in up.actors() and up.instances()["decode-2"]["healthy"], "decode-2 joins")
        assert up.actors()["decode-2"]["host_id"] == "node-b"
        wait_until(lambda: up.metric("decode-2", "epd_kv_transfers_total", result="done") > 0, "decode-2 serves")
        subprocess.run([*admin, "scale", "decode", "2"], env=env, check=True, cwd=ROOT, capture_output=True)
        wait_until(lambda: "decode-2" not in up.instances(), "decode-2 leaves the router")
        name = next(a["Name"] for a in ray._private.state.actors().values() if a["Name"].endswith("-decode-2"))
        wait_until(lambda: ray._private.state.actors()[_actor_id(name)]["State"] == "DEAD", "decode-2's actor stops")
        load.wait_for(4, since=time.monotonic())
    assert load.failures() == [], [o.error for o in load.failures()][:3]
    assert sorted(up.instances()) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]


def _actor_id(name: str) -> str:
    return next(actor_id for actor_id, a in ray._private.state.actors().items() if a["Name"] == name)


def test_sigterm_stops_every_actor_and_leaves_nothing_behind(up):
    pids = {a["pid"] for a in up.actors().values()} | {int(m.group(1)) for line in up.lines
                                                        if (m := re.search(r", pid (\d+), restart", line))}
    run_id = next(a["Name"] for a in ray._private.state.actors().values()
                  if a["Name"].endswith("-router")).split("-")[1]
    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(timeout=120) == 0
    ours = {a["Name"]: a["State"] for a in ray._private.state.actors().values()
            if a["Name"].startswith(f"epd-{run_id}-")}
    assert len(ours) >= 7 and set(ours.values()) == {"DEAD"}, ours
    groups = ray.util.placement_group_table().values()
    assert [g["state"] for g in groups if g["name"].startswith(f"epd-{run_id}-")] == ["REMOVED"]
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]
    assert [f for f in os.listdir(SHM_DIR) if any(f.lstrip(".").startswith(f"{SHM_PREFIX}{p}-") for p in pids)] == []
    assert list(slot_path(f"{run_id}-x").parent.glob(f"{run_id}-*")) == []
