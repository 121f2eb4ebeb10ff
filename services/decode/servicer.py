"""The Decode gRPC service: a thin shell over :class:`DecodeWorker` (wire <-> worker)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc.aio

from services.common.instance_rpcs import EngineRpcs
from services.common.server import CHANNEL_OPTIONS
from services.common.wire import TokenChunk, decode_request_from_proto, token_chunk_to_proto
from services.decode.worker import DecodeWorker
from services.pb import decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

T = TypeVar("T")


class DecodeServicer(EngineRpcs, decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker, heartbeat_s: float = 1.0) -> None:
        self.worker = worker
        self.heartbeat_s = heartbeat_s

    async def Generate(self, request, context):
        chunks = self.worker.generate(decode_request_from_proto(request))
        try:
            # Closed first: it may be reading ``chunks`` in a task of its own.
            async with contextlib.aclosing(with_heartbeats(chunks, self.heartbeat_s)) as beating:
                async for chunk in beating:
                    if chunk is None:
                        yield HEARTBEAT
                        continue
                    yield token_chunk_to_proto(chunk)
        finally:
            await chunks.aclose()


HEARTBEAT = token_chunk_to_proto(TokenChunk(()))
"""No token, no finish: "alive, nothing to send yet" (a transfer, a recompute, a long step)."""


async def with_heartbeats(items: AsyncIterator[T], every_s: float) -> AsyncIterator[T | None]:
    """``items`` as they come, and None whenever ``every_s`` passes without one.

    The pending read is never cancelled by a heartbeat (cancelling a request stream's read
    aborts the request); only closing this iterator cancels it.
    """
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait((pending,), timeout=every_s)
            if not done:
                yield None
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.wait((pending,))


class LeaseReleaser:
    """Releases leases at prefill instances, one cached channel per address."""

    def __init__(self) -> None:
        self._stubs: dict[str, prefill_pb2_grpc.PrefillStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    async def __call__(self, prefill_address: str, lease_id: str) -> None:
        stub = self._stubs.get(prefill_address)
        if stub is None:
            channel = grpc.aio.insecure_channel(prefill_address, options=CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[prefill_address] = prefill_pb2_grpc.PrefillStub(channel)
        await stub.Release(prefill_pb2.ReleaseRequest(lease_id=lease_id), timeout=5.0)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


def add_to_server(server, worker: DecodeWorker, heartbeat_s: float = 1.0) -> None:
    decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker, heartbeat_s), server)
