from __future__ import annotations

import asyncio

import pytest

from kvstore.transfer import LeaseTable
from tests.factories import ManualClock


def test_release_runs_on_release_exactly_once():
    released = []
    leases = LeaseTable(ttl_s=5.0)
    lease_id = leases.grant(lambda: released.append("a"))
    assert len(leases) == 1 and lease_id in leases
    assert leases.release(lease_id) is True
    assert leases.release(lease_id) is False
    assert released == ["a"] and len(leases) == 0


def test_expiry_with_a_moved_clock():
    clock, released = ManualClock(100.0), []
    leases = LeaseTable(ttl_s=5.0, clock=clock)
    leases.grant(lambda: released.append("old"), lease_id="old")
    clock.now += 3
    leases.grant(lambda: released.append("new"), lease_id="new")
    assert leases.expire() == []
    clock.now += 2
    assert leases.expire() == ["old"]
    assert released == ["old"] and len(leases) == 1
    assert leases.release("old") is False  # expired already: nothing runs twice
    clock.now += 10
    assert leases.expire() == ["new"] and released == ["old", "new"]


def test_duplicate_lease_id_is_a_bug():
    leases = LeaseTable()
    leases.grant(lambda: None, lease_id="x")
    with pytest.raises(ValueError, match="already"):
        leases.grant(lambda: None, lease_id="x")


def test_generated_ids_are_unique():
    leases = LeaseTable()
    assert len({leases.grant(lambda: None) for _ in range(100)}) == 100


def test_until_empty_waits_for_the_last_lease_to_end():
    clock = ManualClock()
    leases = LeaseTable(ttl_s=5.0, clock=clock)
    leases.grant(lambda: None, "a")
    leases.grant(lambda: None, "b")

    async def main() -> None:
        waiting = asyncio.ensure_future(leases.until_empty(poll_s=0.001))
        await asyncio.sleep(0.02)
        assert not waiting.done()
        leases.release("a")
        await asyncio.sleep(0.02)
        assert not waiting.done()  # b is still lent
        clock.now += 5
        assert leases.expire() == ["b"]
        await asyncio.wait_for(waiting, 5)

    asyncio.run(main())
