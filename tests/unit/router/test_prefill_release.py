"""A Prefill call the router gives up on after sending it may have lent KV (its reply sent, never
taken): the router releases it at that instance by the request's id, which names the lease."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest

from services.common.errors import EPDError
from services.common.grpc_errors import ERROR_CLASS_KEY
from services.common.sampling_params import SamplingParams
from services.pb import prefill_pb2
from services.router.cluster.backend import GenerateRequest
from services.router.cluster.pipeline import ClusterBackend
from services.router.policies import make_policy

P1, P2, D = "10.0.0.1:5000", "10.0.0.2:5000", "10.0.0.3:5000"
REQUEST = GenerateRequest("cmpl-1", (1, 2, 3), SamplingParams(max_tokens=1))


class FakePrefill:
    """Answers (or fails, or hangs on) Prefill calls in turn; records every call in ``calls``."""

    def __init__(self, name: str, *outcomes, calls: list | None = None) -> None:
        self.name, self.outcomes, self.calls = name, list(outcomes), [] if calls is None else calls
        self.called = asyncio.Event()

    async def Prefill(self, message, **kwargs):
        self.calls.append((self.name, "Prefill", message.spec.request_id))
        self.called.set()
        outcome = self.outcomes.pop(0)
        if outcome == "hang":
            await asyncio.Event().wait()
        if isinstance(outcome, BaseException):
            raise outcome
        return prefill_pb2.PrefillResponse(first_token_id=7, finish_reason="length")

    async def Release(self, message, **kwargs):
        self.calls.append((self.name, "Release", message.lease_id))
        return prefill_pb2.ReleaseResponse()


def failed(code: grpc.StatusCode, error_class: str | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((ERROR_CLASS_KEY, error_class)) if error_class else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, "details")


async def served(*fakes: FakePrefill) -> list:
    backend = ClusterBackend((P1, P2)[:len(fakes)], (D,), policies={"prefill": make_policy("round_robin")})
    for instance, fake in zip(backend.prefills.instances, fakes):
        instance.stub = fake
    try:
        return [chunk.token_ids async for chunk in backend.generate(REQUEST)]
    finally:
        await backend.close()


def test_a_prefill_call_cancelled_when_the_client_leaves_is_released_by_its_request_id():
    async def main():
        fake = FakePrefill("p1", "hang")
        task = asyncio.ensure_future(served(fake))
        await asyncio.wait_for(fake.called.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert fake.calls == [("p1", "Prefill", "cmpl-1"), ("p1", "Release", "cmpl-1")]

    asyncio.run(main())


def test_a_prefill_call_whose_reply_was_lost_is_released_before_it_is_tried_again():
    async def main():
        calls: list = []
        lost = FakePrefill("p1", failed(grpc.StatusCode.UNAVAILABLE), calls=calls)
        assert await served(lost, FakePrefill("p2", "reply", calls=calls)) == [(7,)]
        assert calls == [("p1", "Prefill", "cmpl-1"), ("p1", "Release", "cmpl-1"), ("p2", "Prefill", "cmpl-1")]

    asyncio.run(main())


def test_an_error_the_prefill_instance_raised_itself_lent_nothing_to_release():
    async def main():
        fake = FakePrefill("p1", failed(grpc.StatusCode.INVALID_ARGUMENT, "InvalidRequestError"))
        with pytest.raises(EPDError):
            await served(fake)
        assert fake.calls == [("p1", "Prefill", "cmpl-1")]

    asyncio.run(main())
