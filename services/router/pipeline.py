"""The router's real backend: a request's trip through the cluster over gRPC.

::

    GenerateRequest --> (images: encoder) --> prefill: first token + KV handle
                    --> decode: pulls the KV one-sided, streams tokens --> GenerateChunks

Closing the chunk iterator (the client left) cancels whichever call is in flight; a KV handle
that no decode instance took yet is released at its prefill instance right away.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator

import grpc
import grpc.aio
from tokenizers import Tokenizer as BackendTokenizer

from kvstore.hashing import block_hashes, root_hash
from services.common.errors import InvalidRequestError
from services.common.grpc_errors import error_from_rpc
from services.common.retry import is_retryable, retry
from services.common.tokenizer import Tokenizer
from services.common.wire import (ImageInput, ModelInfo, RequestSpec, logprobs_from_proto,
                                  model_info_from_proto, spec_to_proto, stop_reason_from_proto,
                                  tensor_from_proto)
from services.pb import common_pb2, decode_pb2, decode_pb2_grpc, encoder_pb2, encoder_pb2_grpc
from services.pb import prefill_pb2, prefill_pb2_grpc
from services.router.backend import GenerateChunk, GenerateRequest
from services.router.instances import InstancePool
from services.router.policies import Policy, RequestView, make_policy

logger = logging.getLogger(__name__)


class ClusterBackend:
    def __init__(self, prefill: tuple[str, ...], decode: tuple[str, ...], encoder: tuple[str, ...] = (),
                 policies: dict[str, Policy] | None = None, health_timeout_s: float = 3.0) -> None:
        """``policies``: role -> policy (default: round robin for every role)."""
        policies = policies or {}

        def pool(role: str, addresses: tuple[str, ...], stub_class) -> InstancePool:
            return InstancePool(role, addresses, stub_class, policies.get(role) or make_policy("round_robin"),
                                health_timeout_s=health_timeout_s)

        self.prefills = pool("prefill", prefill, prefill_pb2_grpc.PrefillStub)
        self.decodes = pool("decode", decode, decode_pb2_grpc.DecodeStub)
        self.encoders = pool("encoder", encoder, encoder_pb2_grpc.EncoderStub)
        self.info: ModelInfo | None = None
        self.tokenizer: Tokenizer | None = None

    @property
    def pools(self) -> tuple[InstancePool, ...]:
        return (self.prefills, self.decodes, self.encoders)

    async def connect(self, timeout_s: float = 60.0) -> None:
        """Learn the model (name, limits, tokenizer) from a prefill instance (waiting for one to
        come up: it may still be loading the model), then follow every instance's load."""
        msg = await self.prefills.instances[0].stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=timeout_s,
                                                                 wait_for_ready=True)
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
        try:
            for pool in (self.prefills, self.decodes):
                for instance in pool.instances:
                    await instance.stub.GetLoad(common_pb2.LoadRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return False
        return True

    async def close(self) -> None:
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
        kv = first.kv if first.HasField("kv") else None
        handed_over = False
        try:
            finish = first.finish_reason or None
            first_logprobs = ((logprobs_from_proto(first.first_token_logprobs),)
                              if first.HasField("first_token_logprobs") else ())
            yield GenerateChunk((first.first_token_id,), finish, stop_reason_from_proto(first.stop_reason),
                                num_prompt, first.num_cached_tokens, first_logprobs)
            if finish is not None:
                return
            request = decode_pb2.DecodeRequest(
                spec=spec_to_proto(spec), output_token_ids=[first.first_token_id],
                kv=kv, num_cached_tokens=first.num_cached_tokens, prefill_address=prefill.address)
            async with contextlib.aclosing(self._decode(request, view)) as chunks:
                async for chunk in chunks:
                    # A decode instance has the request: it read the KV (or recomputes) and
                    # releases the lease itself.
                    handed_over = True
                    yield GenerateChunk(tuple(chunk.token_ids), chunk.finish_reason or None,
                                        stop_reason_from_proto(chunk.stop_reason), num_prompt,
                                        chunk.num_cached_tokens, tuple(map(logprobs_from_proto, chunk.logprobs)))
        finally:
            if kv is not None and not handed_over:
                await self._release(prefill, kv.lease_id)

    async def _decode(self, request: decode_pb2.DecodeRequest, view: RequestView) -> AsyncIterator[decode_pb2.TokenChunk]:
        """The token stream from a decode instance; until its first chunk, an unavailable
        instance (dead, draining) is skipped for the next one."""
        for attempt in range(len(self.decodes)):
            instance = self.decodes.pick(view, arrival=attempt == 0)
            call = instance.stub.Generate(request)
            has_chunks = False
            try:
                async for chunk in call:
                    has_chunks = True
                    yield chunk
                return
            except grpc.aio.AioRpcError as exc:
                error = error_from_rpc(exc)
                if error.retryable:
                    self.decodes.mark_unavailable(instance)
                if has_chunks or not error.retryable or attempt == len(self.decodes) - 1:
                    raise error from exc
                logger.warning("decode instance %s unavailable (%s): trying another", instance.address, error)
            finally:
                call.cancel()

    async def _prefill(self, spec: RequestSpec, view: RequestView):
        """(instance, PrefillResponse); another instance is tried when one is unavailable. The
        request may first wait in the router's queue (a queueing prefill policy)."""
        message = prefill_pb2.PrefillRequest(spec=spec_to_proto(spec))
        arrivals = iter((True,))

        async def attempt():
            placement = await self.prefills.place(view, arrival=next(arrivals, False))
            instance = placement.instance
            try:
                return instance, await instance.stub.Prefill(message)
            except grpc.aio.AioRpcError as exc:
                error = error_from_rpc(exc)
                if error.retryable:
                    self.prefills.mark_unavailable(instance)
                raise error from exc
            finally:
                self.prefills.release(placement)

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
        if not self.encoders:
            raise InvalidRequestError("this deployment has no encoder: images are not supported")
        instance = self.encoders.pick(RequestView(request.request_id, len(request.prompt_token_ids),
                                                  num_patches=len(request.images)))
        try:
            reply = await instance.stub.Encode(encoder_pb2.EncodeRequest(images=list(request.images)))
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from exc
        return [(image.image_hash, tensor_from_proto(image.embeddings)) for image in reply.images]
