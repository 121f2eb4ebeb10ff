"""The supervisor with real (tiny) processes: a killed child comes back on its port with its
restart count, a crash-looping one backs off and never stops the others."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from services.common.metrics import RESTART_COUNT_ENV, restart_count
from services.common.wire import LoadReport, load_from_proto, load_to_proto
from services.launcher import free_port
from services.supervisor import Backoff, BackgroundSupervision, Child, ChildFailed, Probe, Supervisor


def http_child(name: str) -> Child:
    """A child that answers HTTP 200 on its port once up (python -m http.server)."""
    port = free_port("127.0.0.1")
    return Child(name, f"127.0.0.1:{port}", [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                 Probe(http_url=f"http://127.0.0.1:{port}/"))


def test_free_port_never_hands_out_a_port_twice_in_one_process():
    """Children bind their ports only after loading a model, so until then a port looks free; two
    draws of it started two children on one port (a CI failure: prefill's gRPC port was decode's
    metrics port)."""
    ports = [free_port("127.0.0.1") for _ in range(1500)]
    assert len(set(ports)) == len(ports)


def environ_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


def wait_until(condition, timeout_s: float = 20.0) -> float:
    """Seconds it took ``condition()`` to hold."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.02)
    return time.monotonic() - start


def stop_all(children: list[Child]) -> None:
    for child in children:
        if child.process is not None and child.process.poll() is None:
            child.process.kill()
        if child.process is not None:
            child.process.wait()


def test_backoff_doubles_to_its_cap_and_resets_after_a_long_run():
    backoff = Backoff(initial_s=0.5, max_s=30.0, reset_after_s=60.0)
    delays, delay = [], 0.0
    for _ in range(9):
        delay = backoff.next_delay(delay, up_for_s=1.0)
        delays.append(delay)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert backoff.next_delay(30.0, up_for_s=60.0) == 0.5


def test_a_killed_child_comes_back_on_its_port_with_its_restart_count():
    child = http_child("web")
    try:
        first = child.spawn()
        asyncio.run(child.wait_healthy(20))
        assert environ_of(first.pid)[RESTART_COUNT_ENV] == "0"
        supervision = BackgroundSupervision(Supervisor([child], startup_timeout_s=20,
                                                       backoff=Backoff(initial_s=0.05))).start()
        try:
            os.kill(first.pid, signal.SIGKILL)
            wait_until(lambda: child.num_restarts == 1 and child.healthy_since is not None)
            assert child.process.pid != first.pid and asyncio.run(child.probe.is_healthy(child.address))
            assert environ_of(child.process.pid)[RESTART_COUNT_ENV] == "1"
            child.process.terminate()  # any end, not only a crash: restarted all the same
            wait_until(lambda: child.num_restarts == 2 and child.healthy_since is not None)
            supervision.stop()
            time.sleep(0.3)  # the restarted child outlives stop(): its owner stops it
            assert child.process.poll() is None
            child.process.kill()
            child.process.wait()
            time.sleep(0.3)
            assert child.num_restarts == 2  # stopped supervising: no more restarts
        finally:
            supervision.close()
    finally:
        stop_all([child])


def test_closing_the_supervision_thread_takes_the_children_it_started_along():
    child = http_child("web")
    try:
        first = child.spawn()
        asyncio.run(child.wait_healthy(20))
        supervision = BackgroundSupervision(Supervisor([child], 20, backoff=Backoff(initial_s=0.05))).start()
        os.kill(first.pid, signal.SIGKILL)
        wait_until(lambda: child.num_restarts == 1 and child.healthy_since is not None)
        supervision.close()  # PR_SET_PDEATHSIG: the thread that forked it ended
        assert child.process.wait(timeout=10) == -signal.SIGTERM
    finally:
        stop_all([child])


def test_a_crash_loop_backs_off_forever_and_the_others_are_untouched():
    steady = http_child("steady")
    failing = Child("failing", "127.0.0.1:1", [sys.executable, "-c", "raise SystemExit(3)"], Probe(grpc_service="x"))
    try:
        steady.spawn()
        asyncio.run(steady.wait_healthy(20))
        steady_pid = steady.process.pid
        failing.spawn()
        with pytest.raises(ChildFailed, match="exited with status 3 while starting"):
            asyncio.run(failing.wait_healthy(20))
        supervision = BackgroundSupervision(Supervisor([steady, failing], startup_timeout_s=20,
                                                       backoff=Backoff(initial_s=0.05, max_s=0.2))).start()
        try:
            wait_until(lambda: failing.num_restarts >= 5)
            assert failing.delay_s == 0.2  # 0.05, 0.1, 0.2, 0.2, ...
        finally:
            supervision.close()
        assert steady.process.pid == steady_pid and steady.num_restarts == 0
    finally:
        stop_all([steady, failing])


def test_the_restart_count_reaches_the_process_and_its_load_report(monkeypatch):
    monkeypatch.setenv(RESTART_COUNT_ENV, "3")
    assert restart_count() == 3
    monkeypatch.setenv(RESTART_COUNT_ENV, "nonsense")
    assert restart_count() == 0
    report = LoadReport("decode-0", "decode", num_running=1, num_restarts=3)
    assert load_from_proto(load_to_proto(report)) == report


def test_autoscale_settings_are_checked_only_with_autoscale():
    from services.common.config import ConfigError
    from services.launcher import UpConfig

    assert UpConfig(prefills=6).autoscale_max == 4          # no --autoscale: the maximum is not in play
    with pytest.raises(ConfigError, match="autoscale_max: must be >= --prefills and --decodes"):
        UpConfig(prefills=6, autoscale=True)
