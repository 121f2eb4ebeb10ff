"""``epd up`` as a user runs it: everything starts, a child that dies is restarted, and nothing
outlives it."""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from services.common.config import ConfigError, parse_config
from services.engine.threads import cpu_list
from services.launcher import UpConfig, free_port

ROOT = Path(__file__).resolve().parents[2]


def test_encoders_start_for_a_vision_model_or_when_asked():
    """Auto (the default): no model the engine loads has a vision tower, so none start and images
    are a 400; --encoders N starts N (their tower random unless EPD_ENCODER_WEIGHTS)."""
    assert parse_config(UpConfig, [], "up", env={}).num_encoders == 0
    assert parse_config(UpConfig, ["--encoders", "none"], "up", env={}).encoders is None
    assert parse_config(UpConfig, ["--encoders", "2"], "up", env={}).num_encoders == 2
    assert parse_config(UpConfig, [], "up", env={"EPD_UP_ENCODERS": "1"}).num_encoders == 1
    with pytest.raises(ConfigError, match="--encoders / EPD_UP_ENCODERS"):
        parse_config(UpConfig, ["--encoders", "-1"], "up", env={})


def start_up(model_dir: Path, port: int, roles: tuple[str, ...] = ("--encoders", "1", "--prefills", "1", "--decodes", "2"),
             ) -> tuple[subprocess.Popen, list[int]]:
    log = tempfile.TemporaryFile(mode="w+")  # epd up's stderr: what went wrong, if it fails to start
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--model", str(model_dir), *roles,
         "--port", str(port), "--kv-cache-gib", "0.02", "--device", "cpu",
         "--kvstore-dir", "none", "--kvstore-capacity-mib", "32", "--admin-port", str(free_port("127.0.0.1"))],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    pids = []
    with log:
        for line in process.stdout:
            if match := re.search(r"\(pid (\d+)\)", line):
                pids.append(int(match.group(1)))
            if line.startswith("epd is up"):
                return process, pids
        status = process.wait()
        process.stdout.close()
        log.seek(0)
        raise AssertionError(f"epd up exited with {status} before it was up; its stderr ends:\n{log.read()[-3000:]}")


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone; so does one reaped since.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if is_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def image_message(uri: str) -> dict:
    return {"model": "tiny-chat0", "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": uri}}]}]}


def check_images(port: int) -> None:
    """An image goes router -> encoder -> prefill (spliced) -> decode; a broken one is a 400."""
    picture = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(picture, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    reply = httpx.post(url, json=image_message(uri), timeout=60)
    assert reply.status_code == 200, reply.text
    text_only = httpx.post(url, timeout=60, json={**image_message(uri), "messages": [
        {"role": "user", "content": "What is in this picture?"}]}).json()
    # One placeholder token became one token per patch (196 for a 224x224 image, 16x16 patches).
    # (plus the newline that joins the text and image parts)
    assert 196 <= reply.json()["usage"]["prompt_tokens"] - text_only["usage"]["prompt_tokens"] <= 197
    broken = httpx.post(url, json=image_message("data:image/png;base64,bm90IGFuIGltYWdl"), timeout=60)
    assert broken.status_code == 400 and "image" in broken.json()["error"]["message"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_epd_up_serves_and_leaves_no_orphan(tiny_chat_model_dir, sig):
    port = free_port("127.0.0.1")
    process, pids = start_up(tiny_chat_model_dir, port)
    try:
        assert len(pids) == 6  # store node, encoder, prefill, 2 decodes, router
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": "tiny-chat0", "prompt": "Hello", "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        if sig == signal.SIGTERM:
            check_images(port)
        process.send_signal(sig)
        # SIGKILL gives the launcher no chance to clean up: the kernel's parent-death signal must.
        assert wait_gone(pids) == []
        assert process.wait(timeout=30) == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
        for pid in pids:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not [f for f in os.listdir("/dev/shm") if any(f"-{pid}-" in f for pid in pids)]


def children_of(pid: int) -> dict[int, str]:
    """Live child processes of ``pid``: pid -> command line."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return found


def test_epd_up_restarts_a_killed_child_and_only_its_own_signal_stops_it(tiny_chat_model_dir):
    port = free_port("127.0.0.1")
    process, pids = start_up(tiny_chat_model_dir, port)
    decode = pids[3]  # store node, encoder, prefill, decode-0, decode-1, router
    try:
        args = children_of(process.pid)[decode]
        os.kill(decode, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (back := [pid for pid, cmd in children_of(process.pid).items() if cmd == args and pid != decode]) == []:
            assert process.poll() is None, "epd up stopped when a child died"
            assert time.monotonic() < deadline, "the killed decode was not restarted"
            time.sleep(0.1)
        for _ in range(4):  # still serving (round robin over both decodes once the new one reports)
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                               json={"model": "tiny-chat0", "prompt": "Hello", "max_tokens": 4})
            assert reply.status_code == 200, reply.text
        assert process.poll() is None
        process.send_signal(signal.SIGTERM)
        assert wait_gone([pid for pid in pids if pid != decode] + back) == []
        assert process.wait(timeout=30) == 0
    finally:
        for pid in children_of(process.pid):
            os.kill(pid, signal.SIGKILL)
        process.kill()
        process.wait()
        process.stdout.close()
    assert not [f for f in os.listdir("/dev/shm") if any(f"-{pid}-" in f for pid in pids + back)]


def threads_of(pid: int) -> list[tuple[set[int], int]]:
    """Each thread of a process: the CPUs it may run on and its nice value (the kernel's record)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        line = next(ln for ln in (task / "status").read_text().splitlines() if ln.startswith("Cpus_allowed_list"))
        nice = int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
        found.append((set(cpu_list(line.split()[1])), nice))
    return found


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a CPU each needs two CPUs")
def test_epd_up_places_its_engines_threads(tiny_chat_model_dir):
    """--cpu-threads split: the engine thread and its team of each engine bound to its own share
    of the CPUs (a core each here); the decode's at a lower priority (--decode-nice, 10 by
    default); the servers' other threads left free, at normal priority."""
    cpus = sorted(os.sched_getaffinity(0))
    port = free_port("127.0.0.1")
    process, pids = start_up(tiny_chat_model_dir, port, ("--encoders", "0", "--prefills", "1", "--decodes", "1",
                                                         "--cpu-threads", "split"))
    try:
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": "tiny-chat0", "prompt": "Hello", "max_tokens": 4})
        assert reply.status_code == 200  # both engines have stepped: placed on their first step
        roles = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[2].decode() for pid in pids}
        share = len(cpus) // 2
        for pid, role in roles.items():
            found = threads_of(pid)
            if role in ("services.prefill", "services.decode"):
                first = 0 if role == "services.prefill" else share
                nice = 10 if role == "services.decode" else 0
                assert (set(cpus[first:first + share]), nice) in found, (role, found)
            assert (set(cpus), 0) in found, (role, "the other threads are free", found)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        process.stdout.close()
