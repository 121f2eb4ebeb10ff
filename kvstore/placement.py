"""Which store nodes hold a block: rendezvous (highest-random-weight) hashing with replicas.

Every node gets a score per block, ``H(node id | block hash)``; the ``replicas`` highest-scoring
nodes hold it. Any router, engine or store computes the same answer from the same node list
with no coordination, and when a node joins or leaves only the blocks it wins or held move
(about 1/n of them), unlike ``hash % n``. With replicas = 2, losing one node loses no block:
the next node in a block's ranking already holds it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def rank(block_hash: bytes, nodes: Sequence[str]) -> list[str]:
    """All nodes, best first, for this block."""
    def score(node: str) -> bytes:
        return hashlib.sha256(node.encode() + b"|" + block_hash).digest()

    return sorted(nodes, key=score, reverse=True)


def place(block_hash: bytes, nodes: Sequence[str], replicas: int = 1) -> list[str]:
    """The nodes that hold the block (its first ``replicas`` in rank order)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1 (got {replicas})")
    if len(set(nodes)) != len(nodes):
        raise ValueError("node ids must be unique")
    return rank(block_hash, nodes)[:replicas]


def read_order(block_hash: bytes, nodes: Sequence[str], is_alive) -> list[str]:
    """Where to read a block from, in order: its live nodes by rank (a dead one is skipped)."""
    return [node for node in rank(block_hash, nodes) if is_alive(node)]
