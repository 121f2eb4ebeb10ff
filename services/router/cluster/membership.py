"""Which instances the router's pools hold, fed in and out while it runs (pure core).

Every source of instances publishes the **whole set** it sees now, each time it changes; the
table diffs that against what the source published before and says what changed::

    static flags  ──┐                                             join   -> pool.add (no work before
    kubernetes    ──┼─ update(source, members) ─> [Change, ...] ─> leave  -> pool.retire (drains, then
    admin API     ──┘   (whole set per source)                     ready     removed once idle)
    (epd up posts                                                  unready -> no new work, in-flight
     source=launcher)                                                         requests finish

A source re-publishing the same set (a periodic resync) changes nothing. An address belongs to
the first source that published it; another source naming it too is ignored for as long as the
first one holds it (:meth:`MembershipTable.owner` tells the admin API which). The adapters
(``StaticDiscovery`` here; ``kubernetes.py``) only watch and publish; what a change does to the
pools is the backend's (``pipeline.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

ROLES = ("prefill", "decode", "encoder")
"""The roles the router sends work to (store nodes are the engines' business)."""


@dataclass(frozen=True)
class Member:
    role: str
    """"prefill", "decode" or "encoder"."""
    address: str
    """host:port of its gRPC server."""
    instance_id: str = ""
    """What its source calls it (a pod name); empty: learnt from its load reports."""
    is_ready: bool = True
    """Its source's readiness (Kubernetes' endpoint condition); not ready: no new requests."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r} (one of {', '.join(ROLES)})")
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"address {self.address!r} is not host:port")


@dataclass(frozen=True)
class Change:
    kind: Literal["join", "leave", "ready", "unready"]
    member: Member
    source: str


class MembershipTable:
    def __init__(self) -> None:
        self._published: dict[str, dict[str, Member]] = {}
        """Source -> address -> member, as the source last published."""
        self._owner: dict[str, str] = {}
        """Address -> the source whose member is in the pools."""

    def update(self, source: str, members: Iterable[Member]) -> list[Change]:
        """``source`` sees exactly ``members`` now: what joins, leaves or changes readiness."""
        new = {m.address: m for m in members}
        old = self._published.get(source, {})
        self._published[source] = new
        changes: list[Change] = []
        for address, member in old.items():
            if address not in new and self._owner.get(address) == source:
                del self._owner[address]
                changes.append(Change("leave", member, source))
                changes += self._adopt(address)
        for address, member in new.items():
            owner = self._owner.setdefault(address, source)
            if owner != source:
                continue
            before = old.get(address)
            if before is None:
                changes.append(Change("join", member, source))
            elif before.role != member.role:   # a new pod on a recycled address
                changes += [Change("leave", before, source), Change("join", member, source)]
            elif before.is_ready != member.is_ready:
                changes.append(Change("ready" if member.is_ready else "unready", member, source))
        return changes

    def _adopt(self, address: str) -> list[Change]:
        """``address`` was given up: the next source that publishes it takes it over."""
        for source, members in self._published.items():
            if address in members:
                self._owner[address] = source
                return [Change("join", members[address], source)]
        return []

    def add(self, source: str, member: Member) -> list[Change]:
        """One more member of ``source`` (the admin API's POST)."""
        return self.update(source, [*self._published.get(source, {}).values(), member])

    def remove(self, source: str, address: str) -> list[Change]:
        """One member fewer for ``source`` (the admin API's DELETE)."""
        return self.update(source, [m for a, m in self._published.get(source, {}).items() if a != address])

    def owner(self, address: str) -> str | None:
        """The source whose member at ``address`` is in the pools; None: none is."""
        return self._owner.get(address)

    def members(self, source: str) -> Collection[Member]:
        return tuple(self._published.get(source, {}).values())


Publish = Callable[[Collection[Member]], None]
"""What an adapter calls with the whole set of members it sees, each time that changes."""


class Discovery(Protocol):
    """A source of instances: watches something and publishes what it sees until cancelled."""

    source: str

    async def run(self, publish: Publish) -> None:
        ...


@dataclass(frozen=True)
class StaticDiscovery:
    """The instances named on the command line (--prefill, --decode, --encoder), once."""

    members: tuple[Member, ...]
    source: str = "static"

    @classmethod
    def of(cls, prefill: Iterable[str], decode: Iterable[str], encoder: Iterable[str] = ()) -> StaticDiscovery:
        return cls(tuple(Member(role, address) for role, addresses in
                         (("prefill", prefill), ("decode", decode), ("encoder", encoder)) for address in addresses))

    async def run(self, publish: Publish) -> None:
        publish(self.members)
