"""A tiny random LLaVA served by the whole cluster (issue 20), as a client sees it over HTTP.

Three encoders run the model's CLIP tower and projector, prefill and decode its language model
(SmolLM2's tokenizer and chat template). An image + text chat answers with exactly the 32 greedy
tokens transformers' ``LlavaForConditionalGeneration`` generates from the same prompt and pixels,
with three encoders and with one (two killed: the request goes to the survivor). Bad images are
400s naming the problem in each protocol's error body; images by URL are fetched by the router
only under its --allow-image-urls prefixes, within its byte limit, and must be images.
"""

from __future__ import annotations

import base64
import http.server
import json
import threading

import httpx
import openai
import pytest
import torch
import transformers

from services.common.tokenizer import Tokenizer
from services.encoder.images import decode_data_uri, to_rgb
from services.router.api.prompts import chat_prompt
from services.router.api.openai_models import ChatMessage
from tests.cluster import running_cluster
from tests.llava_factories import NUM_IMAGE_TOKENS, make_tiny_llava_dir, png_data_uri

MODEL = "tiny-llava"


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, smollm2_dir):
    return make_tiny_llava_dir(tmp_path_factory.mktemp("llava") / MODEL, "clip", seed=5, tokenizer_dir=smollm2_dir)


MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS = 100_000, 1_000_000
"""The encoders' limits here (their flags' env vars): small, so the test images stay small."""


class _Images(http.server.BaseHTTPRequestHandler):
    """A web server with pictures: /ok/ is on the router's allow-list, /elsewhere/ is not."""

    PAGES = {"/ok/cat.png": ("image/png", 11), "/elsewhere/cat.png": ("image/png", 11),
             "/ok/big.png": ("image/png", 200_000), "/ok/page": ("text/html", 100)}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path not in self.PAGES:
            self.send_error(404)
            return
        media_type, what = self.PAGES[self.path]
        body = base64.b64decode(png_data_uri(what).partition(",")[2]) if what < 1000 else b"\0" * what
        self.send_response(200)
        self.send_header("Content-Type", media_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def cluster(llava_dir, image_server):
    with pytest.MonkeyPatch.context() as env:  # the children inherit it
        env.setenv("EPD_ENCODER_MAX_IMAGE_BYTES", str(MAX_IMAGE_BYTES))
        env.setenv("EPD_ENCODER_MAX_IMAGE_PIXELS", str(MAX_IMAGE_PIXELS))
        env.setenv("EPD_ROUTER_ALLOW_IMAGE_URLS", image_server + "/ok/")
        env.setenv("EPD_ROUTER_IMAGE_URL_MAX_BYTES", "100000")
        with running_cluster(str(llava_dir), encoders=3, prefills=1, decodes=1, kv_cache_gib=0.05,
                             max_num_batched_tokens=64, device="cpu") as running:
            yield running


def messages(uri: str, text: str = "What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": uri}}]}]


def router_prompt(llava_dir, uri: str, tower: str = "clip") -> tuple[list[int], int]:
    """The chat's prompt as the router builds it (template, placeholder), the placeholder
    widened to the model's rows; and the image's position."""
    tokenizer = Tokenizer.from_file(llava_dir / "tokenizer.json", json.loads((llava_dir / "tokenizer_config.json").read_text()))
    image_token_id = json.loads((llava_dir / "config.json").read_text())["image_token_index"]
    prompt = chat_prompt([ChatMessage(**m) for m in messages(uri)], tokenizer, image_token_id)
    [position] = prompt.image_positions
    ids = list(prompt.token_ids)
    ids[position:position + 1] = [image_token_id] * NUM_IMAGE_TOKENS[tower]
    return ids, position


def transformers_greedy(llava_dir, uri: str, n: int, tower: str = "clip") -> list[int]:
    """transformers' greedy tokens for the router's prompt and the processor's pixels."""
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    ids, _ = router_prompt(llava_dir, uri, tower)
    processor = transformers.AutoImageProcessor.from_pretrained(llava_dir, backend="pil")
    pixels = processor(images=to_rgb(decode_data_uri(uri)), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def served(client: openai.OpenAI, uri: str, n: int = 32):
    reply = client.chat.completions.create(model=MODEL, messages=messages(uri), max_tokens=n, temperature=0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    return reply.choices[0].model_extra["token_ids"], reply.usage


def test_greedy_equals_transformers_with_three_encoders_and_with_one(cluster, llava_dir):
    uris = [png_data_uri(seed) for seed in (11, 12, 13)]
    expected = [transformers_greedy(llava_dir, uri, 32) for uri in uris]
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    for uri, tokens in zip(uris * 2, expected * 2):  # six requests over three encoders
        got, usage = served(client, uri)
        assert got == tokens
        # The image became the model's rows: the prompt counts them, not one placeholder.
        assert usage.prompt_tokens >= NUM_IMAGE_TOKENS["clip"]
    # The same image again: its blocks are a prefix hit. Another image: none past the text before it.
    _, again = served(client, uris[0])
    assert again.prompt_tokens_details.cached_tokens >= again.prompt_tokens - 16
    ids, position = router_prompt(llava_dir, png_data_uri(14))
    _, other = served(client, png_data_uri(14))
    assert other.prompt_tokens == len(ids) and other.prompt_tokens_details.cached_tokens <= position
    for child in [c for c in cluster.cluster.children if c.name.startswith("encoder")][:2]:
        child.process.kill()
        child.process.wait()
    assert len(cluster.addresses("encoder")) == 1
    for uri, tokens in zip(uris, expected):  # one encoder left; the dead ones are tried and skipped
        assert served(client, uri)[0] == tokens


def test_a_siglip_llava_through_the_cluster_equals_transformers(tmp_path_factory, smollm2_dir):
    """The other tower family (SigLIP, every patch kept, two feature layers; a Qwen2 language
    model), served by one encoder, prefill and decode: 32 greedy tokens as transformers'."""
    siglip_dir = make_tiny_llava_dir(tmp_path_factory.mktemp("siglip") / MODEL, "siglip", seed=6,
                                     tokenizer_dir=smollm2_dir)
    uris = [png_data_uri(seed) for seed in (21, 22)]
    expected = [transformers_greedy(siglip_dir, uri, 32, "siglip") for uri in uris]
    with running_cluster(str(siglip_dir), encoders=1, prefills=1, decodes=1, kv_cache_gib=0.05,
                         device="cpu") as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused")
        assert [served(client, uri)[0] for uri in uris] == expected


def _post(cluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(cluster.url + path, json=body, timeout=60)


def _chat(uri: str) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": messages(uri)}


def _anthropic(uri: str) -> tuple[str, dict]:
    media, _, data = uri.removeprefix("data:").partition(";base64,")
    return "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}]}]}


def _responses(uri: str) -> tuple[str, dict]:
    return "/v1/responses", {"model": MODEL, "max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": uri}]}]}


def _message(body: dict) -> str:
    return body["error"]["message"]


def _png(width: int, height: int) -> bytes:
    import io

    from PIL import Image
    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


def _corrupt_png() -> bytes:
    """A noise PNG whose compressed pixels have 64 bytes flipped (the header is intact)."""
    data = bytearray(base64.b64decode(png_data_uri(0, (32, 32)).partition(",")[2]))
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    return bytes(data)


BAD = {
    "corrupt": ("data:image/png;base64," + base64.b64encode(_corrupt_png()).decode(), "corrupt"),
    "truncated": ("data:image/png;base64," + base64.b64encode(_png(64, 64)[:-30]).decode(), "truncated"),
    "non-image": ("data:image/png;base64," + base64.b64encode(b"just some text, no picture").decode(),
                  "not a PNG, JPEG, WebP or GIF"),
    "too many pixels": ("data:image/png;base64," + base64.b64encode(_png(1001, 1000)).decode(),
                        f"over the limit of {MAX_IMAGE_PIXELS}"),
    "oversized": (png_data_uri(1, (200, 200)), f"over the {MAX_IMAGE_BYTES}-byte limit"),
}


@pytest.mark.parametrize("protocol", [_chat, _anthropic, _responses], ids=["chat", "anthropic", "responses"])
def test_bad_images_are_400s_naming_the_problem(cluster, protocol):
    for name, (uri, words) in BAD.items():
        reply = _post(cluster, *protocol(uri))
        assert reply.status_code == 400, (name, reply.text)
        assert words in _message(reply.json()), (name, reply.text)
    path, body = protocol("https://example.com/cat.png")
    if protocol is _anthropic:
        body["messages"][0]["content"][1]["source"] = {"type": "url", "url": "https://example.com/cat.png"}
    reply = _post(cluster, path, body)
    assert reply.status_code == 400 and "URL" in _message(reply.json()), reply.text


@pytest.mark.parametrize("protocol", [_chat, _anthropic, _responses], ids=["chat", "anthropic", "responses"])
def test_allowed_image_urls_are_fetched_others_refused(cluster, image_server, protocol):
    def post(url: str) -> httpx.Response:
        path, body = protocol(png_data_uri(11))
        if protocol is _anthropic:
            body["messages"][0]["content"][1]["source"] = {"type": "url", "url": url}
        elif protocol is _chat:
            body["messages"][0]["content"][1]["image_url"]["url"] = url
        else:
            body["input"][0]["content"][1]["image_url"] = url
        return _post(cluster, path, {**body, "temperature": 0})

    inline = _post(cluster, *protocol(png_data_uri(11)))
    fetched = post(image_server + "/ok/cat.png")
    assert fetched.status_code == 200 == inline.status_code, fetched.text
    # The fetched picture is the uploaded one: the same image hash, so its KV blocks are a hit.
    usage = fetched.json()["usage"]
    cached = usage.get("cache_read_input_tokens") or (usage.get("prompt_tokens_details") or
                                                      usage.get("input_tokens_details"))["cached_tokens"]
    assert cached >= NUM_IMAGE_TOKENS["clip"]
    for path, words in (("/elsewhere/cat.png", "--allow-image-urls"), ("/ok/big.png", "100000-byte limit"),
                        ("/ok/page", "text/html, not an image"), ("/ok/missing.png", "HTTP 404")):
        reply = post(image_server + path)
        assert reply.status_code == 400 and words in _message(reply.json()), (path, reply.text)


def test_too_many_images_is_a_400_naming_the_limit(cluster):
    content = [{"type": "text", "text": "Compare them."}] + [
        {"type": "image_url", "image_url": {"url": png_data_uri(seed, (16, 16))}} for seed in range(9)]
    reply = _post(cluster, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": content}]})
    assert reply.status_code == 400 and "1 to 8 images per request, not 9" in _message(reply.json()), reply.text
