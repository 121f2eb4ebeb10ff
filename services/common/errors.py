"""One exception tree for per-request failures (STYLE rule 11).

Bugs are asserts / RuntimeError, "no room" is a ``None`` return value, a dead engine exits
non-zero. Everything a client can cause derives from :class:`EPDError` and carries the HTTP
status it maps to, so every front door reports it the same way.
"""

from __future__ import annotations


class EPDError(Exception):
    """A failure that belongs to one request, not to the process."""

    http_status: int = 500


class InvalidRequestError(EPDError, ValueError):
    """The request itself is malformed: bad sampling values, empty prompt, ..."""

    http_status = 400


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one output token) does not fit the model's context."""

    http_status = 400


class ModelNotFoundError(EPDError, FileNotFoundError):
    """The model name or path does not resolve to weights we can load."""

    http_status = 404
