"""Every failure as the client's protocol's error body: the bodies of the two error formats the
API speaks (OpenAI's, Anthropic's), which one a path speaks, the status and body of any
exception, and pydantic's validation errors as one readable message.

Imports no protocol module (a layout test holds it to that): the gate (``access/``) answers in
the path's format from here without knowing any protocol, and each protocol module names its
error body from here (``openai_api.error_body``, ``anthropic_api.error_body``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from services.common.errors import EPDError

logger = logging.getLogger("services.router.api")

ErrorBody = Callable[..., dict]
"""``(status, message, param=None, code=None) -> body``: one protocol's error format."""
MAX_NAMED_ERRORS = 10
"""Bad fields named in one validation error message; the rest are counted."""
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable_error",
                 504: "timeout_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def openai_error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (chat, completions, Responses)."""
    error_type = _OPENAI_TYPES.get(status, "internal_server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def anthropic_error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """Anthropic's error body; it has no place for OpenAI's ``param`` / ``code``."""
    error_type = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_details(exc: EPDError) -> tuple[str | None, str | None]:
    """The ``param`` and ``code`` of an EPDError's body."""
    param = getattr(exc, "param", None)
    if param is None and (match := re.match(r"(\w+)=", str(exc))):  # SamplingParams names the field so
        param = match.group(1)
    return param, getattr(exc, "code", None)


def error_of(exc: BaseException, error_body: ErrorBody = openai_error_body) -> tuple[int, dict]:
    """HTTP status and the protocol's error body for any exception; unexpected ones are logged."""
    if isinstance(exc, EPDError):
        return exc.http_status, error_body(exc.http_status, str(exc), *error_details(exc))
    logger.error("request failed", exc_info=exc)
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return 503, error_body(503, f"the backend is unavailable: {exc}")
    return 500, error_body(500, f"internal error: {type(exc).__name__}")


def error_body_for(path: str) -> ErrorBody:
    """The error body of the protocol a path belongs to: Anthropic's under /v1/messages."""
    is_anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
    return anthropic_error_body if is_anthropic else openai_error_body


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """One message naming each bad field; pydantic's union-branch tags are folded into
    "expected A or B" so the client sees its own field names only."""
    groups: dict[str, list[tuple[list, int, dict]]] = {}
    num_unnamed = 0
    for i, error in enumerate(errors):
        if len(groups) > MAX_NAMED_ERRORS:  # a body of 50,000 bad items gets a short answer, fast
            num_unnamed = len(errors) - i
            break
        refusal = (error.get("ctx") or {}).get("error")
        if isinstance(refusal, EPDError):  # a body check (body_checks.py) raised it inside pydantic
            return str(refusal), getattr(refusal, "param", None)
        loc = list(error["loc"])[1:] if error["loc"][:1] == ("body",) else list(error["loc"])
        if error["type"] == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "")
            return f"the request body is not valid JSON: {reason}", None
        tag_at = next((i for i, p in enumerate(loc) if isinstance(p, str) and _is_union_tag(p)), len(loc))
        groups.setdefault(_path(loc[:tag_at]), []).append((loc, tag_at, error))
    messages = []
    for field, members in groups.items():
        deepest = max(len(loc) for loc, _, _ in members)
        kept = [(loc, tag_at, error) for loc, tag_at, error in members if len(loc) == deepest]
        if len(kept) > 1 and all(tag_at < len(loc) for loc, tag_at, _ in kept):
            expected = " or ".join(dict.fromkeys(loc[tag_at] for loc, tag_at, _ in kept))
            messages.append(f"{field}: expected {expected}")
            continue
        loc, _, error = kept[0]
        path = _path([p for p in loc if not (isinstance(p, str) and _is_union_tag(p))])
        if not path:
            messages.append("the request body must be a JSON object (send Content-Type: application/json)")
        else:
            messages.append(f"{path}: {error['msg']}")
    first = next(iter(groups), None)
    if num_unnamed:
        messages.append(f"and {num_unnamed} more errors")
    return "; ".join(messages), first or None


def _is_union_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "dict", "list")


def _path(loc: list) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
