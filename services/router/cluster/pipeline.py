"""The router's real backend: a request's trip through the cluster over gRPC.

::

    GenerateRequest --> (images: encoder, or skipped on a prefix hit; cluster/encoding.py)
                    --> prefill (reads lent image rows; then their leases are released)
                    --> prefill: first token + KV handle
                    --> decode: pulls the KV one-sided, streams tokens --> GenerateChunks
                          | the stream breaks (instance dead, unavailable, reset) or goes silent
                          | (no chunk, not even a heartbeat, for decode_idle_timeout_s)
                          v
                        another decode instance, sent the prompt and every token so far: it
                        resumes from the KV store (all but the last blocks) and computes the
                        rest; the client's stream goes on, no token lost or repeated
                        (at most max_migrations times)

Closing the chunk iterator (the client left) cancels whichever call is in flight; a KV handle
that no decode instance took yet is released at its prefill instance right away, as is the KV
of a Prefill call given up on after it was sent (its reply may have been on its way).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import grpc.aio
from tokenizers import Tokenizer as BackendTokenizer

from kvstore.hashing import root_hash
from services.common import metrics
from services.common.errors import DrainingError, EmbeddingsMissingError, EPDError, UnavailableError
from services.common.grpc_errors import error_from_rpc
from services.common.retry import is_retryable, retry
from services.common.tokenizer import Tokenizer
from services.common.wire import (DecodeRequest, ImageInput, ModelInfo, PrefillResponse, RequestSpec, TokenChunk,
                                  decode_request_to_proto, model_info_from_proto, prefill_response_from_proto,
                                  spec_to_proto, token_chunk_from_proto)
from services.pb import common_pb2, decode_pb2_grpc, encoder_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.router.cluster.backend import GenerateChunk, GenerateRequest
from services.router.cluster.encoding import (ENCODER_SKIPS, EmbeddingLeases, ImageMemo, encode, image_block_hashes,
                                              last_image_block, widen)
from services.router.cluster.handover import HandOver, released_if_abandoned, stream_error
from services.router.cluster.instances import Instance, InstancePool
from services.router.cluster.membership import Change, Discovery, MembershipTable, StaticDiscovery
from services.router.policies import Policy, RequestView, make_policy

logger = logging.getLogger(__name__)


MIGRATIONS = metrics.counter(
    "epd_router_migrations", "Decode streams moved mid-request to another decode instance, by why (broken: the "
    "stream failed; silent: nothing, not even a heartbeat, within the idle deadline; draining: the instance "
    "refused it, told to stop) and outcome (moved: sent on with every token so far; gave_up: the migration "
    "limit was reached or no instance was left, and the request failed).", ["reason", "outcome"])


_WAIT_FOR_DECODE_S = 0.1


class StreamSilent(UnavailableError):
    """A decode stream sent nothing, not even a heartbeat, within the idle deadline."""


class ClusterBackend:
    def __init__(self, prefill: tuple[str, ...], decode: tuple[str, ...], encoder: tuple[str, ...] = (),
                 policies: dict[str, Policy] | None = None, health_timeout_s: float = 3.0,
                 decode_idle_timeout_s: float = 5.0, max_migrations: int = 3, leave_timeout_s: float = 30.0,
                 stage_timeout_s: float = 600.0) -> None:
        """``policies``: role -> policy (default: round robin for every role). ``prefill``,
        ``decode``, ``encoder``: the static members (more join through :meth:`discover` and
        :meth:`apply`). ``leave_timeout_s``: how long a leaving instance's requests get.
        ``stage_timeout_s``: the deadline of one Prefill or Encode RPC (a frozen instance must not
        hold a request forever)."""
        policies = policies or {}
        self.decode_idle_timeout_s = decode_idle_timeout_s
        self.max_migrations = max_migrations
        self.leave_timeout_s = leave_timeout_s
        self.stage_timeout_s = stage_timeout_s

        def pool(role: str, stub_class) -> InstancePool:
            return InstancePool(role, (), stub_class, policies.get(role) or make_policy("round_robin"),
                                health_timeout_s=health_timeout_s)

        self.prefills = pool("prefill", prefill_pb2_grpc.PrefillStub)
        self.decodes = pool("decode", decode_pb2_grpc.DecodeStub)
        self.encoders = pool("encoder", encoder_pb2_grpc.EncoderStub)
        self.membership = MembershipTable()
        self._discovering: list[asyncio.Task] = []
        self.apply(self.membership.update("static", StaticDiscovery.of(prefill, decode, encoder).members))
        self.info: ModelInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.memo = ImageMemo()
        """What the router learnt of images (see cluster/encoding.py)."""

    @property
    def pools(self) -> tuple[InstancePool, ...]:
        return (self.prefills, self.decodes, self.encoders)

    def pool_of(self, role: str) -> InstancePool:
        return {"prefill": self.prefills, "decode": self.decodes, "encoder": self.encoders}[role]

    # ----- membership ----------------------------------------------------------------------
    def apply(self, changes: list[Change]) -> list[asyncio.Task]:
        """Membership changes into the pools; the tasks of the instances leaving (each ends
        once its instance is out)."""
        leaving = []
        for change in changes:
            member, pool = change.member, self.pool_of(change.member.role)
            if change.kind == "join":
                pool.add(member.address, change.source, member.instance_id, member.is_ready)
            elif change.kind == "leave":
                leaving.append(pool.retire(pool.find(member.address), self.leave_timeout_s))
            else:
                pool.set_ready(pool.find(member.address), change.kind == "ready")
        return leaving

    def discover(self, discovery: Discovery) -> None:
        """Follow ``discovery``'s members from now on (until :meth:`close`)."""
        def publish(members) -> None:
            self.apply(self.membership.update(discovery.source, members))
        self._discovering.append(asyncio.get_running_loop().create_task(discovery.run(publish)))

    async def connect(self, timeout_s: float = 60.0) -> None:
        """Learn the model (name, limits, tokenizer) from whichever engine instance answers first
        (waiting for one to come up: they may still be loading the model, one may be down while
        this router restarts, or discovery has not found any yet), then follow every instance's
        load. TimeoutError, or the last instance's RPC error, when none answered in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        asking: dict[str, asyncio.Future] = {}
        try:
            while True:
                for i in (*self.prefills.instances, *self.decodes.instances):
                    if i.address not in asking:
                        asking[i.address] = asyncio.ensure_future(i.stub.GetModelInfo(
                            common_pb2.ModelInfoRequest(), timeout=max(0.1, deadline - loop.time()),
                            wait_for_ready=True))
                answered = [t for t in asking.values() if t.done() and t.exception() is None]
                if answered:
                    msg = answered[0].result()
                    break
                failed = [t for t in asking.values() if t.done()]
                if loop.time() >= deadline:
                    if failed:
                        raise failed[-1].exception()
                    raise TimeoutError(f"no prefill or decode instance described the model within {timeout_s:g} s")
                pending = [t for t in asking.values() if not t.done()]
                await asyncio.wait(pending, timeout=0.2) if pending else await asyncio.sleep(0.2)
        finally:
            for task in asking.values():
                task.cancel()
            await asyncio.gather(*asking.values(), return_exceptions=True)
        self.info = info = model_info_from_proto(msg)
        if info.tokenizer_json:
            self.tokenizer = Tokenizer(BackendTokenizer.from_str(info.tokenizer_json),
                                       json.loads(info.tokenizer_config_json), info.eos_token_ids)
        for pool in self.pools:
            pool.block_size = info.block_size
            pool.start_watching()

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def image_token_id(self) -> int | None:
        return self.info.image_token_id if self.encoders else None

    async def is_healthy(self) -> bool:
        """Ready to serve: at least one prefill and one decode instance take requests now (by
        their load reports). One instance down is not an outage; the encoders only serve
        images, so text keeps being served without them."""
        return all(pool.num_serving() > 0 for pool in (self.prefills, self.decodes))

    async def close(self) -> None:
        for task in self._discovering:
            task.cancel()
        await asyncio.gather(*self._discovering, return_exceptions=True)
        for pool in self.pools:
            await pool.close()

    # ----- a request -----------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        leases, handover, decoding = EmbeddingLeases(), None, None
        try:
            spec, view, prefill, first = await self._encode_and_prefill(request, leases)
            # Held before anything else is awaited: a client gone from here on must not strand it.
            handover = HandOver(prefill, first.kv)
            await leases.release()  # the Prefill call ended: it read the lent rows
            num_prompt = len(spec.prompt_token_ids)
            # Decode gets the prompt's KV, not its images' rows (see serving/embeddings.py).
            spec = dataclasses.replace(spec, images=tuple(i.without_embeddings() for i in spec.images))
            first_logprobs = (first.first_token_logprobs,) if first.first_token_logprobs is not None else ()
            decoding = None if first.finish_reason is not None else self._decode(spec, view, handover, first, request)
            yield GenerateChunk((first.first_token_id,), first.finish_reason, first.stop_reason,
                                num_prompt, first.num_cached_tokens, first_logprobs)
            if decoding is None:
                return
            async for chunk in decoding:
                yield GenerateChunk(chunk.token_ids, chunk.finish_reason, chunk.stop_reason, num_prompt,
                                    chunk.num_cached_tokens, chunk.logprobs)
        finally:
            if decoding is not None:
                await decoding.aclose()
            # A KV handle no decode instance took (also when the client left before decoding
            # started: closing a generator that never ran runs none of its code).
            if handover is not None:
                await handover.release()
            await leases.release()  # the client left before the Prefill call ended

    async def _decode(self, spec: RequestSpec, view: RequestView, handover: HandOver, first: PrefillResponse,
                      request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """The tokens after the first, from decode instances: when one's stream breaks or goes
        silent, the request moves to another with every token so far (up to ``max_migrations``
        times), so the chunks read as one stream."""
        output = [first.first_token_id]
        failed: list[str] = []
        reason = ""
        while True:
            instance = await self._pick_decode(view, failed, reason)
            rows = EmbeddingLeases()
            resumed = await self._with_rows(request, spec, rows) if failed and spec.images else spec
            message = DecodeRequest(resumed, tuple(output), handover.kv, first.num_cached_tokens,
                                    handover.instance.address, num_migrations=len(failed))
            try:
                with self.decodes.using(instance):
                    async with contextlib.aclosing(self._read_decode(instance, message)) as chunks:
                        async for chunk in chunks:
                            # The instance has the request: it read the KV (or recomputes) and
                            # releases the lease itself.
                            handover.taken()
                            await rows.release()  # (read before its first token; a no-op once done)
                            self.decodes.succeeded(instance)
                            output += chunk.token_ids
                            yield chunk
                            if chunk.finish_reason:
                                return
                raise UnavailableError(f"decode instance {instance.address} ended the stream "
                                       "without a finish_reason")
            except UnavailableError as exc:
                if not isinstance(exc, EmbeddingsMissingError):  # that one only lacked the rows
                    self.decodes.failed(instance, exc)
                failed.append(instance.address)
                reason = "silent" if isinstance(exc, StreamSilent) else "draining" if isinstance(exc, DrainingError) else "broken"
                await handover.release()  # never reused: the failed instance may have released it
                if len(failed) > self.max_migrations:
                    MIGRATIONS.labels(reason, "gave_up").inc()
                    raise UnavailableError(f"the request's decode failed {len(failed)} times, the "
                                           f"last on {instance.address}: {exc}") from exc
                MIGRATIONS.labels(reason, "moved").inc()
                logger.log(logging.INFO if reason == "draining" else logging.WARNING, "decode stream of %s on %s %s (%s) "
                           "after %d tokens: moving it", spec.request_id, instance.address, reason, exc, len(output))
            finally:
                await rows.release()

    async def _with_rows(self, request: GenerateRequest, spec: RequestSpec, leases: EmbeddingLeases) -> RequestSpec:
        """A moved request's spec with its images' rows (lent again; likely an encoder-cache hit):
        its new decode instance computes whatever the KV store lacks, image positions included.
        Without an encoder to answer, the spec as it was (the store may hold it all)."""
        try:
            encoded, _ = await encode(self.encoders, request, leases, self.memo, self.stage_timeout_s)
        except EPDError as exc:
            logger.warning("%s moves on without its images' rows: %s", spec.request_id, exc)
            return spec
        with_rows = widen(request, [ImageInput(e.image_hash, 0, e.embeddings, e.remote) for e in encoded])
        return dataclasses.replace(spec, images=with_rows.images)

    async def _pick_decode(self, view: RequestView, failed: list[str], reason: str):
        """A decode instance for the request; one it ``failed`` on only when no other is left.
        A request being moved waits up to the idle deadline for one to come back (a lone
        instance being restarted) before it fails."""
        deadline = asyncio.get_running_loop().time() + (self.decode_idle_timeout_s if failed else 0.0)
        while True:
            try:
                return self.decodes.pick(view, arrival=not failed, avoid=failed)
            except UnavailableError:
                if asyncio.get_running_loop().time() >= deadline:
                    if failed:
                        MIGRATIONS.labels(reason, "gave_up").inc()
                    raise
            await asyncio.sleep(_WAIT_FOR_DECODE_S)

    async def _read_decode(self, instance, request: DecodeRequest) -> AsyncIterator[TokenChunk]:
        """One decode instance's token chunks (heartbeats dropped). A broken stream is an
        UnavailableError; so is silence past the idle deadline (:class:`StreamSilent`); any
        other failure is the request's own and passes as its EPDError."""
        call = instance.stub.Generate(decode_request_to_proto(request))
        try:
            while True:
                try:
                    async with asyncio.timeout(self.decode_idle_timeout_s):  # no task per chunk, as wait_for makes
                        chunk = await call.read()
                except TimeoutError:
                    raise StreamSilent(f"nothing for {self.decode_idle_timeout_s:g} s") from None
                except grpc.aio.AioRpcError as exc:
                    raise stream_error(exc) from exc
                if chunk is grpc.aio.EOF:
                    return
                if chunk.token_ids or chunk.finish_reason:
                    yield token_chunk_from_proto(chunk)
        finally:
            call.cancel()

    async def _encode_and_prefill(self, request: GenerateRequest, leases: EmbeddingLeases):
        """(spec, view, prefill instance, its reply): the images encoded, or the encoder skipped
        when their KV is a prefix hit; prefill lacking rows it needs (the hit evicted, a dead
        encoder's rows) gets the request again with the images encoded (elsewhere)."""
        if request.images and (spec := self._skip_encoder(request)) is not None:
            view = self._view(spec)
            try:
                return (spec, view, *await self._prefill(spec, view))
            except EmbeddingsMissingError as exc:
                ENCODER_SKIPS.labels("evicted").inc()
                logger.info("%s: the images' KV was not where the router thought (%s): encoding them", spec.request_id, exc)
        avoid: list[str] = []
        while True:
            spec, encoder = await self._spec(request, leases, avoid)
            view = self._view(spec)
            try:
                prefill, first = await self._prefill(spec, view)
            except EmbeddingsMissingError:
                if avoid or not encoder:
                    raise
                avoid.append(encoder)  # its lent rows were unreadable: it may be gone
                await leases.release()
                continue
            if spec.images and (index := last_image_block(spec, self.info.block_size)) is not None:
                self.memo.prefilled(self._block_hashes(spec)[index])
            return spec, view, prefill, first

    def _skip_encoder(self, request: GenerateRequest) -> RequestSpec | None:
        """The spec without rows when every image is known and the blocks through the last one
        were prefilled before (their KV is in a prefix cache or the store); else None."""
        known = self.memo.known(request.images)
        if known is None:
            return None
        spec = widen(request, [ImageInput(k.image_hash, 0, num_rows=k.num_rows) for k in known])
        index = last_image_block(spec, self.info.block_size)
        if index is None or not self.memo.was_prefilled(self._block_hashes(spec)[index]):
            return None
        ENCODER_SKIPS.labels("skipped").inc()
        return spec

    def _view(self, spec: RequestSpec) -> RequestView:
        return RequestView(spec.request_id, len(spec.prompt_token_ids), spec.params.max_tokens,
                           self._block_hashes(spec) if self.prefills.policy.needs_block_hashes else ())

    async def _prefill(self, spec: RequestSpec, view: RequestView) -> tuple[Instance, PrefillResponse]:
        """(instance, its reply); another instance is tried when one is unavailable. The
        request may first wait in the router's queue (a queueing prefill policy)."""
        message = prefill_pb2.PrefillRequest(spec=spec_to_proto(spec))
        arrivals = iter((True,))

        async def attempt():
            placement = await self.prefills.place(view, arrival=next(arrivals, False))
            instance = placement.instance
            try:
                with self.prefills.using(instance):
                    async with released_if_abandoned(instance, spec.request_id):
                        reply = await instance.stub.Prefill(message, timeout=self.stage_timeout_s)
            except grpc.aio.AioRpcError as exc:
                error = error_from_rpc(exc)
                is_instance_fault = error.retryable and not isinstance(error, EmbeddingsMissingError)
                if is_instance_fault or exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    self.prefills.failed(instance, error)
                raise error from exc
            finally:
                self.prefills.release(placement)
            self.prefills.succeeded(instance)
            return instance, prefill_response_from_proto(reply)

        return await retry(attempt, retry_on=lambda e: is_retryable(e) and not isinstance(e, EmbeddingsMissingError),
                           attempts=max(2, len(self.prefills)))

    async def _spec(self, request: GenerateRequest, leases: EmbeddingLeases,
                    avoid: list[str]) -> tuple[RequestSpec, str]:
        """The wire spec with every image encoded (each placeholder widened to its rows), and
        the encoder's address ("" without images)."""
        keys = dict(cache_salt=request.cache_salt, request_class=request.request_class)
        if not request.images:
            return RequestSpec(request.request_id, request.prompt_token_ids, request.params, **keys), ""
        encoded, address = await encode(self.encoders, request, leases, self.memo, self.stage_timeout_s, avoid)
        return widen(request, [ImageInput(e.image_hash, 0, e.embeddings, e.remote) for e in encoded]), address

    def _block_hashes(self, spec: RequestSpec) -> tuple[bytes, ...]:
        """The prompt's block hashes for cache-aware routing and the image memo (the router's own
        root: they only need to agree with each other), images' hashes among their keys."""
        root = root_hash(model=self.info.model_name, block_size=self.info.block_size, dtype="router",
                         salt=spec.cache_salt)
        return tuple(image_block_hashes(spec, self.info.block_size, root))
