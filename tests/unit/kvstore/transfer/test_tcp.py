"""The TCP path against misbehaving peers: a raw socket plays the owner's data server."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvstore.transfer import BlockDesc, Endpoint, KVHandle, MemoryRegion, RegionDesc, TransferState
from kvstore.transfer import checksum, wire

BLOCK_BYTES = 256 << 10
NUM_BLOCKS = 8


def handle_for(port: int, data: np.ndarray) -> KVHandle:
    blocks = tuple(BlockDesc("r", i * BLOCK_BYTES, BLOCK_BYTES, checksum(data[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES]))
                   for i in range(NUM_BLOCKS))
    return KVHandle("l", Endpoint("elsewhere", f"127.0.0.1:{port}"), (RegionDesc("r", "", len(data)),), blocks)


class RawPeer:
    """Accepts one connection, reads one request, then does whatever ``behave`` says."""

    def __init__(self, behave):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.release = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(behave,), daemon=True)
        self._thread.start()

    def _run(self, behave) -> None:
        conn, _ = self._listener.accept()
        with conn:
            assert wire.read_request(conn) is not None
            behave(conn, self)

    def close(self) -> None:
        self.release.set()
        self._thread.join(5)
        self._listener.close()


@pytest.fixture
def data() -> np.ndarray:
    return np.random.default_rng(3).integers(0, 256, NUM_BLOCKS * BLOCK_BYTES, dtype=np.uint8)


@pytest.fixture
def dest():
    region = MemoryRegion.allocate(NUM_BLOCKS * BLOCK_BYTES, shm=False)
    yield [region.buffer[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES] for i in range(NUM_BLOCKS)]
    region.close()


def read_from(peer_behaviour, data, dest, make_engine):
    peer = RawPeer(peer_behaviour)
    try:
        reader = make_engine(transports=("tcp",), timeout_s=0.5)
        started = time.monotonic()
        op = reader.read(handle_for(peer.port, data), dest)
        state = op.wait(10)
        return state, op.error, time.monotonic() - started
    finally:
        peer.close()


def test_peer_dying_mid_reply_fails(data, dest, make_engine):
    def half_then_close(conn, peer):
        conn.sendall(wire.encode_response(wire.STATUS_OK, len(data)))
        conn.sendall(memoryview(data)[:len(data) // 2])

    state, error, _ = read_from(half_then_close, data, dest, make_engine)
    assert state is TransferState.FAILED
    assert f"closed the connection after {len(data) // 2} of {len(data)} bytes" in error


def test_stalled_peer_times_out(data, dest, make_engine):
    def header_then_stall(conn, peer):
        conn.sendall(wire.encode_response(wire.STATUS_OK, len(data)) + memoryview(data)[:100].tobytes())
        peer.release.wait(10)

    state, error, seconds = read_from(header_then_stall, data, dest, make_engine)
    assert state is TransferState.FAILED and "stalled after 100 of" in error
    assert seconds < 5


def test_silent_peer_times_out(data, dest, make_engine):
    state, error, seconds = read_from(lambda conn, peer: peer.release.wait(10), data, dest, make_engine)
    assert state is TransferState.FAILED and seconds < 5


def test_garbage_reply_fails(data, dest, make_engine):
    state, error, _ = read_from(lambda conn, peer: conn.sendall(b"HTTP/1.1 400 Bad\r\n\r\n"),
                                data, dest, make_engine)
    assert state is TransferState.FAILED and "bad response header" in error


def test_wrong_length_reply_fails(data, dest, make_engine):
    state, error, _ = read_from(lambda conn, peer: conn.sendall(wire.encode_response(wire.STATUS_OK, 5)),
                                data, dest, make_engine)
    assert state is TransferState.FAILED and "replied 5 bytes" in error


def test_nobody_listening_fails(data, dest, make_engine):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    op = make_engine(transports=("tcp",)).read(handle_for(port, data), dest)
    assert op.wait(10) is TransferState.FAILED and "cannot connect" in op.error


def serving_engine(make_engine, data, port=0):
    owner = make_engine(transports=("tcp",), port=port)
    region = MemoryRegion.allocate(len(data), region_id="r", shm=False)
    region.buffer[:] = data
    owner.register(region)
    return owner, region


def test_server_survives_bad_clients(data, dest, make_engine):
    owner, region = serving_engine(make_engine, data)
    port = int(owner.endpoint.tcp_address.rpartition(":")[2])
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(wire.encode_request([wire.ByteRange("r", 0, 8)])[:6])  # half a header, then gone
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n")
        try:  # the server drops a client that speaks another protocol (a reset: bytes unread)
            assert raw.recv(1) == b""
        except ConnectionResetError:
            pass
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(wire.encode_request([wire.ByteRange("r", 0, len(data))]))
        raw.recv(1)  # reply started; hang up in the middle of it
    op = make_engine(transports=("tcp",)).read(handle_for(port, data), dest)
    assert op.wait(10) is TransferState.DONE, op.error
    np.testing.assert_array_equal(np.concatenate(dest), data)
    region.close()


def test_pooled_connection_to_a_restarted_peer_is_retried(data, dest, make_engine):
    owner, region = serving_engine(make_engine, data)
    port = int(owner.endpoint.tcp_address.rpartition(":")[2])
    reader = make_engine(transports=("tcp",))
    handle = handle_for(port, data)
    assert reader.read(handle, dest).wait(10) is TransferState.DONE  # leaves a pooled connection
    owner.close()
    region.close()
    _, region = serving_engine(make_engine, data, port=port)  # same address, new process state
    for block in dest:
        block[:] = 0
    op = reader.read(handle, dest)
    assert op.wait(10) is TransferState.DONE, op.error
    np.testing.assert_array_equal(np.concatenate(dest), data)
    region.close()


def test_request_round_trips_through_the_codec():
    ranges = [wire.ByteRange("region-a", 0, 10), wire.ByteRange("b", 1 << 40, 7)]
    encoded = wire.encode_request(ranges)
    magic, num_ranges, body_len = wire.REQUEST.unpack_from(encoded)
    assert magic == wire.REQUEST_MAGIC and body_len == len(encoded) - wire.REQUEST.size
    assert wire.decode_body(num_ranges, encoded[wire.REQUEST.size:]) == ranges
    with pytest.raises(wire.ProtocolError):
        wire.decode_body(3, encoded[wire.REQUEST.size:])
