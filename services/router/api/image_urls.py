"""Remote image URLs: refused by default; with ``--allow-image-urls`` fetched by the router.

By default the router fetches nothing: an image given by http(s) URL is a 400 saying so (the
protocol modules' ``check_image_uri``). With ``--allow-image-urls https://images.example.com/``
(repeatable, each a ``scheme://host[:port]/path`` prefix), a URL under one of the prefixes is
fetched before the request is built, and then travels to the encoder as a data URI like any
upload::

    body (chat image_url / Responses input_image / Anthropic {"type": "url"} source)
      | ImageFetcher.inline    every remote URL: on the list? else 400 naming the list
      |                        GET, no redirects (one could leave the list), trust_env off,
      |                        HTTP 200, Content-Type image/*, at most image_url_max_bytes,
      |                        all within image_url_timeout_s; else 400 naming what failed
      v
    the same body with data:image/...;base64,... in place of each URL

Decoding and the pixel limits are the encoder's, as for uploads.
"""

from __future__ import annotations

import asyncio
import base64
import re
from dataclasses import dataclass

import httpx

from services.common.errors import InvalidRequestError

PREFIX = re.compile(r"https?://[^/\s?#]+/\S*", re.IGNORECASE)
"""An allow-list entry: scheme, host and at least the slash after it, so that
``https://example.com/`` cannot be matched by ``https://example.com.evil.net/``."""


def is_remote(url: object) -> bool:
    return isinstance(url, str) and url[:8].lower().startswith(("http://", "https://"))


@dataclass(frozen=True)
class ImageUrlPolicy:
    allow: tuple[str, ...] = ()
    """URL prefixes the router may fetch images from; none: remote URLs are refused."""
    max_bytes: int = 20 * 1024 * 1024
    """Largest image fetched."""
    timeout_s: float = 10.0
    """The whole fetch (connect, headers, body) of one image."""

    def is_allowed(self, url: str) -> bool:
        return any(url.startswith(prefix) for prefix in self.allow)


class ImageFetcher:
    """Replaces the allowed remote image URLs of a request body by data URIs (in place)."""

    def __init__(self, policy: ImageUrlPolicy = ImageUrlPolicy(), transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.policy = policy
        self.transport = transport
        """For tests: an httpx mock transport instead of the network."""

    async def inline(self, body) -> None:
        """Fetch every remote image URL of ``body`` (any protocol's request model) into a data URI.
        Without an allow-list nothing is fetched: the prompt builder then refuses the URL."""
        if not self.policy.allow:
            return
        slots = list(_remote_slots(body))
        if not slots:
            return
        uris = await asyncio.gather(*(self.fetch(url) for url, _ in slots))
        for (_, put), uri in zip(slots, uris):
            put(uri)

    async def fetch(self, url: str) -> str:
        """``url``'s image as a data URI; InvalidRequestError naming what went wrong."""
        what = f"image URL {url[:100]!r}"
        if not self.policy.is_allowed(url):
            raise InvalidRequestError(f"{what} is under none of the prefixes the router fetches from "
                                      f"(--allow-image-urls): {', '.join(self.policy.allow)}")
        try:
            async with asyncio.timeout(self.policy.timeout_s):
                media_type, data = await self._get(url, what)
        except TimeoutError:
            raise InvalidRequestError(f"{what} was not fetched within the {self.policy.timeout_s} s limit "
                                      f"(--image-url-timeout-s)") from None
        except httpx.HTTPError as exc:
            raise InvalidRequestError(f"{what} could not be fetched: {type(exc).__name__} {exc}") from None
        return f"data:{media_type};base64,{base64.b64encode(data).decode()}"

    async def _get(self, url: str, what: str) -> tuple[str, bytes]:
        limit = self.policy.max_bytes
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False, transport=self.transport) as client:
            async with client.stream("GET", url) as reply:
                if reply.status_code != 200:
                    raise InvalidRequestError(f"{what}: the server answered HTTP {reply.status_code}")
                media_type = reply.headers.get("content-type", "").split(";")[0].strip().lower()
                if not media_type.startswith("image/"):
                    raise InvalidRequestError(f"{what} is {media_type or 'of no declared type'}, not an image")
                declared = reply.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise InvalidRequestError(f"{what} is {declared} bytes, over the {limit}-byte limit "
                                              f"(--image-url-max-bytes)")
                chunks, size = [], 0
                async for chunk in reply.aiter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise InvalidRequestError(f"{what} is over the {limit}-byte limit (--image-url-max-bytes)")
                    chunks.append(chunk)
        return media_type, b"".join(chunks)


def _remote_slots(body):
    """(url, setter) of every remote image URL in a chat, Responses or Anthropic body."""
    for message in getattr(body, "messages", None) or ():
        for part in message.content if isinstance(message.content, list) else ():
            image_url = getattr(part, "image_url", None)  # chat completions
            if image_url is not None and is_remote(getattr(image_url, "url", None)):
                yield image_url.url, lambda uri, image_url=image_url: setattr(image_url, "url", uri)
            source = getattr(part, "source", None)  # Anthropic {"type": "url", "url": ...}
            if source is not None and source.type == "url" and is_remote(source.url):
                yield source.url, lambda uri, source=source: _to_base64_source(source, uri)
    items = getattr(body, "input", None)
    for item in items if isinstance(items, list) else ():  # Responses input_image parts
        for part in getattr(item, "content", None) if isinstance(getattr(item, "content", None), list) else ():
            if getattr(part, "type", None) == "input_image" and is_remote(part.image_url):
                yield part.image_url, lambda uri, part=part: setattr(part, "image_url", uri)


def _to_base64_source(source, uri: str) -> None:
    media_type, _, data = uri.removeprefix("data:").partition(";base64,")
    source.type, source.media_type, source.data, source.url = "base64", media_type, data, None
