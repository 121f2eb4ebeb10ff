"""An engine request's image rows: inline, read one-sided from the encoder, or not needed.

    ImageInput.embeddings  inline bytes                        --> a tensor
    ImageInput.remote      rows lent by an encoder (a handle)  --> read one-sided (the KV transfer
                           engine, its transports, checksums and poll() state machine), a tensor
    neither                the KV of every block the image touches must be in the prefix cache:
                           prefill on the router's prefix hit (pinned here until the request has
                           its first token, so nothing evicts it meanwhile), decode (the prompt's
                           KV arrives from prefill) --> :class:`MissingRows`, which has the shape
                           the engine checks and fails loudly if its rows are ever read

Rows that cannot be had are an :class:`EmbeddingsMissingError`: the router encodes the images
and runs the request again; nothing is ever computed from rows that did not arrive.
"""

from __future__ import annotations

import asyncio
import math

import torch

from kvstore.transfer.engine import TransferEngine
from services.common.errors import EmbeddingsMissingError, InvalidRequestError
from services.common.wire import ImageInput, RemoteEmbeddings, RequestSpec
from services.engine.sequence import MultiModalInput
from services.engine.serving.instance import tensor_from_bytes
from services.engine.serving.seam import EngineSeam, Reservation, read_kv


class MissingRows:
    """Stands in for rows that were not sent: shaped like them, unreadable."""

    def __init__(self, num_rows: int, hidden_size: int) -> None:
        self.shape = (num_rows, hidden_size)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index):
        raise RuntimeError("an image's rows were not sent (its KV was to come from a prefix cache) but "
                           "the engine is computing its positions: a bug in the caller's coverage check")


async def image_inputs(spec: RequestSpec, transfer: TransferEngine, hidden_size: int) -> tuple[MultiModalInput, ...]:
    """The spec's images for the engine, lent rows read (concurrently) first."""
    remote = [i for i, image in enumerate(spec.images) if image.remote is not None]
    read = await asyncio.gather(*(read_rows(transfer, spec.images[i].remote, i) for i in remote))
    rows = dict(zip(remote, read))
    return tuple(MultiModalInput(image.position, _rows(image, rows.get(i), hidden_size), image.image_hash.hex())
                 for i, image in enumerate(spec.images))


def _rows(image: ImageInput, read: torch.Tensor | None, hidden_size: int):
    if read is not None:
        return read
    if image.embeddings is not None:
        return tensor_from_bytes(image.embeddings)
    return MissingRows(image.rows, hidden_size)


async def read_rows(transfer: TransferEngine, remote: RemoteEmbeddings, index: int = 0) -> torch.Tensor:
    """One image's rows, read one-sided from its encoder (every block checksummed on arrival)."""
    dtype = getattr(torch, remote.dtype, None)
    if not isinstance(dtype, torch.dtype) or len(remote.shape) != 2:
        raise InvalidRequestError(f"image {index}: remote rows of dtype {remote.dtype!r} and shape "
                                  f"{list(remote.shape)}: expected [rows, hidden] float32 or bfloat16")
    num_bytes = math.prod(remote.shape) * dtype.itemsize
    if remote.handle.num_bytes != num_bytes:
        raise InvalidRequestError(f"image {index}: its handle names {remote.handle.num_bytes} bytes, "
                                  f"its shape {list(remote.shape)} needs {num_bytes}")
    data = torch.empty(num_bytes, dtype=torch.uint8)
    view, destinations, at = data.numpy(), [], 0
    for block in remote.handle.blocks:
        destinations.append(view[at:at + block.length])
        at += block.length
    error = await read_kv(transfer, remote.handle, destinations)
    if error is not None:
        raise EmbeddingsMissingError(f"image {index}: its rows could not be read from its encoder "
                                     f"({remote.handle.owner.tcp_address or remote.handle.owner.host_id}): {error}")
    return data.view(dtype).view(tuple(remote.shape))


def rows_missing_end(spec: RequestSpec) -> int:
    """The end of the last prompt position whose image rows were not sent (0: none)."""
    return max((i.position + i.rows for i in spec.images if i.embeddings is None and i.remote is None), default=0)


async def pin_cached_prefix(seam: EngineSeam, token_ids: list[int], mm_inputs: tuple[MultiModalInput, ...],
                            cache_salt: str, num_tokens: int) -> Reservation | None:
    """The cached blocks covering prompt positions [0, num_tokens), pinned (nothing evicts them
    until :func:`unpin`); None when they are not all cached here, or when the engine would
    compute some of those positions anyway (it always computes the prompt's last token)."""
    block_size = seam.block_size
    num_blocks = -(-num_tokens // block_size)
    if num_blocks > (len(token_ids) - 1) // block_size:
        return None
    hashes, num_local = await seam.prompt_hashes(token_ids, mm_inputs, cache_salt)
    if num_local < num_blocks:
        return None
    reservation = await seam.reserve_prefix(token_ids, hashes, num_blocks)
    if reservation is not None and reservation.num_local_blocks < num_blocks:  # evicted meanwhile
        await unpin(seam, reservation)
        reservation = None
    return reservation


async def unpin(seam: EngineSeam, reservation: Reservation) -> None:
    await seam.commit(reservation, filled=())
