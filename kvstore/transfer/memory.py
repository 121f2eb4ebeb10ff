"""Registered memory: the buffer an instance's KV block pool lives in, readable by peers.

A region is allocated once, up front, and pre-touched so no page fault lands inside a transfer
or a forward pass. With ``shm=True`` it is a file under /dev/shm mapped shared, so a peer on the
same host can map the same pages and copy blocks out with no help from the owner; otherwise
anonymous memory, readable only through the owner's data server.

A region file lives as long as its owner, however the owner ends::

    allocate   sweep: unlink every epd-kv-* file whose owner's lock is free (a dead owner)
               create a hidden temporary file, take a shared flock on it, link it under its name
    lifetime   the owner holds the lock (the kernel drops it when the process dies, SIGKILL too)
    close      unlink the file, release the lock (a finalizer does it for a forgotten region)

The lock, not the pid in the name, tells a live owner from a dead one: a container restarted
after a SIGKILL may give its new process the dead one's pid. Peers that map a region to read
it never take the lock. The lock is taken before the file has its name, so a concurrent sweep
(engines start together) never sees a live region unlocked.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import mmap
import os
import uuid
import weakref

import numpy as np

from kvstore.transfer.descriptors import RegionDesc, RegionId

SHM_PREFIX = "epd-kv-"
"""Every region file starts with this, so a receiver refuses to map arbitrary paths."""

_PAGE = mmap.PAGESIZE
logger = logging.getLogger(__name__)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _release(path: str, lock_fd: int) -> None:
    """Unlink the region file, then let go of its lock (a sweep may take it from then on)."""
    _unlink(path)
    os.close(lock_fd)


def remove_stale_regions(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink the region files in ``shm_dir`` whose owner is dead (nobody holds their lock); the
    paths removed. Files of other users (not ours to open) and live owners' files are left."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(shm_dir), f"{SHM_PREFIX}*")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone meanwhile, or another user's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Still the file we locked (not a new owner's under the same name), so unlink it.
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
                removed.append(path)
        except OSError:  # locked: its owner lives (or it vanished under us)
            continue
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %d shared-memory region(s) of dead processes: %s", len(removed), removed)
    return removed


def _create_locked(path: str) -> int:
    """``path`` created (exclusively) and opened read-write, with a shared flock held on it.

    The file is made under a hidden name that sweeps ignore, locked, then linked to ``path``:
    a sweep never finds it unlocked. Raises FileExistsError if ``path`` exists."""
    directory, name = os.path.split(path)
    temporary = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:8]}")
    fd = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.link(temporary, path)
    except BaseException:
        os.close(fd)
        raise
    finally:
        _unlink(temporary)
    return fd


class MemoryRegion:
    """One pre-allocated, pre-touched buffer; ``close()`` (or garbage collection) unlinks it."""

    def __init__(self, region_id: RegionId, mapping: mmap.mmap, shm_path: str, lock_fd: int = -1):
        self.region_id = region_id
        self._mapping: mmap.mmap | None = mapping
        self._buffer: np.ndarray | None = np.frombuffer(mapping, dtype=np.uint8)
        self.desc = RegionDesc(region_id, shm_path, len(mapping))
        # A finalizer, not __del__: it also runs at interpreter exit, so /dev/shm is left clean.
        self._unlinker = weakref.finalize(self, _release, shm_path, lock_fd) if shm_path else None

    @classmethod
    def allocate(cls, length: int, region_id: str | None = None, shm: bool = True,
                 shm_dir: str = "/dev/shm") -> MemoryRegion:
        if length <= 0:
            raise ValueError(f"region length must be positive, got {length}")
        region_id = RegionId(region_id or uuid.uuid4().hex)
        if not shm:
            mapping = mmap.mmap(-1, length)
            path, fd = "", -1
        else:
            remove_stale_regions(shm_dir)  # dead processes' pools, ours to free as much as anyone's
            path = os.path.join(shm_dir, f"{SHM_PREFIX}{os.getpid()}-{region_id}")
            fd = _create_locked(path)
            try:
                # fallocate, not just ftruncate: a full /dev/shm then fails here with ENOSPC
                # instead of killing the process with SIGBUS on first touch.
                os.posix_fallocate(fd, 0, length)
                mapping = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                _release(path, fd)
                raise
        try:  # fewer TLB misses in copies and attention, where the kernel allows it
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass
        region = cls(region_id, mapping, path, fd)
        region._buffer[::_PAGE] = 0  # pre-touch: map every page now, not during a transfer
        return region

    @property
    def buffer(self) -> np.ndarray:
        """Writable uint8 view of the whole region (``torch.frombuffer`` works on it)."""
        if self._buffer is None:
            raise RuntimeError(f"region {self.region_id} is closed")
        return self._buffer

    @property
    def length(self) -> int:
        return self.desc.length

    @property
    def is_closed(self) -> bool:
        return self._mapping is None

    def close(self) -> None:
        """Unlink the shm file, release its lock and unmap. Idempotent.

        If views of ``buffer`` are still alive (a torch pool, an in-flight send), the unmap is
        left to the last of them; the file is unlinked now either way, so nothing outlives it.
        """
        if self._unlinker is not None:
            self._unlinker()
        mapping, self._mapping, self._buffer = self._mapping, None, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass

    def __enter__(self) -> MemoryRegion:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemoryRegion({self.region_id!r}, length={self.desc.length}, shm_path={self.desc.shm_path!r})"
