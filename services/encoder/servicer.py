"""The Encoder gRPC service: a thin shell over :class:`EncoderWorker` and its embedding exporter.

Encoding runs in a worker thread (one at a time: the tower uses every core), so the event loop
keeps answering health checks, load reports and Release calls meanwhile.

    Encode: data URIs --worker: decode, preprocess, hash (a cached hash skips the forward)-->
            rows into the cache region --> one lease, a handle per image (exporter.lend)
            rows the region has no room for (every entry lent) travel inline instead
    Release: the router says the lease's reader is done (else it expires)
"""

from __future__ import annotations

import asyncio
import hashlib

import torch

from services.common import metrics
from services.common.errors import InvalidRequestError
from services.common.metrics import restart_count
from services.common.instance_rpcs import LoadRpcs, ReportNow
from services.common.wire import EncodedImage, LoadReport, RemoteEmbeddings, TensorBytes, encoded_image_to_proto
from services.encoder.cache import Entry
from services.encoder.export import EmbeddingExporter
from services.encoder.worker import EncoderWorker, ImageEmbedding, to_bytes
from services.engine.serving.staging import run_to_the_end
from services.pb import encoder_pb2, encoder_pb2_grpc

ENCODE_CALLS = metrics.counter("epd_encoder_encode_calls_total", "Encode calls this encoder served or began.")


class EncoderServicer(LoadRpcs, encoder_pb2_grpc.EncoderServicer):
    def __init__(self, worker: EncoderWorker, instance_id: str, max_images: int, tower_id: bytes = b"",
                 exporter: EmbeddingExporter | None = None, inline_max_bytes: int = 0) -> None:
        """``exporter`` None: every image's rows travel inline and nothing is cached.
        ``inline_max_bytes``: rows of at most this many bytes travel inline anyway."""
        self.worker = worker
        self.tower_id = tower_id
        """Identifies the tower's weights: the same pixels through another tower are other KV."""
        self.instance_id = instance_id
        self.max_images = max_images
        self.exporter = exporter
        self.inline_max_bytes = inline_max_bytes
        self.num_patches_in_flight = 0
        self.num_encode_calls = 0
        self.is_draining = False
        self.report_now = ReportNow()
        self._lock = asyncio.Lock()

    def key(self, worker_hash: bytes) -> bytes:
        """The image hash the cluster uses: the worker's (pixels + preprocessing) and the tower's."""
        return hashlib.sha256(self.tower_id + worker_hash).digest()

    async def Encode(self, request, context):
        images = list(request.images)
        if not images or len(images) > self.max_images:
            raise InvalidRequestError(f"send 1 to {self.max_images} images per request, not {len(images)}")
        self.num_encode_calls += 1
        ENCODE_CALLS.inc()
        num_patches = len(images) * self.worker.num_patches_per_image
        self.num_patches_in_flight += num_patches
        held: dict[bytes, Entry] = {}  # image hash -> its cache entry, pinned once by us
        try:
            async with self._lock:
                # A cancelled call still waits for the thread: it may pin cache entries until it
                # returns, and the tower must not run two batches at once.
                embeddings = await run_to_the_end(self.worker.encode, images, self._is_cached_here(held))
            encoded = self._export(embeddings, held, request.lease_id)
        except BaseException:
            for entry in held.values():
                self.exporter.cache.unpin(entry)
            raise
        finally:
            self.num_patches_in_flight -= num_patches
        return encoder_pb2.EncodeResponse(images=[encoded_image_to_proto(e) for e in encoded])

    async def Release(self, request, context):
        released = self.exporter is not None and self.exporter.release(request.lease_id)
        return encoder_pb2.ReleaseEmbeddingsResponse(released=released)

    def _is_cached_here(self, held: dict[bytes, Entry]):
        """The worker's ``is_cached``: a hit pins the entry into ``held`` (so no eviction takes
        it before it is lent)."""
        def is_cached(worker_hash: bytes) -> bool:
            if self.exporter is None:
                return False
            key = self.key(worker_hash)
            if key not in held and (entry := self.exporter.cache.acquire(key)) is not None:
                held[key] = entry
            return key in held
        return is_cached

    def _export(self, embeddings: list[ImageEmbedding], held: dict[bytes, Entry], lease_id: str) -> list[EncodedImage]:
        """Each image's reply: its rows lent (one lease for the call) or inline. ``held`` ends
        empty: every pin in it moved to the lease or was dropped."""
        cached = set(held)
        inline: dict[bytes, TensorBytes] = {}
        for image in embeddings:
            key = self.key(image.image_hash)
            if key in held or key in inline:
                continue
            rows = image.embeddings.detach().to("cpu", torch.float32).contiguous()
            entry = None
            if self.exporter is not None:  # (one copy: the rows' own bytes into the region)
                entry = self.exporter.cache.put(key, rows.view(torch.uint8).numpy().reshape(-1),
                                                tuple(rows.shape), "float32")
            if entry is None or rows.numel() * 4 <= self.inline_max_bytes:
                raw = to_bytes(rows)  # no room (every entry lent), or small enough to travel inline
                inline[key] = TensorBytes(raw.shape, raw.dtype, raw.data)
                if entry is not None:
                    self.exporter.cache.unpin(entry)  # cached for next time, not lent
            else:
                held[key] = entry
        remote: dict[bytes, RemoteEmbeddings] = {}
        if held:
            entries = list(held.values())
            held.clear()  # the lease owns these pins now (lend unpins them should it fail)
            _, handles = self.exporter.lend(entries, lease_id)
            remote = {e.key: RemoteEmbeddings(h, e.shape, e.dtype) for e, h in zip(entries, handles)}
        return [EncodedImage(key, inline.get(key), remote.get(key), key in cached)
                for key in (self.key(image.image_hash) for image in embeddings)]

    async def on_drain(self) -> None:
        """The server refuses new Encode calls from now on; the routers hear of it at once."""
        self.is_draining = True
        self.report_now()

    def load_report(self) -> LoadReport:
        num_leases = self.exporter.num_leases if self.exporter is not None else 0
        return LoadReport(self.instance_id, "encoder", num_running=int(self._lock.locked()),
                          num_patches_in_flight=self.num_patches_in_flight, num_leases=num_leases,
                          num_restarts=restart_count(), is_draining=self.is_draining)
