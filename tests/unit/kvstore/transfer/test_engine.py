"""Round trips through two TransferEngines acting as two instances, over every transport."""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np
import pytest

from kvstore.transfer import KVHandle, TransferEngine, TransferState
from kvstore.transfer import fake

from tests.unit.kvstore.transfer.conftest import (
    BLOCK_BYTES, NUM_BLOCKS, block_ranges, destinations, filled_region)


def pair(make_engine, make_region, transports=("shm", "tcp"), owner_host_id=None):
    owner = make_engine(transports=transports, host_id=owner_host_id)
    reader = make_engine(transports=transports)
    source, dest = make_region(seed=1), make_region(seed=2, shm=False)
    owner.register(source)
    reader.register(dest)
    handle = owner.export(source.region_id, block_ranges(), lease_id="lease-1")
    return owner, reader, source, dest, handle


def assert_landed(source, dest):
    ranges = block_ranges()
    for (offset, length), dest_block in zip(ranges, destinations(dest)):
        np.testing.assert_array_equal(dest_block, source.buffer[offset:offset + length])


@pytest.mark.parametrize("transport", ["shm", "tcp", "fake"])
def test_round_trip(make_engine, make_region, transport):
    _, reader, source, dest, handle = pair(make_engine, make_region, transports=(transport,))
    assert handle.num_bytes == NUM_BLOCKS * BLOCK_BYTES and handle.lease_id == "lease-1"
    op = reader.read(handle, destinations(dest))
    assert op.wait(10) is TransferState.DONE, op.error
    assert_landed(source, dest)


def test_same_host_picks_shm_and_tcp_still_works_on_request(make_engine, make_region):
    _, reader, source, dest, handle = pair(make_engine, make_region)
    assert reader.select_transport(handle) == "shm"
    op = reader.read(handle, destinations(dest), transport="tcp")
    assert op.wait(10) is TransferState.DONE, op.error
    assert_landed(source, dest)


def test_other_host_picks_tcp(make_engine, make_region):
    _, reader, source, dest, handle = pair(make_engine, make_region, owner_host_id="elsewhere")
    assert reader.select_transport(handle) == "tcp"
    assert reader.read(handle, destinations(dest)).wait(10) is TransferState.DONE
    assert_landed(source, dest)


def test_region_without_shm_file_is_read_over_tcp(make_engine, make_region):
    owner, reader = make_engine(), make_engine()
    source = make_region(shm=False)
    owner.register(source)
    handle = owner.export(source.region_id, [(0, BLOCK_BYTES)], lease_id="l")
    assert reader.select_transport(handle) == "tcp"


@pytest.mark.parametrize("transport", ["shm", "tcp", "fake"])
def test_an_event_loop_awaits_a_read_woken_by_its_worker(make_engine, make_region, transport):
    import asyncio

    _, reader, source, dest, handle = pair(make_engine, make_region, transports=(transport,))

    async def main():
        op = reader.read(handle, destinations(dest))
        return await asyncio.wait_for(op.finished(), 10), op.error

    assert asyncio.run(main()) == (TransferState.DONE, None)
    assert_landed(source, dest)


@pytest.mark.parametrize("transport", ["shm", "tcp", "fake"])
def test_block_changed_after_export_fails_the_checksum(make_engine, make_region, transport):
    _, reader, source, dest, handle = pair(make_engine, make_region, transports=(transport,))
    offset = handle.blocks[3].offset
    source.buffer[offset + 100] ^= 1  # the owner reused the block under a live lease
    op = reader.read(handle, destinations(dest))
    assert op.wait(10) is TransferState.FAILED
    assert "checksum mismatch on block 3" in op.error


@pytest.mark.parametrize("transport", ["shm", "tcp", "fake"])
def test_out_of_range_block_fails_with_a_message(make_engine, make_region, transport):
    _, reader, _, dest, handle = pair(make_engine, make_region, transports=(transport,))
    bad = dataclasses.replace(handle.blocks[0], offset=NUM_BLOCKS * BLOCK_BYTES)
    handle = dataclasses.replace(handle, blocks=(bad,))
    op = reader.read(handle, [dest.buffer[:BLOCK_BYTES]])
    assert op.wait(10) is TransferState.FAILED and "outside region" in op.error


def test_unknown_region_over_tcp_fails_and_the_connection_stays_usable(make_engine, make_region):
    _, reader, source, dest, handle = pair(make_engine, make_region, transports=("tcp",))
    bogus = dataclasses.replace(handle.blocks[0], region_id="nope")
    op = reader.read(dataclasses.replace(handle, blocks=(bogus,)), [dest.buffer[:BLOCK_BYTES]])
    assert op.wait(10) is TransferState.FAILED and "unknown region 'nope'" in op.error
    assert reader.read(handle, destinations(dest)).wait(10) is TransferState.DONE
    assert_landed(source, dest)


def test_unregistered_region_fails(make_engine, make_region):
    owner, reader, _, dest, handle = pair(make_engine, make_region, transports=("tcp",))
    owner.unregister(handle.blocks[0].region_id)
    op = reader.read(handle, destinations(dest))
    assert op.wait(10) is TransferState.FAILED and "unknown region" in op.error


def test_shm_region_closed_by_owner_fails(make_engine, make_region):
    _, reader, source, dest, handle = pair(make_engine, make_region, transports=("shm",))
    assert reader.read(handle, destinations(dest)).wait(10) is TransferState.DONE  # now cached
    source.close()
    assert reader.select_transport(handle) is None
    op = reader.read(handle, destinations(dest), transport="shm")
    assert op.wait(10) is TransferState.FAILED and "gone" in op.error


def test_shm_refuses_paths_that_are_not_regions(make_engine, make_region):
    _, reader, _, dest, handle = pair(make_engine, make_region, transports=("shm",))
    region = dataclasses.replace(handle.regions[0], shm_path="/etc/passwd")
    op = reader.read(dataclasses.replace(handle, regions=(region,)), destinations(dest), transport="shm")
    assert op.wait(10) is TransferState.FAILED and "refusing to map" in op.error


def test_owner_closed_fails_instead_of_hanging(make_engine, make_region):
    owner, reader, _, dest, handle = pair(make_engine, make_region, transports=("tcp",))
    assert reader.read(handle, destinations(dest)).wait(10) is TransferState.DONE  # pooled conn
    owner.close()
    op = reader.read(handle, destinations(dest))
    assert op.wait(10) is TransferState.FAILED and "peer" in op.error


def test_no_transport_reaches_the_owner(make_engine, make_region):
    _, reader, _, dest, handle = pair(make_engine, make_region, transports=("shm",),
                                      owner_host_id="elsewhere")
    op = reader.read(handle, destinations(dest))
    assert op.poll() is TransferState.FAILED and "no transport" in op.error


def test_destinations_must_match_the_blocks(make_engine, make_region):
    _, reader, _, dest, handle = pair(make_engine, make_region)
    with pytest.raises(ValueError, match="destinations for"):
        reader.read(handle, destinations(dest)[:-1])
    wrong = destinations(dest)
    wrong[0] = dest.buffer[:BLOCK_BYTES - 8]
    with pytest.raises(ValueError, match="bytes, block has"):
        reader.read(handle, wrong)
    with pytest.raises(ValueError, match="writable"):
        reader.read(handle, [bytes(BLOCK_BYTES)] * NUM_BLOCKS)
    with pytest.raises(ValueError, match="not enabled"):
        reader.read(handle, destinations(dest), transport="fake")


def test_export_validates_ranges(make_engine, make_region):
    owner = make_engine()
    source = make_region()
    owner.register(source)
    with pytest.raises(ValueError, match="outside region"):
        owner.export(source.region_id, [(source.length - 8, 16)], lease_id="l")
    with pytest.raises(ValueError, match="not registered"):
        owner.export("missing", [(0, 8)], lease_id="l")


def test_endpoint_names_this_host_and_data_server(make_engine):
    engine = make_engine()
    host, _, port = engine.endpoint.tcp_address.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    assert engine.endpoint.host_id == make_engine(transports=("shm",)).endpoint.host_id
    assert make_engine(transports=("shm",)).endpoint.tcp_address == ""


def test_fake_fault_injection(make_engine, make_region):
    _, reader, source, dest, handle = pair(make_engine, make_region, transports=("fake",))
    fake.inject_failure("peer died")
    op = reader.read(handle, destinations(dest))
    assert op.wait(10) is TransferState.FAILED and op.error == "peer died"
    fake.inject_corruption()
    op = reader.read(handle, destinations(dest))
    assert op.wait(10) is TransferState.FAILED and "checksum mismatch on block 0" in op.error
    assert reader.read(handle, destinations(dest)).wait(10) is TransferState.DONE  # faults used up
    assert_landed(source, dest)


def test_many_reads_in_flight(make_engine, make_region):
    _, reader, source, dest, handle = pair(make_engine, make_region, transports=("tcp",))
    halves = [dataclasses.replace(handle, blocks=handle.blocks[i::2]) for i in range(2)]
    all_dest = destinations(dest)
    ops = [reader.read(h, all_dest[i::2]) for i, h in enumerate(halves) for _ in range(3)]
    assert [op.wait(10) for op in ops] == [TransferState.DONE] * len(ops)
    assert_landed(source, dest)


def test_close_leaves_nothing_in_dev_shm(make_engine):
    before = set(os.listdir("/dev/shm"))
    owner, reader = make_engine(), make_engine()
    source, dest = filled_region(), filled_region(shm=False)
    owner.register(source)
    handle: KVHandle = owner.export(source.region_id, block_ranges(), lease_id="l")
    assert reader.read(handle, destinations(dest)).wait(10) is TransferState.DONE
    owner.close()
    reader.close()
    source.close()
    dest.close()
    assert set(os.listdir("/dev/shm")) == before


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_cancel_ends_the_op(make_engine, make_region, transport):
    _, reader, _, dest, handle = pair(make_engine, make_region, transports=(transport,))
    op = reader.read(handle, destinations(dest))
    op.cancel()
    state = op.wait(10)
    assert state is TransferState.DONE or (state is TransferState.FAILED and op.error == "cancelled")


def test_close_joins_every_thread(make_region):
    engine = TransferEngine()
    source = make_region()
    engine.register(source)
    handle = engine.export(source.region_id, block_ranges(), lease_id="l")
    dest = make_region(shm=False)
    for transport in ("shm", "tcp"):
        assert engine.read(handle, destinations(dest), transport=transport).wait(10) is TransferState.DONE
    engine.close()
    prefixes = ("epd-shm", "epd-tcp", "epd-kv-")
    assert [t.name for t in threading.enumerate() if t.name.startswith(prefixes)] == []
