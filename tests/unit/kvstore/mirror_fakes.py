"""A mirror for MirroredIndex that keeps what is published in a dict and goes down on demand."""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import redis


class FakeMirror:
    def __init__(self) -> None:
        self.blocks: dict[Hashable, tuple[float, float]] = {}
        self.is_down = False
        self.is_kept = False
        """What replace_all published is still there (False: Redis lost it)."""
        self.num_replaced = 0
        self.num_published = 0

    def _check(self) -> None:
        if self.is_down:
            raise redis.ConnectionError("Redis is down (test)")

    def publish(self, changes: Mapping[Hashable, tuple[float, float] | None]) -> None:
        self._check()
        self.num_published += 1
        for block_hash, state in changes.items():
            if state is None:
                self.blocks.pop(block_hash, None)
            else:
                self.blocks[block_hash] = state

    def replace_all(self, entries: Mapping[Hashable, tuple[float, float]]) -> None:
        self._check()
        self.blocks = dict(entries)
        self.num_replaced += 1
        self.is_kept = True

    def is_published(self) -> bool:
        self._check()
        return self.is_kept

    def lose_everything(self) -> None:
        """Redis restarted empty."""
        self.blocks, self.is_kept = {}, False
