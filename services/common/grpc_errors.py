"""EPDError ↔ gRPC status, both directions, from the one table in ``errors.py``.

Server side: :func:`abort_with` ends an RPC with the status of the error's class
(``EPDError.grpc_status``) and names the class in trailing metadata; servers started by
``server.serve`` do this for every servicer method, so servicers just raise. Client side:
:func:`error_from_rpc` turns a failed call back into the same class with the same message, so the
router can answer with its ``http_status``.
"""

from __future__ import annotations

from typing import NoReturn

import grpc
import grpc.aio

from services.common.errors import EPDError

ERROR_CLASS_KEY = "epd-error-class"
"""Trailing-metadata key naming the EPDError subclass, so a subclass (PromptTooLongError) survives
a trip through a status code it shares with its parent (INVALID_ARGUMENT)."""


def status_of(exc: EPDError) -> grpc.StatusCode:
    return grpc.StatusCode[exc.grpc_status]


async def abort_with(context: grpc.aio.ServicerContext, exc: EPDError) -> NoReturn:
    """End the RPC with ``exc``'s status and message (raises grpc.aio.AbortError, as abort does)."""
    await context.abort(status_of(exc), str(exc),
                        trailing_metadata=((ERROR_CLASS_KEY, type(exc).__name__),))
    raise AssertionError("context.abort returned")  # it always raises


def error_from_rpc(exc: grpc.aio.AioRpcError) -> EPDError:
    """The EPDError a failed call stands for; raise it ``from exc``.

    A status with no EPDError class of its own (CANCELLED, UNKNOWN, ...) becomes a plain EPDError
    (HTTP 500) whose message starts with the status name. Transport failures arrive as UNAVAILABLE
    or DEADLINE_EXCEEDED and map like any other status.
    """
    code, details = exc.code(), exc.details() or ""
    by_name, by_code = _classes()
    named = by_name.get(_metadata_value(exc.trailing_metadata(), ERROR_CLASS_KEY) or "")
    for cls in (named, by_code.get(code.name)):
        if cls is not None and cls.grpc_status == code.name:
            try:
                return cls(details)
            except TypeError:  # a subclass whose constructor wants more than a message
                continue
    return EPDError(f"{code.name}: {details}" if details else code.name)


def is_raised_by_server(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the server's own code ended the call with an EPDError (its class rides in the
    trailing metadata), rather than the transport or the gRPC runtime (a dead peer, a reset)."""
    return _metadata_value(exc.trailing_metadata(), ERROR_CLASS_KEY) is not None


def _classes() -> tuple[dict[str, type[EPDError]], dict[str, type[EPDError]]]:
    """Every EPDError subclass by name, and the most general class for each status name.

    Walked on each call (cheap, and it sees subclasses defined after import); breadth-first, so
    InvalidRequestError claims INVALID_ARGUMENT before its subclass PromptTooLongError.
    """
    by_name: dict[str, type[EPDError]] = {}
    by_code: dict[str, type[EPDError]] = {}
    queue: list[type[EPDError]] = [EPDError]
    while queue:
        cls = queue.pop(0)
        by_name.setdefault(cls.__name__, cls)
        by_code.setdefault(cls.grpc_status, cls)
        queue += cls.__subclasses__()
    return by_name, by_code


def _metadata_value(metadata: object, key: str) -> str | None:
    for item in metadata or ():  # a tuple of pairs, or grpc.aio.Metadata (iterates as pairs)
        if item[0] == key:
            value = item[1]
            return value.decode() if isinstance(value, bytes) else value
    return None
