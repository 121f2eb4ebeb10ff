"""The router's real backend: a request's trip through the cluster over gRPC.

::

    GenerateRequest --> (images: encoder) --> prefill: first token + KV handle
                    --> decode: pulls the KV one-sided, streams tokens --> GenerateChunks
                          | the stream breaks (instance dead, unavailable, reset) or goes silent
                          | (no chunk, not even a heartbeat, for decode_idle_timeout_s)
                          v
                        another decode instance, sent the prompt and every token so far: it
                        resumes from the KV store (all but the last blocks) and computes the
                        rest; the client's stream goes on, no token lost or repeated
                        (at most max_migrations times)

Closing the chunk iterator (the client left) cancels whichever call is in flight; a KV handle
that no decode instance took yet is released at its prefill instance right away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import grpc.aio
from tokenizers import Tokenizer as BackendTokenizer

from kvstore.hashing import block_hashes, root_hash
from services.common import metrics
from services.common.errors import EPDError, InvalidRequestError, UnavailableError
from services.common.grpc_errors import error_from_rpc, is_raised_by_server
from services.common.retry import is_retryable, retry
from services.common.tokenizer import Tokenizer
from services.common.wire import (DecodeRequest, ImageInput, ModelInfo, PrefillResponse, RequestSpec, TokenChunk,
                                  decode_request_to_proto, model_info_from_proto, prefill_response_from_proto,
                                  spec_to_proto, tensor_from_proto, token_chunk_from_proto)
from services.pb import common_pb2, decode_pb2_grpc, encoder_pb2, encoder_pb2_grpc
from services.pb import prefill_pb2, prefill_pb2_grpc
from services.router.cluster.backend import GenerateChunk, GenerateRequest
from services.router.cluster.instances import Instance, InstancePool
from services.router.cluster.membership import Change, Discovery, MembershipTable, StaticDiscovery
from services.router.policies import Policy, RequestView, make_policy

logger = logging.getLogger(__name__)


MIGRATIONS = metrics.counter(
    "epd_router_migrations", "Decode streams moved mid-request to another decode instance, by why (broken: "
    "the stream failed; silent: nothing, not even a heartbeat, within the idle deadline) and outcome "
    "(moved: sent on with every token so far; gave_up: the migration limit was reached or no instance "
    "was left, and the request failed).", ["reason", "outcome"])


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
        spec = await self._spec(request)
        num_prompt = len(spec.prompt_token_ids)
        view = RequestView(request.request_id, num_prompt, spec.params.max_tokens,
                           self._block_hashes(spec) if self.prefills.policy.needs_block_hashes
                           else ())
        prefill, first = await self._prefill(spec, view)
        handover = _HandOver(self, prefill, first.kv)
        first_logprobs = (first.first_token_logprobs,) if first.first_token_logprobs is not None else ()
        decoding = None if first.finish_reason is not None else self._decode(spec, view, handover, first)
        try:
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
            await handover.release()

    async def _decode(self, spec: RequestSpec, view: RequestView, handover: _HandOver,
                      first: PrefillResponse) -> AsyncGenerator[TokenChunk, None]:
        """The tokens after the first, from decode instances: when one's stream breaks or goes
        silent, the request moves to another with every token so far (up to ``max_migrations``
        times), so the chunks read as one stream."""
        output = [first.first_token_id]
        failed: list[str] = []
        reason = ""
        while True:
            instance = await self._pick_decode(view, failed, reason)
            message = DecodeRequest(spec, tuple(output), handover.kv, first.num_cached_tokens,
                                    handover.instance.address, num_migrations=len(failed))
            try:
                with self.decodes.using(instance):
                    async with contextlib.aclosing(self._read_decode(instance, message)) as chunks:
                        async for chunk in chunks:
                            # The instance has the request: it read the KV (or recomputes) and
                            # releases the lease itself.
                            handover.taken()
                            self.decodes.succeeded(instance)
                            output += chunk.token_ids
                            yield chunk
                            if chunk.finish_reason:
                                return
                raise UnavailableError(f"decode instance {instance.address} ended the stream "
                                       "without a finish_reason")
            except UnavailableError as exc:
                self.decodes.failed(instance)
                failed.append(instance.address)
                reason = "silent" if isinstance(exc, StreamSilent) else "broken"
                await handover.release()  # never reused: the failed instance may have released it
                if len(failed) > self.max_migrations:
                    MIGRATIONS.labels(reason, "gave_up").inc()
                    raise UnavailableError(f"the request's decode failed {len(failed)} times, the "
                                           f"last on {instance.address}: {exc}") from exc
                MIGRATIONS.labels(reason, "moved").inc()
                logger.warning("decode stream of %s on %s %s (%s) after %d tokens: moving it",
                               spec.request_id, instance.address, reason, exc, len(output))

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
                    raise _stream_error(exc) from exc
                if chunk is grpc.aio.EOF:
                    return
                if chunk.token_ids or chunk.finish_reason:
                    yield token_chunk_from_proto(chunk)
        finally:
            call.cancel()

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
                    reply = await instance.stub.Prefill(message, timeout=self.stage_timeout_s)
            except grpc.aio.AioRpcError as exc:
                error = error_from_rpc(exc)
                if error.retryable or exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    self.prefills.failed(instance)
                raise error from exc
            finally:
                self.prefills.release(placement)
            self.prefills.succeeded(instance)
            return instance, prefill_response_from_proto(reply)

        return await retry(attempt, retry_on=is_retryable, attempts=max(2, len(self.prefills)))

    async def _release(self, instance, lease_id: str) -> None:
        try:
            await instance.stub.Release(prefill_pb2.ReleaseRequest(lease_id=lease_id), timeout=5.0)
        except grpc.aio.AioRpcError as exc:  # the lease expires on its own
            logger.warning("could not release lease %s at %s: %s", lease_id, instance.address, exc.details())

    async def _spec(self, request: GenerateRequest) -> RequestSpec:
        """The wire spec; each image's single placeholder becomes one token per embedding row."""
        keys = dict(cache_salt=request.cache_salt, request_class=request.request_class)
        if not request.images:
            return RequestSpec(request.request_id, request.prompt_token_ids, request.params, **keys)
        embeddings = await self._encode_images(request)
        token_ids = list(request.prompt_token_ids)
        images = []
        shift = 0
        for position, (image_hash, tensor) in sorted(zip(request.image_positions, embeddings)):
            start = position + shift
            num_rows = tensor.shape[0]
            token_ids[start:start + 1] = [token_ids[start]] * num_rows
            images.append(ImageInput(image_hash, start, tensor))
            shift += num_rows - 1
        return RequestSpec(request.request_id, tuple(token_ids), request.params, tuple(images), **keys)

    def _block_hashes(self, spec: RequestSpec) -> tuple[bytes, ...]:
        """The prompt's block hashes for cache-aware routing (the router's own root: they only
        need to agree with each other)."""
        root = root_hash(model=self.info.model_name, block_size=self.info.block_size, dtype="router",
                         salt=spec.cache_salt)
        return tuple(block_hashes(list(spec.prompt_token_ids), self.info.block_size, root))

    async def _encode_images(self, request: GenerateRequest) -> list[tuple[bytes, object]]:
        """Every image's (hash, embeddings); another encoder is tried when one is unavailable."""
        if not self.encoders:
            raise InvalidRequestError("this deployment has no encoder: images are not supported")
        view = RequestView(request.request_id, len(request.prompt_token_ids), num_patches=len(request.images))
        message = encoder_pb2.EncodeRequest(images=list(request.images))
        failed: list[str] = []

        async def attempt():
            instance = self.encoders.pick(view, arrival=not failed, avoid=failed)
            try:
                with self.encoders.using(instance):
                    reply = await instance.stub.Encode(message, timeout=self.stage_timeout_s)
            except grpc.aio.AioRpcError as exc:
                error = error_from_rpc(exc)
                if error.retryable or exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    self.encoders.failed(instance)
                    failed.append(instance.address)
                raise error from exc
            self.encoders.succeeded(instance)
            return reply

        reply = await retry(attempt, retry_on=is_retryable, attempts=max(2, len(self.encoders)))
        return [(image.image_hash, tensor_from_proto(image.embeddings)) for image in reply.images]


class _HandOver:
    """The KV handle a prefill instance left for decode. Until a decode instance took it (its
    first chunk) or it is released, the prefill instance counts the request as in flight, so
    it does not leave the pool (membership) while decode may still read from it."""

    def __init__(self, backend: ClusterBackend, instance: Instance, kv) -> None:
        self.backend, self.instance, self.kv = backend, instance, kv
        if kv is not None:
            instance.num_in_flight += 1

    def taken(self) -> None:
        if self.kv is not None:
            self.kv = None
            self.instance.num_in_flight -= 1

    async def release(self) -> None:
        if self.kv is not None:
            lease_id = self.kv.lease_id
            self.taken()
            await self.backend._release(self.instance, lease_id)


def _stream_error(exc: grpc.aio.AioRpcError) -> EPDError:
    """What a failed decode stream means for its request. A status the instance chose (an
    EPDError it raised: its class rides in the trailing metadata) is the request's own; a
    transport failure (UNAVAILABLE, or the UNKNOWN / INTERNAL / CANCELLED of a stream cut by a
    dying process, "Stream removed") is the instance's, and the request moves on."""
    error = error_from_rpc(exc)
    is_cut = (exc.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED)
              and not is_raised_by_server(exc))
    if is_cut and not error.retryable:
        return UnavailableError(f"the stream broke: {exc.code().name} {exc.details() or ''}".strip())
    return error
