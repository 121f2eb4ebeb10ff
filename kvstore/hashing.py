"""Block hashing: the one contract router, engines and store share (STYLE rule 2).

A block's hash names its KV *and everything the KV depends on*: the tokens of the block, every
token before it (through the parent hash), and the extra keys that change the KV for the same
tokens (model, block size, dtype, tenant salt at the root; image hashes on the blocks they
touch)::

    root = H(SEED | "root" | model | block_size | dtype | salt)
    h0   = H(SEED | root | tokens[0:B]   | extra_0)
    h1   = H(SEED | h0   | tokens[B:2B]  | extra_1)
    ...                              (only full blocks are hashed)

Only stdlib ``hashlib`` with an explicit seed, never Python's randomised ``hash()``, so the
same prompt gives the same hashes in every process on every machine. ``tests/unit/kvstore``
pins golden vectors: changing anything here invalidates every stored block, on purpose.
"""

from __future__ import annotations

import hashlib
import struct
from typing import NewType, Sequence

BlockHash = NewType("BlockHash", bytes)
"""32-byte SHA-256 digest; ``.hex()`` is its text form in indexes and logs."""

SEED = b"epd-block-hash-v1"


def _field(data: bytes) -> bytes:
    # Length-prefixed so that no two different key lists serialise to the same bytes.
    return struct.pack("<I", len(data)) + data


def root_hash(*, model: str, block_size: int, dtype: str, salt: str = "") -> BlockHash:
    """The parent of a sequence's first block: what every block of the sequence depends on."""
    h = hashlib.sha256(SEED)
    for part in (b"root", model.encode(), str(block_size).encode(), dtype.encode(), salt.encode()):
        h.update(_field(part))
    return BlockHash(h.digest())


def chain_hash(parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    """Hash of one full block given its parent's hash, its tokens and its extra keys."""
    assert len(parent) == 32, "parent must be a 32-byte BlockHash"
    h = hashlib.sha256(SEED)
    h.update(parent)
    h.update(_field(struct.pack(f"<{len(token_ids)}I", *token_ids)))
    for key in extra_keys:
        h.update(_field(key.encode()))
    return BlockHash(h.digest())


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    root: BlockHash,
    extra_keys: Sequence[Sequence[str]] | None = None,
    start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` on.

    ``extra_keys[i]`` are block i's extra keys (e.g. the hashes of images whose placeholder
    tokens fall into it). ``parent`` is block ``start - 1``'s hash (``root`` when start is 0),
    so a growing sequence hashes only its new blocks.
    """
    hashes: list[BlockHash] = []
    prev = root if start == 0 else parent
    assert prev is not None, "parent is required when start > 0"
    for i in range(start, len(token_ids) // block_size):
        block = token_ids[i * block_size:(i + 1) * block_size]
        prev = chain_hash(prev, block, extra_keys[i] if extra_keys and i < len(extra_keys) else ())
        hashes.append(prev)
    return hashes
