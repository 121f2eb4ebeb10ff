"""Transport registry (STYLE rule 5): names map to "module:Class" strings, imported on first
use, so a process loads only the transports it enables (a GPU transport may need torch)."""

from __future__ import annotations

import importlib

from kvstore.transfer.base import Transport

TRANSPORTS: dict[str, str] = {
    "shm": "kvstore.transfer.shm:ShmTransport",
    "tcp": "kvstore.transfer.tcp:TcpTransport",
    "nixl": "kvstore.transfer.nixl:NixlTransport",
    "fake": "kvstore.transfer.fake:FakeTransport",
}


def load_transport(name: str) -> type[Transport]:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(sorted(TRANSPORTS))}")
    module_name, _, class_name = TRANSPORTS[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)
