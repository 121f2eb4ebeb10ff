"""Registered memory: the buffer an instance's KV block pool lives in, readable by peers.

A region is allocated once, up front, and pre-touched so no page fault lands inside a transfer
or a forward pass. With ``shm=True`` it is a file under /dev/shm mapped shared, so a peer on the
same host can map the same pages and copy blocks out with no help from the owner; otherwise
anonymous memory, readable only through the owner's data server.
"""

from __future__ import annotations

import mmap
import os
import uuid
import weakref

import numpy as np

from kvstore.transfer.descriptors import RegionDesc, RegionId

SHM_PREFIX = "epd-kv-"
"""Every region file starts with this, so a receiver refuses to map arbitrary paths."""

_PAGE = mmap.PAGESIZE


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class MemoryRegion:
    """One pre-allocated, pre-touched buffer; ``close()`` (or garbage collection) unlinks it."""

    def __init__(self, region_id: RegionId, mapping: mmap.mmap, shm_path: str):
        self.region_id = region_id
        self._mapping: mmap.mmap | None = mapping
        self._buffer: np.ndarray | None = np.frombuffer(mapping, dtype=np.uint8)
        self.desc = RegionDesc(region_id, shm_path, len(mapping))
        # A finalizer, not __del__: it also runs at interpreter exit, so /dev/shm is left clean.
        self._unlinker = weakref.finalize(self, _unlink, shm_path) if shm_path else None

    @classmethod
    def allocate(cls, length: int, region_id: str | None = None, shm: bool = True,
                 shm_dir: str = "/dev/shm") -> MemoryRegion:
        if length <= 0:
            raise ValueError(f"region length must be positive, got {length}")
        region_id = RegionId(region_id or uuid.uuid4().hex)
        if not shm:
            mapping = mmap.mmap(-1, length)
            path = ""
        else:
            path = os.path.join(shm_dir, f"{SHM_PREFIX}{os.getpid()}-{region_id}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                # fallocate, not just ftruncate: a full /dev/shm then fails here with ENOSPC
                # instead of killing the process with SIGBUS on first touch.
                os.posix_fallocate(fd, 0, length)
                mapping = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                _unlink(path)
                raise
            finally:
                os.close(fd)
        try:  # fewer TLB misses in copies and attention, where the kernel allows it
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass
        region = cls(region_id, mapping, path)
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
        """Unlink the shm file and unmap. Idempotent.

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
