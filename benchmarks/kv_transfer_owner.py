"""The owner side of benchmarks/kv_transfer.py (the "prefill" instance), in a process of its own
as it would be in a deployment, so its data server does not share the reader's GIL.

It reads a JSON setup line ({"num_bytes", "block_bytes"}) and then the KV blocks' bytes from
stdin into a /dev/shm region, registers and exports them through our TransferEngine, serves
the raw socket column (per byte received, the whole region back), and answers with a line
OWNER_LINE + JSON (the handle, the region's address, the socket's port). Each later line on
stdin names an optional engine to start (``mooncake``), answered the same way; stdin closed:
it exits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.transfer import MemoryRegion, TransferEngine, wire  # noqa: E402
from kvstore.transfer.engine import TRANSPORT_CHOICES  # noqa: E402

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's glog: warnings and up only
OWNER_LINE = "OWNER "
TIMEOUT_S = 10.0  # both transfer engines' and the raw socket's (the transport's default)
TRANSPORTS = ("shm", "tcp", "nixl") if "nixl" in TRANSPORT_CHOICES else ("shm", "tcp")


def owner_main() -> None:
    setup = json.loads(sys.stdin.buffer.readline())
    region = MemoryRegion.allocate(setup["num_bytes"])
    view, got = memoryview(region.buffer), 0
    while got < len(view):
        got += sys.stdin.buffer.readinto(view[got:])
    engine = TransferEngine(timeout_s=TIMEOUT_S, transports=TRANSPORTS)
    engine.register(region)
    block_bytes = setup["block_bytes"]
    ranges = [(i, block_bytes) for i in range(0, setup["num_bytes"], block_bytes)]
    handle = engine.export(region.region_id, ranges, lease_id="bench")
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=serve_raw, args=(listener, memoryview(region.buffer)), daemon=True).start()
    base = region.buffer.ctypes.data
    print(OWNER_LINE + json.dumps({"handle": dataclasses.asdict(handle), "base": base,
                                   "socket_port": listener.getsockname()[1]}), flush=True)
    # Optional engines start only when asked, after the main columns: their progress threads
    # would otherwise compete for the same two cores while those are measured.
    starters = {"mooncake": lambda: mooncake_owner(base, len(view))}
    for line in sys.stdin.buffer:  # until the parent closes our stdin
        print(OWNER_LINE + json.dumps(starters[line.decode().strip()]()), flush=True)
    engine.close()
    region.close()


def serve_raw(listener: socket.socket, data: memoryview) -> None:
    """Per byte received, send the whole buffer back; one client at a time."""
    while True:
        conn, _ = listener.accept()
        wire.tune(conn, TIMEOUT_S, is_receiver=False)  # as the transport's data server does
        with conn:
            while conn.recv(1):
                conn.sendall(data)


def mooncake_owner(base: int, num_bytes: int) -> dict:
    try:
        from mooncake.engine import TransferEngine as MooncakeEngine
        engine = MooncakeEngine()
        if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            return {"error": "initialize failed"}
        if engine.register_memory(base, num_bytes) != 0:
            return {"error": "register_memory failed"}
        owner_main.mooncake = engine  # keep it alive for the process's life
        return {"session": f"127.0.0.1:{engine.get_rpc_port()}"}
    except Exception as exc:  # optional column: any failure is reported, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    owner_main()
