"""The encoder's embedding cache and E->P export: LRU by bytes, pins, leases, one-sided reads."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from kvstore.transfer.engine import TransferEngine
from services.common.errors import EmbeddingsMissingError
from services.common.wire import RequestSpec, encoded_image_from_proto
from services.common.sampling_params import SamplingParams
from services.encoder.cache import CACHE_LOOKUPS, EmbeddingCache
from services.encoder.export import EmbeddingExporter
from services.encoder.servicer import EncoderServicer
from services.encoder.vision import VisionConfig
from services.encoder.worker import EncoderWorker
from services.engine.serving.embeddings import MissingRows, image_inputs, read_rows, rows_missing_end
from services.pb import encoder_pb2
from tests.unit.encoder.images_factory import image_uri, noise_image

CHUNK = 1024


def rows(seed: int, num_bytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


def test_put_acquire_and_read_back_across_chunks():
    cache = EmbeddingCache(np.zeros(8 * CHUNK, np.uint8), CHUNK)
    data = rows(1, 2500)
    entry = cache.put(b"a", data, (625, 1), "float32")
    assert len(entry.chunks) == 3 and [n for _, n in cache.ranges(entry)] == [1024, 1024, 452]
    assert cache.read(entry) == data.tobytes()
    cache.unpin(entry)
    hits = CACHE_LOOKUPS.labels("hit")._value.get()
    assert cache.acquire(b"a") is entry and cache.acquire(b"b") is None
    assert CACHE_LOOKUPS.labels("hit")._value.get() == hits + 1


def test_lru_eviction_by_bytes_skips_pinned_entries():
    cache = EmbeddingCache(np.zeros(4 * CHUNK, np.uint8), CHUNK)
    a = cache.put(b"a", rows(1, 2 * CHUNK), (2,), "float32")  # stays pinned (lent)
    b = cache.put(b"b", rows(2, CHUNK), (1,), "float32")
    c = cache.put(b"c", rows(3, CHUNK), (1,), "float32")
    cache.unpin(b), cache.unpin(c)
    cache.unpin(cache.acquire(b"b"))  # b used more recently than c
    d = cache.put(b"d", rows(4, CHUNK), (1,), "float32")  # evicts c, the least recently used unpinned
    assert b"c" not in cache and b"b" in cache and b"a" in cache and d is not None
    assert cache.put(b"e", rows(5, 3 * CHUNK), (3,), "float32") is None  # a, d pinned: no room
    assert b"b" in cache  # a refused put evicts nothing
    cache.unpin(a)
    e = cache.put(b"e", rows(5, 3 * CHUNK), (3,), "float32")
    assert e is not None and b"a" not in cache and cache.read(e) == rows(5, 3 * CHUNK).tobytes()
    assert cache.num_used_bytes <= cache.capacity_bytes


def test_an_evicted_lent_entry_keeps_its_chunks_until_unpinned():
    cache = EmbeddingCache(np.zeros(2 * CHUNK, np.uint8), CHUNK)
    a = cache.put(b"a", rows(1, CHUNK), (1,), "float32")
    assert cache.put(b"a", rows(2, CHUNK), (1,), "float32") is not None  # replaced while lent
    assert cache.read(a) == rows(1, CHUNK).tobytes() and cache.num_used_bytes == 2 * CHUNK
    cache.unpin(a)
    assert cache.num_used_bytes == CHUNK


def test_lent_rows_read_one_sided_and_leases_end_once():
    async def main():
        with TransferEngine(transports=("tcp",)) as owner, TransferEngine(transports=("tcp",)) as reader:
            exporter = EmbeddingExporter(owner, 16 * CHUNK, lease_ttl_s=60, chunk_bytes=CHUNK)
            tensor = torch.randn(37, 24)
            data = tensor.numpy().view(np.uint8).reshape(-1)
            entry = exporter.cache.put(b"k", data, (37, 24), "float32")
            lease_id, [handle] = exporter.lend([entry])
            assert exporter.num_leases == 1 and handle.lease_id == lease_id and len(handle.blocks) == 4
            from services.common.wire import RemoteEmbeddings
            got = await read_rows(reader, RemoteEmbeddings(handle, (37, 24), "float32"))
            assert torch.equal(got, tensor)
            assert exporter.release(lease_id) and not exporter.release(lease_id)
            assert exporter.num_leases == 0 and entry.num_pins == 0
            # A reader of a lease whose region is gone fails cleanly (the router re-encodes).
            entry = exporter.cache.acquire(b"k")
            _, [handle] = exporter.lend([entry])
            exporter.close()
            assert exporter.num_leases == 0
            with pytest.raises(EmbeddingsMissingError, match="could not be read"):
                await read_rows(reader, RemoteEmbeddings(handle, (37, 24), "float32"))
    asyncio.run(main())


def test_leases_expire_when_nobody_releases_them():
    with TransferEngine(transports=("tcp",)) as owner:
        exporter = EmbeddingExporter(owner, 4 * CHUNK, lease_ttl_s=0.01, chunk_bytes=CHUNK)
        entry = exporter.cache.put(b"k", rows(1, 100), (25,), "float32")
        exporter.lend([entry])
        asyncio.run(asyncio.wait_for(_expire_once(exporter), 5))
        assert exporter.num_leases == 0 and entry.num_pins == 0
        exporter.close()


async def _expire_once(exporter):
    task = asyncio.ensure_future(exporter.expire_leases(period_s=0.02))
    while exporter.num_leases:
        await asyncio.sleep(0.02)
    task.cancel()


SMALL = VisionConfig(out_hidden_size=48, image_size=32, patch_size=8, hidden_size=32, num_layers=2, num_heads=2)
URIS = [image_uri(noise_image(40, 30, seed=s)) for s in range(3)]


class CountingWorker(EncoderWorker):
    num_forwarded = 0

    def _forward(self, batch):
        self.num_forwarded += len(batch)
        return super()._forward(batch)


def test_servicer_lends_rows_caches_them_and_a_hit_skips_the_forward():
    async def main():
        worker = CountingWorker(SMALL, device="cpu")
        with TransferEngine(transports=("tcp",)) as owner, TransferEngine(transports=("tcp",)) as reader:
            exporter = EmbeddingExporter(owner, 64 * CHUNK, chunk_bytes=CHUNK)
            servicer = EncoderServicer(worker, "e-0", 8, tower_id=b"tower", exporter=exporter)
            first = await servicer.Encode(encoder_pb2.EncodeRequest(images=URIS[:2] + URIS[:1]), None)
            images = [encoded_image_from_proto(i) for i in first.images]
            assert worker.num_forwarded == 2 and exporter.num_leases == 1
            assert all(i.remote is not None and i.embeddings is None and not i.is_cached for i in images)
            assert images[0] == images[2]  # the same picture twice: one row set, one handle
            expected = worker.encode(URIS[:2])
            for image, want in zip(images, expected):
                got = await read_rows(reader, image.remote)
                assert torch.equal(got, want.embeddings) and image.image_hash == servicer.key(want.image_hash)
            second = [encoded_image_from_proto(i) for i in
                      (await servicer.Encode(encoder_pb2.EncodeRequest(images=URIS[1:]), None)).images]
            assert worker.num_forwarded == 2 + 2 + 1  # (+2: the check above) only URIS[2] is new
            assert [i.is_cached for i in second] == [True, False]
            for lease in {i.remote.handle.lease_id for i in images + second}:
                assert (await servicer.Release(encoder_pb2.ReleaseEmbeddingsRequest(lease_id=lease), None)).released
            assert exporter.num_leases == 0 and servicer.load_report().num_leases == 0
            exporter.close()
    asyncio.run(main())


def test_rows_travel_inline_when_the_region_is_full_or_they_are_small():
    async def main():
        worker = EncoderWorker(SMALL, device="cpu")
        num_bytes = 16 * 48 * 4
        with TransferEngine(transports=("tcp",)) as owner:
            exporter = EmbeddingExporter(owner, 4 * CHUNK, chunk_bytes=CHUNK)  # room for one image's rows
            servicer = EncoderServicer(worker, "e-0", 8, exporter=exporter)
            reply = await servicer.Encode(encoder_pb2.EncodeRequest(images=URIS[:2]), None)
            a, b = [encoded_image_from_proto(i) for i in reply.images]
            assert a.remote is not None and b.embeddings is not None and b.remote is None
            assert math.prod(b.embeddings.shape) * 4 == len(b.embeddings.data) == num_bytes
            small = EncoderServicer(worker, "e-1", 8, exporter=exporter, inline_max_bytes=num_bytes)
            [c] = [encoded_image_from_proto(i) for i in
                   (await small.Encode(encoder_pb2.EncodeRequest(images=URIS[2:]), None)).images]
            assert c.embeddings is not None and c.remote is None
            exporter.close()
    asyncio.run(main())


def test_engine_side_images_rows_inline_remote_or_missing():
    from services.common.wire import ImageInput, TensorBytes
    spec = RequestSpec("r", (0,) * 40, SamplingParams(), (
        ImageInput(b"\x01", 2, TensorBytes((3, 4), "float32", bytes(48))), ImageInput(b"\x02", 10, num_rows=5)))
    assert rows_missing_end(spec) == 15

    async def main():
        with TransferEngine(transports=("tcp",)) as reader:
            return await image_inputs(spec, reader, hidden_size=4)
    inline, missing = asyncio.run(main())
    assert inline.embeddings.shape == (3, 4) and inline.image_hash == "01"
    assert isinstance(missing.embeddings, MissingRows) and missing.num_tokens == 5
    with pytest.raises(RuntimeError, match="were not sent"):
        missing.embeddings[0:1]


def test_a_wildcard_bind_without_an_advertised_host_sends_rows_inline():
    from services.encoder.config import EncoderConfig
    from services.encoder.export import exporter_from_config
    assert exporter_from_config(EncoderConfig(host="0.0.0.0"), "e-0") is None
    assert exporter_from_config(EncoderConfig(cache_mib=0), "e-0") is None
    exporter = exporter_from_config(EncoderConfig(host="0.0.0.0", advertise_host="10.1.2.3", cache_mib=1), "e-0")
    try:
        assert exporter.transfer.endpoint.tcp_address.startswith("10.1.2.3:")
    finally:
        exporter.close()
        exporter.transfer.close()
