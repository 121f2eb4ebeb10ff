"""The TCP data-server protocol: one request lists byte ranges, the reply is those bytes.

    request   "EPDq" | u32 num_ranges | u32 body_len | body
    body      num_ranges x ( u16 id_len | u64 offset | u64 length | id bytes (utf-8) )
    response  "EPDs" | u8 status | u64 payload_len | payload
    payload   status OK: the ranges' bytes back to back, in request order
              status ERROR: a utf-8 message; nothing was sent, the connection stays usable

All integers little-endian. The server validates every range before sending a byte, so a
reply is all or nothing.
"""

from __future__ import annotations

import socket
import struct
from typing import NamedTuple, Sequence

REQUEST = struct.Struct("<4sII")
RANGE = struct.Struct("<HQQ")
RESPONSE = struct.Struct("<4sBQ")
REQUEST_MAGIC = b"EPDq"
RESPONSE_MAGIC = b"EPDs"
STATUS_OK = 0
STATUS_ERROR = 1
MAX_BODY_BYTES = 16 << 20
MAX_ERROR_BYTES = 64 << 10
SOCKET_BUFFER_BYTES = 4 << 20
"""Send buffer of the server, receive buffer of the client (the kernel caps it at rmem_max)."""


class ProtocolError(Exception):
    """The peer sent something that is not this protocol."""


class ByteRange(NamedTuple):
    region_id: str
    offset: int
    length: int


def encode_request(ranges: Sequence[ByteRange]) -> bytes:
    parts = []
    for r in ranges:
        region = r.region_id.encode()
        parts.append(RANGE.pack(len(region), r.offset, r.length) + region)
    body = b"".join(parts)
    return REQUEST.pack(REQUEST_MAGIC, len(ranges), len(body)) + body


def decode_body(num_ranges: int, body: bytes) -> list[ByteRange]:
    ranges, at = [], 0
    for _ in range(num_ranges):
        if at + RANGE.size > len(body):
            raise ProtocolError("request body too short")
        id_len, offset, length = RANGE.unpack_from(body, at)
        at += RANGE.size
        region = body[at:at + id_len]
        if len(region) != id_len:
            raise ProtocolError("request body too short")
        ranges.append(ByteRange(region.decode(errors="replace"), offset, length))
        at += id_len
    if at != len(body):
        raise ProtocolError("request body has trailing bytes")
    return ranges


def recv_exact(sock: socket.socket, num_bytes: int) -> bytes | None:
    """``num_bytes`` from the socket; None on a clean EOF before the first byte."""
    buf = bytearray(num_bytes)
    view, got = memoryview(buf), 0
    while got < num_bytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return None
            raise ConnectionError(f"peer closed the connection after {got} of {num_bytes} bytes")
        got += n
    return bytes(buf)


def read_request(sock: socket.socket) -> list[ByteRange] | None:
    """The next request, or None when the client hung up between requests."""
    header = recv_exact(sock, REQUEST.size)
    if header is None:
        return None
    magic, num_ranges, body_len = REQUEST.unpack(header)
    if magic != REQUEST_MAGIC or body_len > MAX_BODY_BYTES:
        raise ProtocolError(f"bad request header {header!r}")
    body = recv_exact(sock, body_len) if body_len else b""
    if body is None:
        raise ConnectionError("peer closed the connection inside a request")
    return decode_body(num_ranges, body)


def encode_response(status: int, payload_len: int) -> bytes:
    return RESPONSE.pack(RESPONSE_MAGIC, status, payload_len)


def read_response(sock: socket.socket) -> tuple[int, int]:
    """(status, payload_len) of the next reply."""
    header = recv_exact(sock, RESPONSE.size)
    if header is None:
        raise ConnectionError("peer closed the connection before replying")
    magic, status, payload_len = RESPONSE.unpack(header)
    if magic != RESPONSE_MAGIC or status not in (STATUS_OK, STATUS_ERROR):
        raise ProtocolError(f"bad response header {header!r}")
    return status, payload_len


def tune(sock: socket.socket, timeout_s: float, is_receiver: bool) -> None:
    """Blocking socket, kernel timeouts, TCP_NODELAY, large buffers.

    Python's own ``settimeout`` makes the socket non-blocking and polls before every call,
    which breaks MSG_WAITALL into small reads; SO_RCVTIMEO / SO_SNDTIMEO keep one big blocking
    call and still turn a stalled peer into an error (EAGAIN) instead of a hang. The server
    side sets no receive timeout: its connections idle between requests by design.
    """
    sock.settimeout(None)
    seconds = int(timeout_s)
    timeval = struct.pack("ll", seconds, int((timeout_s - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    if is_receiver:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCKET_BUFFER_BYTES:
        option = socket.SO_RCVBUF if is_receiver else socket.SO_SNDBUF
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
