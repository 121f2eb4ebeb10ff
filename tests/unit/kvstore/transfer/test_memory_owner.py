"""A region file lives as long as its owner: a killed owner's file is removed by the next
allocation anywhere (whoever makes it), a live owner's never, and readers take no lock."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.transfer import MemoryRegion
from kvstore.transfer.memory import SHM_PREFIX, remove_stale_regions

ROOT = Path(__file__).resolve().parents[4]
OWNER = textwrap.dedent("""
    import sys, time
    from kvstore.transfer import MemoryRegion
    region = MemoryRegion.allocate(1 << 20, region_id="owned", shm_dir=sys.argv[1])
    region.buffer[:4] = [1, 2, 3, 4]
    print(region.desc.shm_path, flush=True)
    time.sleep(120)
""")


@contextlib.contextmanager
def owner_of_a_region(shm_dir: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """A real process that allocated a region in ``shm_dir`` and holds it; (process, path)."""
    process = subprocess.Popen([sys.executable, "-c", OWNER, shm_dir], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        path = process.stdout.readline().strip()
        assert path.startswith(shm_dir), f"the owner did not allocate (exit {process.poll()})"
        yield process, path
    finally:
        process.kill()
        process.wait()
        process.stdout.close()


@pytest.fixture
def owner(tmp_path):
    with owner_of_a_region(str(tmp_path)) as owned:
        yield owned


@pytest.mark.parametrize("shm_dir", ["/dev/shm", "tmp"])
def test_a_sigkilled_owners_file_goes_at_the_next_allocation(tmp_path, shm_dir):
    shm_dir = str(tmp_path) if shm_dir == "tmp" else shm_dir
    with owner_of_a_region(shm_dir) as (process, path):
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert os.path.exists(path)  # nothing could unlink it
        region = MemoryRegion.allocate(4096, shm_dir=shm_dir)
        try:
            assert not os.path.exists(path) and os.path.exists(region.desc.shm_path)
        finally:
            region.close()
    assert not os.path.exists(region.desc.shm_path)


def test_a_live_owners_file_stays_and_a_reader_takes_no_lock(owner, tmp_path):
    _, path = owner
    with open(path, "rb") as f:  # what a peer's ShmTransport does to read blocks
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        assert remove_stale_regions(str(tmp_path)) == []
        region = MemoryRegion.allocate(4096, shm_dir=str(tmp_path))
        region.close()
        assert os.path.exists(path) and mapping[:4] == bytes([1, 2, 3, 4])
    finally:
        mapping.close()


def test_a_dead_process_with_our_pid_is_no_reason_to_fail(tmp_path):
    """A restarted container may give its process the pid of the one that was killed: the dead
    one's file (same name, nobody holding its lock) is removed, not collided with."""
    stale = tmp_path / f"{SHM_PREFIX}{os.getpid()}-pool"
    stale.write_bytes(b"\0" * 4096)
    region = MemoryRegion.allocate(8192, region_id="pool", shm_dir=str(tmp_path))
    try:
        assert region.desc.shm_path == str(stale) and os.path.getsize(stale) == 8192
    finally:
        region.close()


def test_the_owner_holds_the_lock_until_it_closes(tmp_path):
    region = MemoryRegion.allocate(4096, shm_dir=str(tmp_path))
    path = region.desc.shm_path
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        region.close()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released: a sweep could take it now
    finally:
        os.close(fd)
    assert not os.path.exists(path) and os.listdir(tmp_path) == []


def test_other_files_are_left_alone(tmp_path):
    (tmp_path / "someone-else").write_bytes(b"x")
    remove_stale_regions(str(tmp_path))
    assert os.listdir(tmp_path) == ["someone-else"]
