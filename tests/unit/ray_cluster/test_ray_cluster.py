"""The Ray adapter's pure parts: placement options, restart back-off, command lines, a node's
host id; and that nothing imports Ray unless ``epd up --ray`` runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.transfer.engine import TransferEngine
from services.common.config import ConfigError, parse_config
from services.launcher import UpConfig
from services.ray_cluster import slot as slots
from services.ray_cluster.actor import NODE_IP, resolve_argv
from services.ray_cluster.placement import actor_resources, kvstore_bundles, local_num_cpus

ROOT = Path(__file__).resolve().parents[3]


def test_roles_take_their_node_groups_resource_only_where_a_node_has_it():
    assert actor_resources("decode", {"CPU": 8}, "cpu") == {"num_cpus": 1.0, "num_gpus": 0}
    assert actor_resources("decode", {"CPU": 8, "epd_decode": 2}, "cpu") == {
        "num_cpus": 1.0, "num_gpus": 0, "resources": {"epd_decode": 1}}
    assert actor_resources("kvstore", {"CPU": 8, "epd_decode": 2}, "cpu") == {"num_cpus": 0.5, "num_gpus": 0}


def test_engines_take_a_gpu_where_there_are_gpus_and_the_device_is_not_cpu():
    assert actor_resources("prefill", {"CPU": 8, "GPU": 2}, "auto")["num_gpus"] == 1
    assert actor_resources("decode", {"CPU": 8, "GPU": 1}, "cuda", gpus_per_engine=0.5)["num_gpus"] == 0.5
    assert actor_resources("prefill", {"CPU": 8, "GPU": 2}, "cpu")["num_gpus"] == 0
    assert actor_resources("prefill", {"CPU": 8}, "cuda")["num_gpus"] == 0
    assert actor_resources("router", {"CPU": 8, "GPU": 2}, "cuda")["num_gpus"] == 0
    assert actor_resources("kvstore", {"CPU": 8, "GPU": 2}, "cuda")["num_gpus"] == 0


def test_one_bundle_per_store_node():
    assert kvstore_bundles(2, {"CPU": 8}) == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert kvstore_bundles(1, {"CPU": 8, "epd_kvstore": 3}) == [{"CPU": 0.5, "epd_kvstore": 1}]


def test_a_local_ray_has_the_cpus_epds_actors_reserve():
    roles = {"kvstore": 1, "router": 1, "encoder": 0, "prefill": 2, "decode": 3}
    assert local_num_cpus(roles, 2) == 6
    assert local_num_cpus(roles, 64) == 64


def test_restarts_back_off_and_reset_after_a_long_run():
    assert slots.next_start(None, 100.0) == (0, 0.0)
    first = slots.SlotState(pid=1, num_restarts=0, delay_s=0.0, started=100.0)
    assert slots.next_start(first, 101.0) == (1, 0.5)
    quick = slots.SlotState(pid=2, num_restarts=3, delay_s=4.0, started=100.0)
    assert slots.next_start(quick, 101.0) == (4, 8.0)
    assert slots.next_start(slots.SlotState(3, 5, 30.0, 100.0), 101.0) == (6, 30.0)
    assert slots.next_start(slots.SlotState(3, 5, 30.0, 100.0), 200.0) == (6, 0.5)   # up 100 s


def test_a_slot_state_round_trips_and_is_forgotten(tmp_path, monkeypatch):
    monkeypatch.setattr(slots.tempfile, "gettempdir", lambda: str(tmp_path))
    assert slots.read_state("run-decode-0") is None
    state = slots.SlotState(pid=42, num_restarts=2, delay_s=1.0, started=time.time())
    slots.write_state("run-decode-0", state)
    assert slots.read_state("run-decode-0") == state
    slots.forget("run-decode-0")
    assert slots.read_state("run-decode-0") is None and list(tmp_path.rglob("*.json")) == []


def test_a_leftover_is_ours_only_with_our_slot_in_its_environment():
    env = {**os.environ, slots.SLOT_ENV: "run-x-decode-0"}
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env) as process:
        try:
            deadline = time.monotonic() + 30   # /proc shows the new environment once it has exec'ed
            while not slots.is_ours(process.pid, "run-x-decode-0"):
                assert time.monotonic() < deadline, "never ours"
                time.sleep(0.01)
            assert not slots.is_ours(process.pid, "run-x-decode-1")
            slots.kill_leftover(slots.SlotState(pid=process.pid), "run-x-decode-0")
            assert process.wait(timeout=10) == -9
        finally:
            process.kill()
    assert not slots.is_ours(os.getpid(), "run-x-decode-0")


def test_the_command_line_on_a_node():
    argv = ("/driver/python", "-m", "services.decode", "--host", NODE_IP, "--port", "1234")
    assert resolve_argv(argv, "10.0.0.7", "/node/python") == [
        "/node/python", "-m", "services.decode", "--host", "10.0.0.7", "--port", "1234"]


def test_epd_host_id_makes_transfer_engines_another_host(monkeypatch):
    """What each Ray node's processes inherit from its raylet's environment in the tests."""
    monkeypatch.setenv("EPD_HOST_ID", "node-b")
    engine = TransferEngine(transports=("tcp",))
    try:
        assert engine.host_id == "node-b" and engine.endpoint.host_id == "node-b"
    finally:
        engine.close()


def test_ray_flags_and_their_environment_variables():
    assert parse_config(UpConfig, ["--ray", "--ray-address", "10.0.0.1:6379"], "up", env={}).ray_address \
        == "10.0.0.1:6379"
    assert parse_config(UpConfig, [], "up", env={"EPD_UP_RAY": "true"}).ray
    with pytest.raises(ConfigError, match="--ray-address / EPD_UP_RAY_ADDRESS"):
        parse_config(UpConfig, ["--ray-address", "auto"], "up", env={})


def test_nothing_imports_ray_without_the_ray_flag():
    code = ("import sys, services.cli, services.launcher, services.local_scaling, services.router.__main__; "
            "services.launcher.parse(['--prefills', '1']); assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
