"""--allow-image-urls (issue 20): allowed remote images fetched into data URIs, bounded in bytes
and time; everything else a 400 naming what is wrong. The network is an httpx mock."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest

from services.common.config import ConfigError
from services.common.errors import InvalidRequestError
from services.router.api.anthropic_api import MessagesRequest
from services.router.api.image_urls import ImageFetcher, ImageUrlPolicy
from services.router.api.openai_models import ChatCompletionRequest
from services.router.api.responses_models import ResponsesRequest
from services.router.config import RouterConfig

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 40
ALLOWED = "https://images.example.com/pub/"


async def _serve(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/pub/slow.png":
        await asyncio.sleep(30)
    if request.url.path == "/pub/moved.png":
        return httpx.Response(302, headers={"location": "https://elsewhere.example.net/x.png"})
    if request.url.path == "/pub/page.html":
        return httpx.Response(200, headers={"content-type": "text/html"}, content=b"<html>")
    if request.url.path == "/pub/huge.png":
        return httpx.Response(200, headers={"content-type": "image/png"}, content=b"\0" * 5000)
    return httpx.Response(200, headers={"content-type": "image/png"}, content=PNG)


def fetcher(**policy) -> ImageFetcher:
    return ImageFetcher(ImageUrlPolicy(**{"allow": (ALLOWED,), "max_bytes": 1000, "timeout_s": 0.2, **policy}),
                        transport=httpx.MockTransport(_serve))


def test_an_allowed_url_becomes_a_data_uri_in_every_protocol():
    uri = "data:image/png;base64," + base64.b64encode(PNG).decode()
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": ALLOWED + "cat.png"}}]}])
    responses = ResponsesRequest(model="m", input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": ALLOWED + "cat.png"}]}])
    anthropic = MessagesRequest(model="m", max_tokens=1, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": ALLOWED + "cat.png"}}]}])
    for body in (chat, responses, anthropic):
        asyncio.run(fetcher().inline(body))
    assert chat.messages[0].content[0].image_url.url == uri
    assert responses.input[0].content[0].image_url == uri
    source = anthropic.messages[0].content[0].source
    assert (source.type, source.media_type, "data:image/png;base64," + source.data) == ("base64", "image/png", uri)


@pytest.mark.parametrize("url, words", [
    ("https://images.example.com.evil.net/pub/cat.png", "under none of the prefixes"),
    ("https://images.example.com/private/cat.png", "under none of the prefixes"),
    (ALLOWED + "huge.png", "over the 1000-byte limit"),
    (ALLOWED + "page.html", "text/html, not an image"),
    (ALLOWED + "moved.png", "HTTP 302"),  # a redirect could leave the list: not followed
    (ALLOWED + "slow.png", "within the 0.2 s limit"),
])
def test_what_cannot_be_fetched_is_a_clear_400(url, words):
    with pytest.raises(InvalidRequestError, match=words):
        asyncio.run(fetcher().fetch(url))


def test_without_an_allow_list_nothing_is_fetched():
    """The prompt builder then refuses the URL (test_openai_api: "only data:image...")."""
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": ALLOWED + "cat.png"}}]}])
    asyncio.run(fetcher(allow=()).inline(chat))
    assert chat.messages[0].content[0].image_url.url == ALLOWED + "cat.png"


def test_allow_list_entries_must_be_url_prefixes():
    assert RouterConfig(allow_image_urls=(ALLOWED,)).allow_image_urls == (ALLOWED,)
    with pytest.raises(ConfigError, match="allow_image_urls"):
        RouterConfig(allow_image_urls=("https://images.example.com",))  # no slash: .com.evil.net would match
