"""What a prefill instance left for decode (its KV handle, under a lease), and what a failed
decode stream means for its request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from services.common.errors import EPDError, UnavailableError
from services.common.grpc_errors import error_from_rpc, is_raised_by_server
from services.pb import prefill_pb2
from services.router.cluster.instances import Instance

logger = logging.getLogger(__name__)


class HandOver:
    """The KV handle a prefill instance left for decode. Until a decode instance took it (its
    first chunk) or it is released, the prefill instance counts the request as in flight, so
    it does not leave the pool (membership) while decode may still read from it."""

    def __init__(self, instance: Instance, kv) -> None:
        self.instance, self.kv = instance, kv
        if kv is not None:
            instance.num_in_flight += 1

    def taken(self) -> None:
        if self.kv is not None:
            self.kv = None
            self.instance.num_in_flight -= 1

    async def release(self) -> None:
        if self.kv is not None:
            lease_id = self.kv.lease_id
            self.taken()
            await release_lease(self.instance, lease_id)


@contextlib.asynccontextmanager
async def released_if_abandoned(instance: Instance, request_id: str) -> AsyncIterator[None]:
    """Around a Prefill call: when the router gives up on it once sent (cancelled: the client
    left; a transport failure: the reply may be lost), the KV the instance may have lent, its
    reply already sent, is released by the request's id, which names the lease there. An error
    the instance raised itself lent nothing. Awaited before the error goes on, so a retry (the
    same request id, maybe at the same instance) cannot race it."""
    try:
        yield
    except asyncio.CancelledError:
        await release_lease(instance, request_id)
        raise
    except grpc.aio.AioRpcError as exc:
        if not is_raised_by_server(exc):
            await release_lease(instance, request_id)
        raise


async def release_lease(instance: Instance, lease_id: str) -> None:
    """Release a lease at a prefill instance (idempotent there: unknown or gone is a no-op)."""
    try:
        await instance.stub.Release(prefill_pb2.ReleaseRequest(lease_id=lease_id), timeout=5.0)
    except grpc.aio.AioRpcError as exc:  # the lease expires on its own
        logger.warning("could not release lease %s at %s: %s", lease_id, instance.address, exc.details())


def stream_error(exc: grpc.aio.AioRpcError) -> EPDError:
    """What a failed decode stream means for its request. A status the instance chose (an
    EPDError it raised: its class rides in the trailing metadata) is the request's own; a
    transport failure (UNAVAILABLE, or the UNKNOWN / INTERNAL / CANCELLED of a stream cut by a
    dying process, "Stream removed") is the instance's, and the request moves on."""
    error = error_from_rpc(exc)
    is_cut = (exc.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED)
              and not is_raised_by_server(exc))
    if is_cut and not error.retryable:
        return UnavailableError(f"the stream broke: {exc.code().name} {exc.details() or ''}".strip())
    return error
