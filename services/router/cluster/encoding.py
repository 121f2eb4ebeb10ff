"""The router's image stage: encode (or skip the encoder), widen placeholders, hold E->P leases.

::

    images --> memo: sha256(upload) -> (image hash, rows), learnt from encoder replies
                 every image known, and the blocks through the last image were prefilled
                 before (a bounded memo of block hashes) --> no encoder call: prefill gets
                 hashes and sizes only, and finds the KV in its prefix cache or the KV store
                 (evicted after all: EmbeddingsMissingError, and the request is encoded)
           --> else Encode (another encoder when one is unavailable): per image its rows lent
                 (a handle) or inline; the leases are released once the Prefill call ended,
                 whatever way it ended (EmbeddingLeases)

The router has no torch and cannot hash pixels: an upload's bytes are all it can key on, so
the same picture re-encoded (other bytes) is simply a miss.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import grpc.aio

from kvstore.hashing import block_hashes
from services.common import metrics
from services.common.errors import InvalidRequestError
from services.common.grpc_errors import error_from_rpc
from services.common.retry import is_retryable, retry
from services.common.wire import EncodedImage, ImageInput, RequestSpec, encoded_image_from_proto
from services.pb import encoder_pb2
from services.router.cluster.backend import GenerateRequest
from services.router.cluster.instances import Instance, InstancePool
from services.router.policies import RequestView

logger = logging.getLogger(__name__)
ENCODER_SKIPS = metrics.counter(
    "epd_router_encoder_skips_total", "Image requests by whether the router skipped the encoder (skipped: every "
    "image's KV was a prefix hit; evicted: it skipped, prefill lacked the KV, and the images were encoded).",
    ["outcome"])


@dataclass(frozen=True)
class KnownImage:
    image_hash: bytes
    num_rows: int


class ImageMemo:
    """Bounded LRU memos: upload digest -> image, and block hashes whose KV was prefilled."""

    def __init__(self, max_images: int = 4096, max_blocks: int = 65536) -> None:
        self.max_images, self.max_blocks = max_images, max_blocks
        self._images: OrderedDict[bytes, KnownImage] = OrderedDict()
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    @staticmethod
    def digest(upload: str) -> bytes:
        return hashlib.sha256(upload.encode()).digest()

    def learn(self, upload: str, image: KnownImage) -> None:
        _touch(self._images, self.digest(upload), image, self.max_images)

    def known(self, uploads: Sequence[str]) -> list[KnownImage] | None:
        """Every upload's image, or None when one is not known."""
        found = [self._images.get(self.digest(u)) for u in uploads]
        return None if any(f is None for f in found) else found

    def prefilled(self, block_hash: bytes) -> None:
        _touch(self._blocks, block_hash, None, self.max_blocks)

    def was_prefilled(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks


def _touch(memo: OrderedDict, key: bytes, value, limit: int) -> None:
    memo[key] = value
    memo.move_to_end(key)
    while len(memo) > limit:
        memo.popitem(last=False)


def widen(request: GenerateRequest, images: Sequence[ImageInput]) -> RequestSpec:
    """The wire spec: each image's single placeholder becomes one token per row. ``images``
    (in request order) carry position 0; their real positions are set here."""
    keys = dict(cache_salt=request.cache_salt, request_class=request.request_class)
    token_ids, placed, shift = list(request.prompt_token_ids), [], 0
    for position, image in sorted(zip(request.image_positions, images), key=lambda pair: pair[0]):
        start = position + shift
        token_ids[start:start + 1] = [token_ids[start]] * image.rows
        placed.append(ImageInput(image.image_hash, start, image.embeddings, image.remote, image.num_rows))
        shift += image.rows - 1
    return RequestSpec(request.request_id, tuple(token_ids), request.params, tuple(placed), **keys)


def image_block_hashes(spec: RequestSpec, block_size: int, root: bytes) -> list[bytes]:
    """The prompt's block hashes with each image's hash an extra key of the blocks it touches
    (as the engines hash them, under the router's own root): another image never matches."""
    extra = None
    if spec.images:
        extra = [tuple(i.image_hash.hex() for i in spec.images
                       if i.position < (b + 1) * block_size and i.position + i.rows > b * block_size)
                 for b in range(len(spec.prompt_token_ids) // block_size)]
    return block_hashes(list(spec.prompt_token_ids), block_size, root, extra)


def last_image_block(spec: RequestSpec, block_size: int) -> int | None:
    """Index of the last block an image touches, when the engine would take every block up to
    it from a prefix cache (it always computes the prompt's last token); else None."""
    if not spec.images:
        return None
    end = max(i.position + i.rows for i in spec.images)
    index = -(-end // block_size) - 1
    return index if index < (len(spec.prompt_token_ids) - 1) // block_size else None


class EmbeddingLeases:
    """The E->P leases of one request, each named here before its Encode call is sent (so one
    whose reply never arrived, the client gone, is released too), released once."""

    _releasing: set[asyncio.Task] = set()
    """Release calls in flight (held: the loop keeps only weak references to tasks)."""

    def __init__(self) -> None:
        self._held: list[tuple[Instance, str]] = []

    def new(self, instance: Instance) -> str:
        lease_id = uuid.uuid4().hex
        self._held.append((instance, lease_id))
        return lease_id

    async def release(self) -> None:
        """Send every Release; they run on by themselves, so a cancelled caller strands none."""
        held, self._held = self._held, []
        for instance, lease_id in held:
            task = asyncio.get_running_loop().create_task(_release(instance, lease_id))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
        await asyncio.sleep(0)  # let them start


async def _release(instance: Instance, lease_id: str) -> None:
    try:
        await instance.stub.Release(encoder_pb2.ReleaseEmbeddingsRequest(lease_id=lease_id), timeout=5.0)
    except grpc.aio.AioRpcError as exc:  # the lease expires on its own
        logger.warning("could not release embedding lease %s at %s: %s", lease_id, instance.address, exc.details())


async def encode(encoders: InstancePool, request: GenerateRequest, leases: EmbeddingLeases, memo: ImageMemo,
                 timeout_s: float, avoid: Sequence[str] = ()) -> tuple[list[EncodedImage], str]:
    """Every image encoded (another encoder tried when one is unavailable), its lease held in
    ``leases``, the memo taught; and the encoder's address."""
    if not encoders:
        raise InvalidRequestError("this deployment has no encoder: images are not supported")
    view = RequestView(request.request_id, len(request.prompt_token_ids), num_patches=len(request.images))
    failed: list[str] = list(avoid)

    async def attempt():
        instance = encoders.pick(view, arrival=len(failed) == len(avoid), avoid=failed)
        message = encoder_pb2.EncodeRequest(images=list(request.images), lease_id=leases.new(instance))
        try:
            with encoders.using(instance):
                reply = await instance.stub.Encode(message, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            error = error_from_rpc(exc)
            if error.retryable or exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                encoders.failed(instance, error)
                failed.append(instance.address)
            raise error from exc
        encoders.succeeded(instance)
        return [encoded_image_from_proto(image) for image in reply.images], instance.address

    images, address = await retry(attempt, retry_on=is_retryable, attempts=max(2, len(encoders)))
    for upload, image in zip(request.images, images):
        rows = image.embeddings.shape[0] if image.embeddings is not None else image.remote.shape[0]
        memo.learn(upload, KnownImage(image.image_hash, rows))
    return images, address
