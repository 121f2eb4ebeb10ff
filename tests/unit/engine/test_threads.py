"""Thread placement: CPU lists read and written, the model-running thread's team really bound
and niced (the OS's own record of each thread), and epd up's split of CPUs between engines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from services.common.config import ConfigError
from services.common.errors import InvalidRequestError
from services.engine import LLM, SamplingParams
from services.engine import threads
from services.engine.serving.instance import ServingConfig
from services.launcher import Cluster, UpConfig
from tests.factories import make_tiny_model_dir


def test_cpu_lists_are_read_checked_and_written(monkeypatch):
    monkeypatch.setattr(threads, "usable_cpus", lambda: [0, 1, 2, 3, 6, 7])
    assert threads.parse_cpus("off") is None
    assert threads.parse_cpus("auto") == [0, 1, 2, 3, 6, 7]
    assert threads.parse_cpus("0-2,7") == [0, 1, 2, 7]
    assert threads.parse_cpus(" 3,3,1 ") == [1, 3]
    with pytest.raises(InvalidRequestError, match=r"CPUs \[4, 5\] are not usable"):
        threads.parse_cpus("3-5")
    with pytest.raises(InvalidRequestError, match="not auto, off or a CPU list"):
        threads.parse_cpus("all")
    assert threads.format_cpus([7, 0, 1, 2, 6]) == "0-2,6-7"
    assert threads.format_cpus([3]) == "3"


def test_a_bad_cpu_list_or_nice_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match="cpu_threads"):
        LLM(None, cpu_threads="99999")
    with pytest.raises(ConfigError, match="nice"):
        LLM(None, nice=-1)
    with pytest.raises(ConfigError, match="decode_nice"):
        UpConfig(decode_nice=20)


def threads_cpus(pid: int) -> dict[int, set[int]]:
    """Each thread of a process: the CPUs the OS lets it run on."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "status").read_text()
        listed = next(line for line in text.splitlines() if line.startswith("Cpus_allowed_list")).split()[1]
        out[int(task.name)] = set(threads.cpu_list(listed))
    return out


def test_the_thread_that_runs_the_model_and_its_team_are_bound_and_niced_as_asked(tmp_path, kernels):
    cpus = sorted(os.sched_getaffinity(0))
    wanted = cpus[-1:]  # one CPU: the team is the thread itself
    llm = LLM(str(make_tiny_model_dir(tmp_path / "m")), num_kv_blocks=64, cpu_threads=threads.format_cpus(wanted),
              nice=7)
    seen = {}

    def run() -> None:
        # A thread of its own, as the engine thread of a server: binding follows the thread that steps.
        llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3))
        seen["cpus"] = os.sched_getaffinity(0)  # this thread's mask (Linux: pid 0 is the caller)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert seen == {"cpus": set(wanted), "nice": 7}
    assert os.sched_getaffinity(0) == set(cpus), "the caller's thread is left alone"
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0


def test_threads_are_left_free_by_default(tmp_path):
    """Binding is asked for (--cpu-threads auto): in LLM it would pin the caller's thread, and
    every process it starts later would inherit the CPU; and it measured no faster here."""
    cpus = set(os.sched_getaffinity(0))
    llm = LLM(str(make_tiny_model_dir(tmp_path / "m")), num_kv_blocks=64)
    assert llm.engine.runner.threads is None
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3))
    assert ServingConfig().cpu_threads == "off"
    assert all(mask == cpus for mask in threads_cpus(os.getpid()).values())


@pytest.mark.parametrize("cpus, prefills, decodes, expected", [
    # Two CPUs, one prefill and one decode: a core each (epd up's default on this machine).
    ([0, 1], 1, 1, {("prefill", 0): "0", ("decode", 0): "1"}),
    ([0, 1, 2, 3, 4, 5, 6, 7], 1, 2, {("prefill", 0): "0-1", ("decode", 0): "2-3", ("decode", 1): "4-5"}),
    # More engines than CPUs: all of them share, unbound.
    ([0, 1], 1, 2, {("prefill", 0): "off", ("decode", 0): "off", ("decode", 1): "off"}),
])
def test_epd_up_splits_the_cpus_between_its_engines_when_asked(monkeypatch, cpus, prefills, decodes, expected):
    monkeypatch.setattr("services.launcher.usable_cpus", lambda: cpus)
    cluster = Cluster(UpConfig(device="cpu", prefills=prefills, decodes=decodes, cpu_threads="split"))
    assert {key: cluster._cpu_threads(*key) for key in expected} == expected
    # An instance scaled out later shares, unbound; a GPU cluster's engines are not split.
    assert cluster._cpu_threads("decode", decodes) == "off"
    assert Cluster(UpConfig(device="cuda", prefills=prefills, decodes=decodes, cpu_threads="split")
                   )._cpu_threads("prefill", 0) == "off"
    assert Cluster(UpConfig(device="cpu", cpu_threads="auto"))._cpu_threads("prefill", 0) == "auto"
    # The default binds prefills to every CPU and leaves decodes unbound, later ones too
    # (measured faster here, decode niced; see threads.py); "off" leaves every engine unbound.
    default = Cluster(UpConfig(device="cpu", prefills=prefills, decodes=decodes))
    assert [default._cpu_threads(role, i) for role, i in (("prefill", 0), ("prefill", prefills), ("decode", 0),
                                                          ("decode", decodes))] == ["auto", "auto", "off", "off"]
    assert Cluster(UpConfig(device="cpu", cpu_threads="off"))._cpu_threads("prefill", 0) == "off"
    assert Cluster(UpConfig(device="cuda"))._cpu_threads("prefill", 0) == "off"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_servers_compute_threads_sleep_when_idle_unless_told_otherwise(role):
    """libgomp's own record (OMP_DISPLAY_ENV): the server set OMP_WAIT_POLICY before torch loaded
    it, so an idle thread does not spin (GOMP_SPINCOUNT 0); a policy in the environment wins."""
    def libgomp_spincount(**env) -> str:
        environ = {k: v for k, v in os.environ.items() if k not in (threads.WAIT_POLICY, "GOMP_SPINCOUNT")}
        done = subprocess.run([sys.executable, "-m", f"services.{role}", "--help"], capture_output=True,
                              text=True, timeout=120, env={**environ, "OMP_DISPLAY_ENV": "verbose", **env})
        assert done.returncode == 0, done.stderr[-2000:]
        return re.search(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr).group(1)

    assert libgomp_spincount() == "0"
    assert libgomp_spincount(OMP_WAIT_POLICY="active") != "0"
