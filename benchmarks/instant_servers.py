"""Instant scripted backends for router benchmarks: they answer at once and compute nothing.

    python benchmarks/instant_servers.py grpc --tokenizer-dir DIR [--tokens-per-chunk 4]
        one process serving epd's Prefill and Decode gRPC services, on two ports (the router is
        given the first as --prefill, the second as --decode; both ports serve both services):
          GetModelInfo  the model's real tokenizer (tokenizer.json + tokenizer_config.json in DIR)
          WatchLoad     an idle load report every interval the router asks for
          Prefill       the first token, no KV handle (decode "recomputes"; nothing to release)
          Generate      the rest of max_tokens in chunks of --tokens-per-chunk, the last one
                        with finish_reason "length"
    python benchmarks/instant_servers.py openai --tokenizer-dir DIR
        an OpenAI-compatible HTTP/1.1 server (keep-alive, raw asyncio protocol, no framework):
        POST /v1/chat/completions answers a prebuilt non-streaming completion of max_tokens
        tokens (max_tokens read with one bytes search, no JSON parse); GET /health, /v1/models
        and sglang-router's start-up probes (/server_info, /model_info, ...) answer small JSON

Each prints ``READY {json}`` (its ports) on stdout once it listens, then serves until killed.
Every reply is built once at start and cached, so a backend costs only its transport.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path

import grpc.aio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.wire import (LoadReport, ModelInfo, PrefillResponse, TokenChunk,  # noqa: E402
                                  load_to_proto, model_info_to_proto, prefill_response_to_proto,
                                  token_chunk_to_proto)
from services.pb import decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc  # noqa: E402

READY_LINE = "READY "
MODEL_NAME = "SmolLM2-135M-Instruct"
ANSWER_TEXT = ("The quick brown fox jumps over the lazy dog, then it runs far away into the green "
               "woods behind the old farm house, where nobody ever finds it again.")
MAX_MODEL_LEN = 8192


def answer_token_ids(tokenizer_dir: Path) -> list[int]:
    """Ordinary text tokens (no EOS among them), cycled when more are asked for."""
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(ANSWER_TEXT).ids


def model_info(tokenizer_dir: Path) -> ModelInfo:
    config = json.loads((tokenizer_dir / "config.json").read_text())
    eos = config.get("eos_token_id", 2)
    return ModelInfo(model_name=MODEL_NAME, max_model_len=MAX_MODEL_LEN, vocab_size=config["vocab_size"],
                     block_size=16, eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]),
                     tokenizer_json=(tokenizer_dir / "tokenizer.json").read_text(),
                     tokenizer_config_json=(tokenizer_dir / "tokenizer_config.json").read_text(),
                     image_token_id=None, hidden_size=config["hidden_size"])


# ---------------------------------------------------------------- epd gRPC (prefill + decode)


class Script:
    """Every reply, built once: the first token, and per number of tokens left its chunks."""

    def __init__(self, tokenizer_dir: Path, tokens_per_chunk: int) -> None:
        self.token_ids = answer_token_ids(tokenizer_dir)
        self.tokens_per_chunk = tokens_per_chunk
        self.info = model_info_to_proto(model_info(tokenizer_dir))
        self.first = prefill_response_to_proto(PrefillResponse(self.token_ids[0], None, None, 0, None))
        self.first_and_last = prefill_response_to_proto(PrefillResponse(self.token_ids[0], "length", None, 0, None))
        self._chunks: dict[tuple[int, int], list] = {}

    def chunks(self, num_done: int, num_left: int) -> list:
        key = (num_done, num_left)
        if key not in self._chunks:
            ids = [self.token_ids[(num_done + i) % len(self.token_ids)] for i in range(num_left)]
            parts = [ids[i:i + self.tokens_per_chunk] for i in range(0, len(ids), self.tokens_per_chunk)]
            self._chunks[key] = [token_chunk_to_proto(TokenChunk(tuple(p), "length" if i == len(parts) - 1 else None))
                                 for i, p in enumerate(parts)]
        return self._chunks[key]


async def watch_load(role: str, request):
    report = load_to_proto(LoadReport(instance_id=f"instant-{role}", role=role, num_free_blocks=100_000,
                                      num_total_blocks=100_000))
    interval_s = request.interval_s or 0.5
    while True:
        yield report
        await asyncio.sleep(interval_s)


class Prefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, script: Script) -> None:
        self.script = script

    async def Prefill(self, request, context):
        return self.script.first_and_last if request.spec.params.max_tokens == 1 else self.script.first

    async def Release(self, request, context):
        return prefill_pb2.ReleaseResponse(released=False)

    async def GetModelInfo(self, request, context):
        return self.script.info

    async def GetLoad(self, request, context):
        return load_to_proto(LoadReport(instance_id="instant-prefill", role="prefill"))

    async def WatchLoad(self, request, context):
        async for report in watch_load("prefill", request):
            yield report


class Decode(decode_pb2_grpc.DecodeServicer):
    def __init__(self, script: Script) -> None:
        self.script = script

    async def Generate(self, request, context):
        num_done = len(request.output_token_ids)
        for chunk in self.script.chunks(num_done, max(1, request.spec.params.max_tokens - num_done)):
            yield chunk

    async def GetModelInfo(self, request, context):
        return self.script.info

    async def GetLoad(self, request, context):
        return load_to_proto(LoadReport(instance_id="instant-decode", role="decode"))

    async def WatchLoad(self, request, context):
        async for report in watch_load("decode", request):
            yield report


async def serve_grpc(args: argparse.Namespace) -> None:
    script = Script(Path(args.tokenizer_dir), args.tokens_per_chunk)
    server = grpc.aio.server()
    prefill_pb2_grpc.add_PrefillServicer_to_server(Prefill(script), server)
    decode_pb2_grpc.add_DecodeServicer_to_server(Decode(script), server)
    ports = [server.add_insecure_port(f"{args.host}:{port}") for port in (args.prefill_port, args.decode_port)]
    await server.start()
    print(READY_LINE + json.dumps({"prefill": f"{args.host}:{ports[0]}", "decode": f"{args.host}:{ports[1]}"}),
          flush=True)
    await server.wait_for_termination()


# ---------------------------------------------------------------- OpenAI-compatible HTTP


_MAX_TOKENS = re.compile(rb'"max(?:_completion)?_tokens"\s*:\s*(\d+)')


def _http(status: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
            .encode() + body)


class Completions:
    """Prebuilt HTTP responses: one chat completion per max_tokens, the probes' small JSON."""

    def __init__(self, tokenizer_dir: Path) -> None:
        from tokenizers import Tokenizer
        self.tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        self.token_ids = answer_token_ids(tokenizer_dir)
        self._chat: dict[int, bytes] = {}
        models = json.dumps({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "epd"}]})
        info = json.dumps({"model_path": MODEL_NAME, "tokenizer_path": None, "is_generation": True})
        self.gets = {b"/v1/models": _http("200 OK", models.encode()), b"/model_info": _http("200 OK", info.encode()),
                     b"/get_model_info": _http("200 OK", info.encode())}
        self.ok = _http("200 OK", b"{}")
        self.not_found = _http("404 Not Found", b'{"error": "not found"}')

    def chat(self, body: bytes) -> bytes:
        found = _MAX_TOKENS.search(body)
        num_tokens = min(int(found.group(1)), 4096) if found else 16
        if num_tokens not in self._chat:
            ids = [self.token_ids[i % len(self.token_ids)] for i in range(num_tokens)]
            reply = {"id": "chatcmpl-instant", "object": "chat.completion", "created": int(time.time()),
                     "model": MODEL_NAME,
                     "choices": [{"index": 0, "finish_reason": "length", "logprobs": None,
                                  "message": {"role": "assistant", "content": self.tokenizer.decode(ids)}}],
                     "usage": {"prompt_tokens": 32, "completion_tokens": num_tokens, "total_tokens": 32 + num_tokens}}
            self._chat[num_tokens] = _http("200 OK", json.dumps(reply).encode())
        return self._chat[num_tokens]

    def answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        if method == b"POST" and path.startswith(b"/v1/chat/completions"):
            return self.chat(body)
        if method == b"GET":
            return self.gets.get(path.split(b"?", 1)[0], self.ok)
        return self.not_found


class HTTPProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, requests answered in order as soon as each is whole. Anything that
    is not HTTP/1.x (sglang-router first tries an HTTP/2 preface) gets the connection closed."""

    def __init__(self, completions: Completions) -> None:
        self.completions = completions
        self.buffer = b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end]
            request_line, _, headers = head.partition(b"\r\n")
            parts = request_line.split(b" ")
            if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
                self.transport.close()
                return
            length = 0
            for line in headers.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            end = head_end + 4 + length
            if len(self.buffer) < end:
                return
            body, self.buffer = self.buffer[head_end + 4:end], self.buffer[end:]
            self.transport.write(self.completions.answer(parts[0], parts[1], body))


async def serve_openai(args: argparse.Namespace) -> None:
    completions = Completions(Path(args.tokenizer_dir))
    server = await asyncio.get_running_loop().create_server(lambda: HTTPProtocol(completions), args.host,
                                                            args.port, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    print(READY_LINE + json.dumps({"url": f"http://{args.host}:{port}"}), flush=True)
    await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = parser.add_subparsers(dest="kind", required=True)
    for kind in ("grpc", "openai"):
        sub = kinds.add_parser(kind)
        sub.add_argument("--host", default="127.0.0.1")
        sub.add_argument("--tokenizer-dir", required=True,
                         help="a model directory with tokenizer.json, tokenizer_config.json and config.json")
    kinds.choices["grpc"].add_argument("--prefill-port", type=int, default=0)
    kinds.choices["grpc"].add_argument("--decode-port", type=int, default=0)
    kinds.choices["grpc"].add_argument("--tokens-per-chunk", type=int, default=4)
    kinds.choices["openai"].add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve_grpc(args) if args.kind == "grpc" else serve_openai(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
