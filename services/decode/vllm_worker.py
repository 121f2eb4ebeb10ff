"""Life cycle of a request in a decode instance whose engine is vLLM.

::

    Generate RPC --> with a KV handle: staging slots --> one-sided read of the prompt's full
                     blocks from the prefill's slots --> the prefill's lease released
                     (a failed read, or no free slot: the prompt is recomputed here)
        --> vLLM, with kv_transfer_params {"epd_load": slots}: its first step copies them into
            its blocks (connector.py), then computes the rest; the slots go back at its first output
        --> a hand-over from prefill (one token so far): vLLM runs the request as it came, so it
            re-derives the first token from the prompt (a seeded request's generator makes the
            same first draw as prefill's), and that token is not sent again. Where it differs
            from the one prefill sent (arithmetic that moved a near tie), the request restarts
            here with that token as part of the prompt, so the stream the client reads stays
            one sequence (epd_vllm_first_token_mismatches_total counts it)
        --> a request resumed after another decode failed (or after such a restart): the tokens
            so far join the prompt, vLLM generates the rest (max_tokens and min_tokens less
            what was generated; a seeded stream's generator starts again there)
        --> stream token chunks until finished; a cancelled RPC aborts the request

The lease release and drain rules are the epd engine's (services/decode/worker.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from services.common import metrics
from services.common.errors import DrainingError, InvalidRequestError
from services.common.wire import DecodeRequest, TokenChunk
from services.decode.worker import TRANSFER_BYTES, TRANSFER_SECONDS, TRANSFERS, DecodeWorker
from services.engine.serving.seam import read_kv
from services.engine.serving.staging import HANDOVER_PATH, STAGING_FULL, SlotLease
from services.vllm_engine.connector import LOAD_KEY
from services.vllm_engine.instance import VllmInstance
from services.vllm_engine.sampling import to_vllm, token_logprobs

logger = logging.getLogger(__name__)
FIRST_TOKEN_MISMATCHES = metrics.counter(
    "epd_vllm_first_token_mismatches", "Hand-overs whose first token vLLM re-derived on decode differently "
    "from the one prefill sent (the request went on from prefill's).")


class VllmDecodeWorker(DecodeWorker):
    instance: VllmInstance

    @classmethod
    def create(cls, config, release_lease) -> VllmDecodeWorker:
        return cls(VllmInstance(config, "decode"), release_lease, config.kv_load_failure_policy)

    async def generate(self, req: DecodeRequest) -> AsyncIterator[TokenChunk]:
        if self.is_draining:
            raise DrainingError("this decode instance is draining")
        if req.spec.images:
            raise InvalidRequestError("images: the vllm engine does not take epd's image embeddings yet")
        slots = await self._pull(req) if req.kv is not None else None
        kv_recomputed = req.kv is not None and slots is None
        outputs = list(req.output_token_ids)
        # A hand-over from prefill is re-derived from the prompt (see the module docstring).
        rederive = len(outputs) == 1 and not req.num_migrations
        request_id = req.spec.request_id
        try:
            while True:
                stream = self._run(req, request_id, outputs, rederive, slots)
                try:
                    first = True
                    async for token_ids, chunk in stream:
                        if first and rederive:
                            if token_ids[:1] != outputs:
                                FIRST_TOKEN_MISMATCHES.inc()
                                logger.warning("%s: vLLM re-derived first token %s, prefill sent %s: going on "
                                               "from prefill's", request_id, token_ids[:1], outputs)
                                break
                            chunk = TokenChunk(chunk.token_ids[1:], chunk.finish_reason, chunk.stop_reason,
                                               0, False, chunk.logprobs[1:])
                        if first and slots is not None:
                            self.instance.staging.slots.free(slots)  # loaded by the first step
                        first = False
                        yield TokenChunk(chunk.token_ids, chunk.finish_reason, chunk.stop_reason,
                                         req.num_cached_tokens, kv_recomputed, chunk.logprobs)
                    else:
                        return
                finally:
                    await stream.aclose()  # aborts the request in vLLM if it runs on
                # Once more from prefill's token, under another id (the first may still be aborting).
                rederive, request_id = False, f"{request_id}-again"
        finally:
            if slots is not None:
                self.instance.staging.slots.free(slots)

    async def _run(self, req: DecodeRequest, request_id: str, outputs: list[int], rederive: bool,
                   slots: SlotLease | None) -> AsyncIterator[tuple[list[int], TokenChunk]]:
        """vLLM's stream for the request: each step's new token ids and their chunk."""
        from vllm.inputs import TokensPrompt

        spec = req.spec
        prompt = list(spec.prompt_token_ids) + ([] if rederive else outputs)
        params = to_vllm(spec.params, num_generated=0 if rederive else len(outputs),
                         kv_transfer_params={LOAD_KEY: {"slots": slots.slots}} if slots is not None else None)
        self.instance.num_in_flight += 1
        try:
            async for out in self.instance.llm.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                                        request_id=request_id):
                step = out.outputs[0]
                finish = step.finish_reason if out.finished else None
                logprobs = token_logprobs(step.logprobs, step.token_ids, spec.params.logprobs or 0)
                yield list(step.token_ids), TokenChunk(tuple(step.token_ids), finish,
                                                       step.stop_reason if finish else None, 0, False, logprobs)
        finally:
            self.instance.num_in_flight -= 1

    async def _pull(self, req: DecodeRequest) -> SlotLease | None:
        """The prompt's blocks read from the prefill's slots into this instance's; None when they
        could not be (it is then recomputed). The prefill's lease is released either way."""
        handle, staging = req.kv, self.instance.staging
        slots = None
        try:
            if any(b.length != staging.block_bytes for b in handle.blocks):
                logger.warning("KV handle %s does not match this engine's block layout: recomputing", handle.lease_id)
            elif (slots := staging.slots.alloc(len(handle.blocks))) is None:
                STAGING_FULL.labels("import").inc()
            else:
                started = time.perf_counter()
                self.num_transfers_in_flight += 1
                try:
                    error = await read_kv(self.instance.transfer, handle, staging.views(slots))
                finally:
                    self.num_transfers_in_flight -= 1
                if error is not None:
                    logger.warning("KV transfer %s failed (%s): recomputing", handle.lease_id, error)
                    staging.slots.free(slots)
                    slots = None
                else:
                    TRANSFER_SECONDS.observe(time.perf_counter() - started)
                    TRANSFER_BYTES.labels(self.instance.transfer.select_transport(handle) or "none").inc(
                        handle.num_bytes)
        except BaseException:
            if slots is not None:
                staging.slots.free(slots)
            raise
        finally:
            task = asyncio.get_running_loop().create_task(self._release(req.prefill_address, handle.lease_id))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
        TRANSFERS.labels("done" if slots is not None else "failed").inc()
        HANDOVER_PATH.labels("staged" if slots is not None else "recompute").inc()
        return slots
