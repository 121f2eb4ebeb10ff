from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from kvstore.transfer import MemoryRegion
from kvstore.transfer.memory import SHM_PREFIX


def test_shm_region_is_a_dev_shm_file_shared_with_its_buffer():
    region = MemoryRegion.allocate(1 << 20)
    try:
        path = region.desc.shm_path
        assert os.path.basename(path).startswith(SHM_PREFIX)
        assert os.path.getsize(path) == 1 << 20
        assert region.desc.length == region.length == 1 << 20
        region.buffer[123] = 45
        with open(path, "rb") as f:
            f.seek(123)
            assert f.read(1) == bytes([45])
    finally:
        region.close()


def test_anonymous_region_has_no_path():
    region = MemoryRegion.allocate(4096, region_id="anon", shm=False)
    assert region.desc.shm_path == "" and region.region_id == "anon"
    region.buffer[:] = 7
    assert int(region.buffer.sum()) == 7 * 4096
    region.close()


def test_close_unlinks_and_is_idempotent():
    region = MemoryRegion.allocate(8192)
    path = region.desc.shm_path
    region.close()
    region.close()
    assert not os.path.exists(path) and region.is_closed
    with pytest.raises(RuntimeError, match="closed"):
        region.buffer


def test_close_with_live_views_still_unlinks():
    torch = pytest.importorskip("torch")
    region = MemoryRegion.allocate(8192)
    path = region.desc.shm_path
    pool = torch.frombuffer(region.buffer, dtype=torch.uint8)  # what the engine does
    region.close()
    assert not os.path.exists(path)
    pool[0] = 1  # the mapping lives on until the last view goes
    del pool


def test_garbage_collection_unlinks():
    region = MemoryRegion.allocate(8192)
    path = region.desc.shm_path
    del region
    gc.collect()
    assert not os.path.exists(path)


def test_nothing_left_in_dev_shm():
    before = set(os.listdir("/dev/shm"))
    regions = [MemoryRegion.allocate(4096 * (i + 1)) for i in range(4)]
    for region in regions:
        region.close()
    assert set(os.listdir("/dev/shm")) == before


def test_pretouched_and_zeroed():
    region = MemoryRegion.allocate(3 * 4096 + 100, shm=True)
    assert region.buffer.dtype == np.uint8 and not region.buffer.any()
    region.close()


def test_rejects_empty_region():
    with pytest.raises(ValueError, match="positive"):
        MemoryRegion.allocate(0)
