"""The TCP data server: a background thread that serves byte ranges of registered regions.

Not the engine loop: one accept thread plus one thread per connection, each sending straight
from memoryviews of the region (no intermediate bytes objects). Bad requests get an error
reply; a client that disconnects only ends its own connection thread.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable

from kvstore.transfer import wire
from kvstore.transfer.wire import ByteRange

log = logging.getLogger(__name__)

RegionLookup = Callable[[str], memoryview | None]


class DataServer:
    def __init__(self, host: str, port: int, lookup: RegionLookup, timeout_s: float):
        self._lookup = lookup
        self._timeout_s = timeout_s
        self._listener = socket.create_server((host, port), backlog=128)
        self.port = self._listener.getsockname()[1]
        self._connections: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._is_closing = False
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"epd-kv-data-{self.port}",
                                          daemon=True)
        self._acceptor.start()

    def close(self) -> None:
        """Stop accepting, drop every connection, join every thread. Idempotent."""
        with self._lock:
            if self._is_closing:
                return
            self._is_closing = True
            connections = list(self._connections)
        _shutdown(self._listener)  # wakes accept()
        self._listener.close()
        for conn in connections:
            _shutdown(conn)  # wakes a blocked recv / send in that connection's thread
        self._acceptor.join()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener shut down by close()
            wire.tune(conn, self._timeout_s, is_receiver=False)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                      name=f"epd-kv-conn-{self.port}")
            with self._lock:
                if self._is_closing:
                    conn.close()
                    return
                self._connections.add(conn)
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                ranges = wire.read_request(conn)
                if ranges is None:
                    return
                self._reply(conn, ranges)
        except (OSError, wire.ProtocolError) as exc:
            if not self._is_closing:
                log.debug("data connection ended: %s", exc)
        finally:
            with self._lock:
                self._connections.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def _reply(self, conn: socket.socket, ranges: list[ByteRange]) -> None:
        views, error = self._resolve(ranges)
        if error is not None:
            message = error.encode()[:wire.MAX_ERROR_BYTES]
            conn.sendall(wire.encode_response(wire.STATUS_ERROR, len(message)) + message)
            return
        conn.sendall(wire.encode_response(wire.STATUS_OK, sum(len(v) for v in views)))
        for view in views:
            conn.sendall(view)

    def _resolve(self, ranges: list[ByteRange]) -> tuple[list[memoryview], str | None]:
        """Validate every range first (all or nothing), merging ranges that are adjacent."""
        views: list[memoryview] = []
        last: tuple[memoryview, int, int] | None = None  # (region, start, end) being merged
        for i, r in enumerate(ranges):
            region = self._lookup(r.region_id)
            if region is None:
                return [], f"unknown region {r.region_id!r}"
            if r.length <= 0 or r.offset + r.length > len(region):
                return [], (f"range {i} [{r.offset}, +{r.length}) is outside region "
                            f"{r.region_id!r} ({len(region)} bytes)")
            if last is not None and last[0] is region and last[2] == r.offset:
                last = (region, last[1], r.offset + r.length)
                continue
            if last is not None:
                views.append(last[0][last[1]:last[2]])
            last = (region, r.offset, r.offset + r.length)
        if last is not None:
            views.append(last[0][last[1]:last[2]])
        return views, None


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
