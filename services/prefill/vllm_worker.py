"""Life cycle of a request in a prefill instance whose engine is vLLM.

::

    Prefill RPC --> staging slots for the prompt's full blocks (none free: no KV is lent)
        --> vLLM: the prompt, the request's sampling with max_tokens 1, kv_transfer_params
            {"epd_save": slots}: the step that completes the prompt copies its full blocks into
            the slots (connector.py) before the first token comes back
        --> finished by it (EOS, a stop, max_tokens 1)? reply, slots freed
        --> else: lease(slots) named by the request id --> reply (first token + KVHandle)
    Release RPC (decode read them, or the router gave up) or lease expiry --> slots freed

The prompt's last, partial block is not lent: decode computes it (vLLM loads whole blocks). The
lease, release and drain rules are the epd engine's (services/prefill/worker.py), which this
worker shares.
"""

from __future__ import annotations

from services.common.errors import InvalidRequestError
from services.common.wire import PrefillResponse, RequestSpec
from services.engine.serving.staging import HANDOVER_PATH, STAGING_FULL
from services.prefill.worker import PrefillWorker
from services.vllm_engine.connector import SAVE_KEY
from services.vllm_engine.instance import VllmInstance
from services.vllm_engine.sampling import to_vllm, token_logprobs


class VllmPrefillWorker(PrefillWorker):
    instance: VllmInstance

    @classmethod
    def create(cls, config) -> VllmPrefillWorker:
        return cls(VllmInstance(config, "prefill"), lease_ttl_s=config.lease_ttl_s)

    async def _prefill(self, spec: RequestSpec) -> PrefillResponse:
        from vllm.inputs import TokensPrompt

        if spec.images:
            raise InvalidRequestError("images: the vllm engine does not take epd's image embeddings yet")
        instance, staging = self.instance, self.instance.staging
        prompt = list(spec.prompt_token_ids)
        num_blocks = len(prompt) // instance.block_size
        slots = staging.slots.alloc(num_blocks) if num_blocks else None
        if num_blocks and slots is None:
            STAGING_FULL.labels("export").inc()
        params = to_vllm(spec.params, max_tokens=1,
                         kv_transfer_params={SAVE_KEY: {"slots": slots.slots}} if slots else None)
        instance.num_in_flight += 1
        try:
            last = None
            async for out in instance.llm.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                                   request_id=spec.request_id):
                last = out
        except BaseException:
            if slots is not None:
                staging.slots.free(slots)
            raise
        finally:
            instance.num_in_flight -= 1
        done = last.outputs[0]
        first = done.token_ids[0]
        logprobs = token_logprobs(done.logprobs, done.token_ids, spec.params.logprobs or 0) or (None,)
        # vLLM stops at the max_tokens of 1 it was given: the request goes on unless that was its own.
        finish = done.finish_reason if done.finish_reason == "stop" or spec.params.max_tokens == 1 else None
        num_cached = last.num_cached_tokens or 0
        if finish is not None or slots is None or self._is_released_early.get(spec.request_id):
            if slots is not None:
                staging.slots.free(slots)
            if finish is None:
                HANDOVER_PATH.labels("recompute").inc()
            return PrefillResponse(first, finish, done.stop_reason if finish else None, num_cached, None,
                                   logprobs[0])
        handle = instance.transfer.export(staging.region_id, staging.ranges(slots), spec.request_id)
        HANDOVER_PATH.labels("staged").inc()
        self.leases.release(spec.request_id)
        self.leases.grant(lambda: staging.slots.free(slots), spec.request_id)
        return PrefillResponse(first, None, None, num_cached, handle, logprobs[0])
