"""Rendezvous placement: stable, balanced, minimal movement, and replicas that survive a loss."""

from __future__ import annotations

import collections

import pytest

from kvstore.hashing import block_hashes, root_hash
from kvstore.placement import place, read_order

NODES = [f"store-{i}" for i in range(5)]
HASHES = block_hashes(list(range(16 * 2000)), 16, root_hash(model="m", block_size=16, dtype="float32"))


def test_same_answer_everywhere_and_roughly_balanced():
    owners = [place(h, NODES)[0] for h in HASHES]
    assert owners == [place(h, list(reversed(NODES)))[0] for h in HASHES]  # order-independent
    counts = collections.Counter(owners)
    assert set(counts) == set(NODES) and max(counts.values()) < 1.25 * len(HASHES) / len(NODES)


def test_a_new_node_moves_only_the_blocks_it_wins():
    before = [place(h, NODES)[0] for h in HASHES]
    after = [place(h, NODES + ["store-5"])[0] for h in HASHES]
    moved = [(a, b) for a, b in zip(before, after) if a != b]
    assert all(b == "store-5" for _, b in moved)
    assert 0.1 < len(moved) / len(HASHES) < 0.25  # about 1/6


def test_with_two_replicas_losing_a_node_loses_no_block():
    dead = "store-2"
    for h in HASHES:
        holders = place(h, NODES, replicas=2)
        assert len(set(holders)) == 2
        readable = read_order(h, NODES, lambda node: node != dead)
        assert readable[0] in holders  # the first live node in rank order holds a copy


def test_bad_arguments():
    with pytest.raises(ValueError, match="replicas"):
        place(HASHES[0], NODES, replicas=0)
    with pytest.raises(ValueError, match="unique"):
        place(HASHES[0], ["a", "a"])
