"""The Prefill gRPC service: a thin shell over :class:`PrefillWorker` (wire <-> worker)."""

from __future__ import annotations

from services.common.server import EngineRpcs
from services.common.wire import kv_handle_to_proto, logprobs_to_proto, spec_from_proto, stop_reason_to_proto
from services.pb import prefill_pb2, prefill_pb2_grpc
from services.prefill.worker import PrefillWorker


class PrefillServicer(EngineRpcs, prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Prefill(self, request, context):
        result = await self.worker.prefill(spec_from_proto(request.spec))
        reply = prefill_pb2.PrefillResponse(
            first_token_id=result.first_token_id, finish_reason=result.finish_reason or "",
            stop_reason=stop_reason_to_proto(result.stop_reason), num_cached_tokens=result.num_cached_tokens)
        if result.kv is not None:
            reply.kv.CopyFrom(kv_handle_to_proto(result.kv))
        if result.first_token_logprobs is not None:
            reply.first_token_logprobs.CopyFrom(logprobs_to_proto(result.first_token_logprobs))
        return reply

    async def Release(self, request, context):
        return prefill_pb2.ReleaseResponse(released=self.worker.release(request.lease_id))


def add_to_server(server, worker: PrefillWorker) -> None:
    prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker), server)



