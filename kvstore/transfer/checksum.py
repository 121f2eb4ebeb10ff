"""The block checksum: fast enough to verify every block a receiver lands at memory speed.

Definition (the contract every transport verifies against)::

    words  = the buffer zero-padded to a multiple of 8 bytes, as little-endian uint64
    S_j    = sum of words[512 j : 512 (j + 1)]                 (4 KiB chunks; the last may be short)
    result = sum_j (2 j + 1) * S_j  +  length * 0x9E3779B97F4A7C15        (all mod 2**64)

What it detects: any single bit flip (it moves one S_j by 2**k, and an odd weight keeps that
non-zero mod 2**64); most multi-word corruption; chunks landing in the wrong place (their weight
changes); truncation or padding (the length term, and lost words). What it misses: words
swapped *within* one 4 KiB chunk, and deliberately crafted collisions -- it is not
cryptographic. Transport integrity beyond that is TCP's checksum and the lease protocol's job.
"""

from __future__ import annotations

import functools

import numpy as np

CHUNK_WORDS = 512
CHUNK_BYTES = CHUNK_WORDS * 8
LENGTH_MIX = 0x9E3779B97F4A7C15
MASK64 = (1 << 64) - 1
_WORD = np.dtype("<u8")


def chunk_sums(buf) -> np.ndarray:
    """The S_j of a C-contiguous bytes-like object, as uint64.

    Pieces of a block that start at multiples of CHUNK_BYTES give, concatenated, the block's
    chunk sums; so a receiver can sum each piece the moment it lands, while it is in cache.
    """
    if (isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.flags.c_contiguous
            and len(buf) % CHUNK_BYTES == 0):
        # The common case (a pool block or a piece of one), without the generic path's views.
        return buf.view(_WORD).reshape(-1, CHUNK_WORDS).sum(axis=1, dtype=np.uint64)
    data = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    num_words, num_tail = divmod(len(data), 8)
    words = data[:num_words * 8].view(_WORD)
    if num_tail:  # rare: KV blocks are whole words, so a copy here costs nothing in practice
        tail = np.zeros(8, dtype=np.uint8)
        tail[:num_tail] = data[num_words * 8:]
        words = np.append(words, tail.view(_WORD))
    num_full = len(words) // CHUNK_WORDS
    sums = words[:num_full * CHUNK_WORDS].reshape(num_full, CHUNK_WORDS).sum(axis=1, dtype=np.uint64)
    if len(words) % CHUNK_WORDS:
        sums = np.append(sums, words[num_full * CHUNK_WORDS:].sum(dtype=np.uint64))
    return sums


def combine(sums: np.ndarray, length: int) -> int:
    """Fold chunk sums into the checksum (array arithmetic wraps mod 2**64 silently)."""
    weighted = int(np.dot(sums, _weights(len(sums))))
    return (weighted + length * LENGTH_MIX) & MASK64


@functools.lru_cache(maxsize=64)
def _weights(num_chunks: int) -> np.ndarray:
    # Cached: every block of a pool has the same length, and a fresh arange per block costs
    # more than summing the block's chunks.
    return np.arange(1, 2 * num_chunks, 2, dtype=np.uint64)


def checksum(buf) -> int:
    """Checksum of any C-contiguous bytes-like object (bytes, memoryview, numpy array)."""
    return combine(chunk_sums(buf), memoryview(buf).nbytes)
