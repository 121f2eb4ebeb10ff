"""One exception tree for per-request failures (STYLE rule 11).

Bugs are asserts / RuntimeError, "no room" is a ``None`` return value, a dead engine exits
non-zero. Everything a client can cause derives from :class:`EPDError` and carries the HTTP
status and the gRPC status it maps to, so every front door reports it the same way. The class
attributes below are the one table: ``services/common/grpc_errors.py`` reads ``grpc_status`` on the
server side (raise → status) and inverts it on the client side (status → the same class).

=========================  ===========  ===================  =========
class                      HTTP status  gRPC status          retryable
=========================  ===========  ===================  =========
EPDError (anything else)   500          INTERNAL             no
InvalidRequestError        400          INVALID_ARGUMENT     no
PromptTooLongError         400          INVALID_ARGUMENT     no
ModelNotFoundError         404          NOT_FOUND            no
UnavailableError           503          UNAVAILABLE          yes
DrainingError              503          UNAVAILABLE          yes (elsewhere; not a fault)
DeadlineExceededError      504          DEADLINE_EXCEEDED    no
KVLoadError                500          INTERNAL             no
EmbeddingsMissingError     503          UNAVAILABLE          yes (with the images encoded)
=========================  ===========  ===================  =========
"""

from __future__ import annotations


class EPDError(Exception):
    """A failure that belongs to one request, not to the process."""

    http_status: int = 500
    grpc_status: str = "INTERNAL"
    """A ``grpc.StatusCode`` member name (a string, so this module needs no grpc)."""
    retryable: bool = False
    """Whether sending the same request again (to this or another instance) may succeed."""


class InvalidRequestError(EPDError, ValueError):
    """The request itself is malformed: bad sampling values, empty prompt, ..."""

    http_status = 400
    grpc_status = "INVALID_ARGUMENT"


def invalid(message: str, param: str | None = None, code: str | None = None,
            cls: type[InvalidRequestError] = InvalidRequestError) -> InvalidRequestError:
    """An InvalidRequestError naming the field at fault (``param``) and, optionally, an error
    ``code``: the OpenAI error body carries both."""
    exc = cls(message)
    exc.param, exc.code = param, code
    return exc


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one output token) does not fit the model's context."""

    http_status = 400


class ModelNotFoundError(EPDError, FileNotFoundError):
    """The model name or path does not resolve to weights we can load."""

    http_status = 404
    grpc_status = "NOT_FOUND"


class UnavailableError(EPDError):
    """The instance cannot take the request now: it is draining, overloaded or unreachable."""

    http_status = 503
    grpc_status = "UNAVAILABLE"
    retryable = True


class DrainingError(UnavailableError):
    """The instance was told to stop and takes no new work (what it runs goes on): a planned
    step, not a fault. The router sends the request elsewhere without counting a failure."""


class DeadlineExceededError(EPDError):
    """The request ran out of time (a client deadline, a KV transfer that never arrived, ...)."""

    http_status = 504
    grpc_status = "DEADLINE_EXCEEDED"


class KVLoadError(EPDError):
    """A request's KV could not be loaded and the instance is told to fail rather than recompute
    it (``--kv-load-failure-policy fail``)."""


class EmbeddingsMissingError(UnavailableError):
    """An image's rows could not be had: its encoder's lent rows were unreadable (the encoder
    died, the lease expired), or the router skipped the encoder on a prefix hit that turned out
    evicted. The router runs the request again with its images encoded (never another prefill
    with the same message)."""
