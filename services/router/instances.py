"""The instances the router sends work to: a gRPC channel and stub per address, picked round
robin for now (the load-aware balancers come later and plug in here)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc
import grpc.aio

from services.common.errors import UnavailableError
from services.common.server import MAX_MESSAGE_BYTES

S = TypeVar("S")
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


@dataclass
class Instance(Generic[S]):
    address: str
    channel: grpc.aio.Channel
    stub: S


class InstancePool(Generic[S]):
    def __init__(self, role: str, addresses: tuple[str, ...], stub_class: type[S]) -> None:
        self.role = role
        self.instances: list[Instance[S]] = [
            Instance(a, channel := grpc.aio.insecure_channel(a, options=_CHANNEL_OPTIONS), stub_class(channel))
            for a in addresses]
        self._order = itertools.cycle(range(len(self.instances)))

    def __len__(self) -> int:
        return len(self.instances)

    def pick(self) -> Instance[S]:
        if not self.instances:
            raise UnavailableError(f"no {self.role} instance is configured")
        return self.instances[next(self._order)]

    async def close(self) -> None:
        for instance in self.instances:
            await instance.channel.close()

