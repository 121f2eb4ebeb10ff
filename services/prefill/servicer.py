"""The Prefill gRPC service: a thin shell over :class:`PrefillWorker` (wire <-> worker)."""

from __future__ import annotations

from services.common.instance_rpcs import EngineRpcs
from services.common.wire import prefill_response_to_proto, spec_from_proto
from services.pb import prefill_pb2, prefill_pb2_grpc
from services.prefill.worker import PrefillWorker


class PrefillServicer(EngineRpcs, prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Prefill(self, request, context):
        # No check of context.cancelled() here: it only reports a status this server set, never
        # a caller that left. A caller gone while the worker runs cancels it (it keeps nothing);
        # one gone once the reply is on its way cannot be seen here, so the router releases the
        # request's lease itself (see worker.py).
        return prefill_response_to_proto(await self.worker.prefill(spec_from_proto(request.spec)))

    async def Release(self, request, context):
        return prefill_pb2.ReleaseResponse(released=self.worker.release(request.lease_id))


def add_to_server(server, worker: PrefillWorker) -> None:
    prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker), server)



