"""The router's image stage over fake stubs: E->P leases released however the Prefill call
ends, unreadable rows re-encoded on another encoder, the encoder skipped on a remembered prefix
and the request encoded after all when prefill lacks that KV, a moved decode given the rows."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest

from services.common.errors import EmbeddingsMissingError
from services.common.grpc_errors import ERROR_CLASS_KEY
from services.common.sampling_params import SamplingParams
from services.common.wire import ModelInfo, decode_request_from_proto, spec_from_proto
from services.pb import decode_pb2, encoder_pb2, prefill_pb2
from services.router.cluster.backend import GenerateRequest
from services.router.cluster.encoding import ImageMemo, KnownImage, image_block_hashes, widen
from services.router.cluster.pipeline import ClusterBackend
from services.router.policies import make_policy

P, D, E1, E2, D2 = "10.0.0.1:5000", "10.0.0.2:5000", "10.0.0.3:5000", "10.0.0.4:5000", "10.0.0.5:5000"
ROWS, IMAGE_HASH = 3, b"\x07" * 32


def missing() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                grpc.aio.Metadata((ERROR_CLASS_KEY, "EmbeddingsMissingError")), "rows unreadable")


class FakeEncoder:
    def __init__(self, name: str) -> None:
        self.name, self.calls, self.released = name, 0, []

    async def Encode(self, message, **kwargs):
        self.calls += 1
        reply = encoder_pb2.EncodeResponse()
        for _ in message.images:
            image = reply.images.add(image_hash=IMAGE_HASH)
            image.remote.handle.lease_id = message.lease_id
            image.remote.shape.extend([ROWS, 8])
            image.remote.dtype = "float32"
        return reply

    async def Release(self, message, **kwargs):
        self.released.append(message.lease_id)
        return encoder_pb2.ReleaseEmbeddingsResponse(released=True)


class FakePrefill:
    """Fails the calls named in ``fail`` (by number) as missing rows; records each spec."""

    def __init__(self, fail: set[int]) -> None:
        self.fail, self.specs = fail, []

    async def Prefill(self, message, **kwargs):
        self.specs.append(spec_from_proto(message.spec))
        if len(self.specs) in self.fail:
            raise missing()
        return prefill_pb2.PrefillResponse(first_token_id=7, finish_reason="length")


def backend_with(fail: set[int]) -> tuple[ClusterBackend, FakePrefill, FakeEncoder, FakeEncoder]:
    backend = ClusterBackend((P,), (D,), (E1, E2), policies={"encoder": make_policy("round_robin")})
    backend.info = ModelInfo("m", 4096, 512, 4, (2,), "", "{}", 5, 8)
    backend.prefills.instances[0].stub = prefill = FakePrefill(fail)
    e1, e2 = FakeEncoder("e1"), FakeEncoder("e2")
    backend.encoders.find(E1).stub, backend.encoders.find(E2).stub = e1, e2
    return backend, prefill, e1, e2


REQUEST = GenerateRequest("chatcmpl-1", (1, 5) + (9,) * 18, SamplingParams(max_tokens=1),
                          images=("data:image/png;base64,AAAA",), image_positions=(1,))


def lent(specs) -> list[str]:
    return [i.remote.handle.lease_id for spec in specs for i in spec.images if i.remote is not None]


async def run(backend: ClusterBackend) -> list:
    return [chunk async for chunk in backend.generate(REQUEST)]


def test_unreadable_rows_are_encoded_again_elsewhere_and_every_lease_released():
    async def main():
        backend, prefill, e1, e2 = backend_with(fail={1})
        try:
            [chunk] = await run(backend)
            assert chunk.token_ids == (7,) and e1.calls + e2.calls == 2 and e1.calls == e2.calls == 1
            first, second = prefill.specs
            assert first.images[0].remote.handle.lease_id != second.images[0].remote.handle.lease_id
            assert sorted(e1.released + e2.released) == sorted(lent(prefill.specs))
            assert second.prompt_token_ids[1:1 + ROWS] == (5,) * ROWS and second.images[0].position == 1
        finally:
            await backend.close()
    asyncio.run(main())


def test_the_encoder_is_skipped_on_a_remembered_prefix_and_used_when_prefill_lacks_it():
    async def main():
        backend, prefill, e1, e2 = backend_with(fail={3})
        try:
            await run(backend)  # learns the image and that its blocks were prefilled
            await run(backend)  # skipped: no Encode, no rows sent
            assert e1.calls + e2.calls == 1
            skipped = prefill.specs[1].images[0]
            assert skipped.remote is None and skipped.embeddings is None and skipped.rows == ROWS
            await run(backend)  # skipped, prefill lacks the KV (evicted): encoded after all
            assert e1.calls + e2.calls == 2 and len(prefill.specs) == 4
            assert prefill.specs[3].images[0].remote is not None
            assert sorted(e1.released + e2.released) == sorted(lent(prefill.specs)) and len(lent(prefill.specs)) == 2
        finally:
            await backend.close()
    asyncio.run(main())


def test_the_prefill_failing_twice_on_rows_is_the_requests_error():
    async def main():
        backend, prefill, e1, e2 = backend_with(fail={1, 2})
        try:
            with pytest.raises(EmbeddingsMissingError):
                await run(backend)
            assert len(prefill.specs) == 2 and sorted(e1.released + e2.released) == sorted(lent(prefill.specs))
        finally:
            await backend.close()
    asyncio.run(main())


def test_memo_is_bounded_and_block_hashes_carry_the_image():
    memo = ImageMemo(max_images=2, max_blocks=2)
    for i in range(3):
        memo.learn(f"uri-{i}", KnownImage(bytes([i]) * 32, 4))
        memo.prefilled(bytes([i]))
    assert memo.known(["uri-0"]) is None and memo.known(["uri-1", "uri-2"]) is not None
    assert not memo.was_prefilled(b"\x00") and memo.was_prefilled(b"\x02")
    from services.common.wire import ImageInput
    one = widen(REQUEST, [ImageInput(b"\x01" * 32, 0, num_rows=ROWS)])
    two = widen(REQUEST, [ImageInput(b"\x02" * 32, 0, num_rows=ROWS)])
    a, b = image_block_hashes(one, 4, b"r" * 32), image_block_hashes(two, 4, b"r" * 32)
    assert one.prompt_token_ids == two.prompt_token_ids and a[0] != b[0] and len(a) == len(one.prompt_token_ids) // 4


class FakeStream:
    def __init__(self, chunks: list, error: Exception | None) -> None:
        self.chunks, self.error = chunks, error

    async def read(self):
        if self.chunks:
            return self.chunks.pop(0)
        if self.error is not None:
            raise self.error
        return grpc.aio.EOF

    def cancel(self) -> None:
        pass


class FakeDecode:
    """One token, then (``breaks``) a dead stream, or the finish."""

    def __init__(self, breaks: bool) -> None:
        self.breaks, self.requests = breaks, []

    def Generate(self, message, **kwargs):
        self.requests.append(decode_request_from_proto(message))
        if self.breaks:
            dead = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
            return FakeStream([decode_pb2.TokenChunk(token_ids=[8])], dead)
        return FakeStream([decode_pb2.TokenChunk(token_ids=[9], finish_reason="length")], None)


class HandingOverPrefill(FakePrefill):
    async def Prefill(self, message, **kwargs):
        self.specs.append(spec_from_proto(message.spec))
        return prefill_pb2.PrefillResponse(first_token_id=7)


def test_a_moved_request_takes_its_images_rows_to_the_next_decode_instance():
    async def main():
        backend = ClusterBackend((P,), (D, D2), (E1,), policies={"decode": make_policy("round_robin")})
        backend.info = ModelInfo("m", 4096, 512, 4, (2,), "", "{}", 5, 8)
        backend.prefills.instances[0].stub = HandingOverPrefill(set())
        backend.encoders.find(E1).stub = encoder = FakeEncoder("e1")
        first, second = FakeDecode(breaks=True), FakeDecode(breaks=False)
        backend.decodes.find(D).stub, backend.decodes.find(D2).stub = first, second
        try:
            chunks = await run(backend)
            assert [c.token_ids for c in chunks] == [(7,), (8,), (9,)]
            [taken], [moved] = first.requests, second.requests
            assert all(i.remote is None and i.embeddings is None for i in taken.spec.images)  # had the KV
            assert moved.kv is None and moved.spec.images[0].remote is not None  # computes: needs rows
            assert moved.spec.images[0].position == taken.spec.images[0].position
            lent_ids = [taken_or_moved for taken_or_moved in lent(backend.prefills.instances[0].stub.specs)]
            lent_ids.append(moved.spec.images[0].remote.handle.lease_id)
            assert encoder.calls == 2 and sorted(encoder.released) == sorted(lent_ids)
        finally:
            await backend.close()
    asyncio.run(main())


def test_a_lease_released_before_its_encode_finished_ends_when_granted():
    from kvstore.transfer.engine import TransferEngine
    from services.encoder.export import EmbeddingExporter
    import numpy as np
    with TransferEngine(transports=("tcp",)) as owner:
        exporter = EmbeddingExporter(owner, 4096, chunk_bytes=1024)
        assert not exporter.release("gone-early")  # the router gave up before the reply came
        entry = exporter.cache.put(b"k", np.zeros(100, np.uint8), (25,), "float32")
        lease_id, _ = exporter.lend([entry], "gone-early")
        assert lease_id == "gone-early" and exporter.num_leases == 0 and entry.num_pins == 0
        exporter.close()
