"""The Encoder gRPC service: a thin shell over :class:`EncoderWorker`.

Encoding runs in a worker thread (one at a time: the tower uses every core), so the event loop
keeps answering health checks and load reports meanwhile.
"""

from __future__ import annotations

import asyncio
import hashlib

from services.common.errors import InvalidRequestError
from services.common.metrics import restart_count
from services.common.server import LoadRpcs
from services.common.wire import LoadReport
from services.encoder.worker import EncoderWorker, to_bytes
from services.pb import common_pb2, encoder_pb2, encoder_pb2_grpc


class EncoderServicer(LoadRpcs, encoder_pb2_grpc.EncoderServicer):
    def __init__(self, worker: EncoderWorker, instance_id: str, max_images: int, tower_id: bytes = b"") -> None:
        self.worker = worker
        self.tower_id = tower_id
        """Identifies the tower's weights: the same pixels through another tower are other KV."""
        self.instance_id = instance_id
        self.max_images = max_images
        self.num_patches_in_flight = 0
        self._lock = asyncio.Lock()

    async def Encode(self, request, context):
        images = list(request.images)
        if not images or len(images) > self.max_images:
            raise InvalidRequestError(f"send 1 to {self.max_images} images per request, not {len(images)}")
        num_patches = len(images) * self.worker.num_patches_per_image
        self.num_patches_in_flight += num_patches
        try:
            async with self._lock:
                embeddings = await asyncio.to_thread(self.worker.encode, images)
        finally:
            self.num_patches_in_flight -= num_patches
        reply = encoder_pb2.EncodeResponse()
        for image in embeddings:
            raw = to_bytes(image.embeddings)
            image_hash = hashlib.sha256(self.tower_id + image.image_hash).digest()
            reply.images.add(image_hash=image_hash, embeddings=common_pb2.Tensor(
                shape=list(raw.shape), dtype=raw.dtype, data=raw.data))
        return reply

    def load_report(self) -> LoadReport:
        return LoadReport(self.instance_id, "encoder", num_running=int(self._lock.locked()),
                          num_patches_in_flight=self.num_patches_in_flight, num_restarts=restart_count())
