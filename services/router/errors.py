"""Every failure as the client's protocol's error body: which protocol a path speaks, the status
and body of any exception, and pydantic's validation errors as one readable message."""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.common.errors import EPDError
from services.router import anthropic_api
from services.router import openai_api as api

logger = logging.getLogger("services.router.http")

ErrorBody = Callable[..., dict]
MAX_NAMED_ERRORS = 10
"""Bad fields named in one validation error message; the rest are counted."""


def error_of(exc: BaseException, error_body: ErrorBody = api.error_body) -> tuple[int, dict]:
    """HTTP status and the protocol's error body for any exception; unexpected ones are logged."""
    if isinstance(exc, EPDError):
        return exc.http_status, error_body(exc.http_status, str(exc), *api.error_details(exc))
    logger.error("request failed", exc_info=exc)
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return 503, error_body(503, f"the backend is unavailable: {exc}")
    return 500, error_body(500, f"internal error: {type(exc).__name__}")


def error_body_for(path: str) -> ErrorBody:
    """The error body of the protocol a path belongs to: Anthropic's under /v1/messages."""
    is_anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
    return anthropic_api.error_body if is_anthropic else api.error_body


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
