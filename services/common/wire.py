"""Wire types: one frozen dataclass per protobuf message the services exchange, and the one
place that converts between them (STYLE rule 1). Services never build protobufs by hand.

KV descriptors are :mod:`kvstore.transfer.descriptors`' dataclasses; their conversions live here
too, so kvstore stays free of generated code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvstore.transfer.descriptors import BlockDesc, Endpoint, KVHandle, RegionDesc
from services.common.sampling_params import SamplingParams, StructuredOutput, TokenLogprobs
from services.pb import common_pb2, decode_pb2, encoder_pb2, kvstore_pb2, prefill_pb2

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
_INT_FIELDS = ("top_k", "max_tokens", "min_tokens")


@dataclass(frozen=True)
class TensorBytes:
    """A dense tensor as raw little-endian bytes (torch-free: the engines build the tensor)."""

    shape: tuple[int, ...]
    dtype: str
    data: bytes


@dataclass(frozen=True)
class RemoteEmbeddings:
    """An image's embedding rows left in its encoder's registered memory: ``handle``'s blocks,
    back to back, are the rows' bytes; its lease ends when the router releases it (or expires)."""

    handle: KVHandle
    shape: tuple[int, ...]
    """[rows, hidden_size]."""
    dtype: str


@dataclass(frozen=True)
class ImageInput:
    image_hash: bytes
    position: int
    """Index of the image's first placeholder token in the prompt."""
    embeddings: TensorBytes | None = None
    """[rows, hidden_size]: one row per placeholder token, inline."""
    remote: RemoteEmbeddings | None = None
    """Or the rows, to be read one-sided from the encoder. Neither: the KV of every block the
    image touches must come from a prefix cache (decode; or the router skipped the encoder)."""
    num_rows: int = 0
    """Placeholder tokens of the image (0: the inline embeddings' rows)."""

    @property
    def rows(self) -> int:
        if self.num_rows:
            return self.num_rows
        shape = self.embeddings.shape if self.embeddings is not None else self.remote.shape if self.remote else (0,)
        return int(shape[0])

    def without_embeddings(self) -> ImageInput:
        """The image as a reader that gets its KV (not its rows) sees it: hash, place, size."""
        return ImageInput(self.image_hash, self.position, num_rows=self.rows)


@dataclass(frozen=True)
class EncodedImage:
    """One image of an Encode reply: its hash and its rows, inline or left at the encoder."""

    image_hash: bytes
    embeddings: TensorBytes | None = None
    remote: RemoteEmbeddings | None = None
    is_cached: bool = False
    """Served from the encoder's embedding cache (no forward pass)."""


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    images: tuple[ImageInput, ...] = ()
    cache_salt: str = ""
    """Joins the root of every block hash: requests with another salt never share its KV."""
    request_class: str = "chat"
    """"agent" or "chat": picks how long the KV store keeps the request's blocks."""


@dataclass(frozen=True)
class PrefillResponse:
    first_token_id: int
    finish_reason: str | None
    """None: decode continues; "stop" / "length" when the first token ended the request."""
    stop_reason: str | int | None
    num_cached_tokens: int
    """Prompt tokens served from a prefix cache."""
    kv: KVHandle | None
    """The prompt's KV lent to decode (None: the request is done, or decode must recompute)."""
    first_token_logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class DecodeRequest:
    spec: RequestSpec
    output_token_ids: tuple[int, ...]
    """Generated so far: prefill's first token, or every token before a migration."""
    kv: KVHandle | None
    """The prompt's KV at its prefill instance; None: read the store's hits, compute the rest."""
    num_cached_tokens: int
    """Passed through to usage."""
    prefill_address: str
    """gRPC address of the KV's owner, where its lease is released."""
    num_migrations: int = 0
    """Decode instances the request already left mid-stream (0: it comes from its prefill)."""


@dataclass(frozen=True)
class TokenChunk:
    """New tokens of a decode stream; one with no token and no finish is a heartbeat."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    kv_recomputed: bool = False
    """The prompt's KV could not be read: decode recomputed it."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per token, when the request asked for logprobs."""


@dataclass(frozen=True)
class LoadReport:
    instance_id: str
    role: str
    num_running: int = 0
    num_waiting: int = 0
    num_queued_prefill_tokens: int = 0
    num_kv_tokens_in_use: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_leases: int = 0
    num_patches_in_flight: int = 0
    step_time_samples_s: tuple[float, ...] = ()
    is_draining: bool = False
    num_transfers_in_flight: int = 0
    queued_prefill_compute_s: float = 0.0
    """Seconds of queued prefill work by the instance's own fitted cost model (0: not known)."""
    num_restarts: int = 0
    """Times the instance's supervisor (epd up) restarted it (its EPD_RESTART_COUNT)."""


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer_json: str
    tokenizer_config_json: str
    image_token_id: int | None
    hidden_size: int


# ----- sampling parameters and requests ----------------------------------------------------
def params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, skip_special_tokens=params.skip_special_tokens,
        **{name: getattr(params, name) for name in _FLOAT_FIELDS + _INT_FIELDS})
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.num_speculative_tokens is not None:
        msg.num_speculative_tokens = params.num_speculative_tokens
    if params.structured is not None:
        msg.structured.kind, msg.structured.spec = params.structured.kind, params.structured.spec
    msg.logit_bias.update(params.logit_bias)
    return msg


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        num_speculative_tokens=msg.num_speculative_tokens if msg.HasField("num_speculative_tokens") else None,
        structured=(StructuredOutput(msg.structured.kind, msg.structured.spec)
                    if msg.HasField("structured") else None),
        stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        skip_special_tokens=msg.skip_special_tokens, logit_bias=dict(msg.logit_bias),
        **{name: getattr(msg, name) for name in _FLOAT_FIELDS + _INT_FIELDS})


def logprobs_to_proto(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob,
                                    top_token_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])


def logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, tuple(zip(msg.top_token_ids, msg.top_logprobs)))


def tensor_to_proto(t: TensorBytes) -> common_pb2.Tensor:
    return common_pb2.Tensor(shape=list(t.shape), dtype=t.dtype, data=t.data)


def tensor_from_proto(msg: common_pb2.Tensor) -> TensorBytes:
    return TensorBytes(tuple(msg.shape), msg.dtype, msg.data)


def remote_to_proto(r: RemoteEmbeddings) -> common_pb2.RemoteEmbeddings:
    return common_pb2.RemoteEmbeddings(handle=kv_handle_to_proto(r.handle), shape=list(r.shape), dtype=r.dtype)


def remote_from_proto(msg: common_pb2.RemoteEmbeddings) -> RemoteEmbeddings:
    return RemoteEmbeddings(kv_handle_from_proto(msg.handle), tuple(msg.shape), msg.dtype)


def image_to_proto(i: ImageInput) -> common_pb2.ImageInput:
    msg = common_pb2.ImageInput(image_hash=i.image_hash, position=i.position, num_rows=i.num_rows)
    if i.embeddings is not None:
        msg.embeddings.CopyFrom(tensor_to_proto(i.embeddings))
    if i.remote is not None:
        msg.remote.CopyFrom(remote_to_proto(i.remote))
    return msg


def image_from_proto(msg: common_pb2.ImageInput) -> ImageInput:
    return ImageInput(msg.image_hash, msg.position,
                      tensor_from_proto(msg.embeddings) if msg.HasField("embeddings") else None,
                      remote_from_proto(msg.remote) if msg.HasField("remote") else None, msg.num_rows)


def encoded_image_to_proto(e: EncodedImage) -> encoder_pb2.ImageEmbedding:
    msg = encoder_pb2.ImageEmbedding(image_hash=e.image_hash, is_cached=e.is_cached)
    if e.embeddings is not None:
        msg.embeddings.CopyFrom(tensor_to_proto(e.embeddings))
    if e.remote is not None:
        msg.remote.CopyFrom(remote_to_proto(e.remote))
    return msg


def encoded_image_from_proto(msg: encoder_pb2.ImageEmbedding) -> EncodedImage:
    return EncodedImage(msg.image_hash, tensor_from_proto(msg.embeddings) if msg.HasField("embeddings") else None,
                        remote_from_proto(msg.remote) if msg.HasField("remote") else None, msg.is_cached)


def spec_to_proto(spec: RequestSpec) -> common_pb2.RequestSpec:
    return common_pb2.RequestSpec(
        request_id=spec.request_id, prompt_token_ids=list(spec.prompt_token_ids),
        params=params_to_proto(spec.params), images=[image_to_proto(i) for i in spec.images],
        cache_salt=spec.cache_salt, request_class=spec.request_class)


def spec_from_proto(msg: common_pb2.RequestSpec) -> RequestSpec:
    return RequestSpec(
        request_id=msg.request_id, prompt_token_ids=tuple(msg.prompt_token_ids),
        params=params_from_proto(msg.params), images=tuple(image_from_proto(i) for i in msg.images),
        cache_salt=msg.cache_salt, request_class=msg.request_class or "chat")


def stop_reason_to_proto(reason: str | int | None) -> common_pb2.StopReason:
    if isinstance(reason, str):
        return common_pb2.StopReason(stop_string=reason)
    if isinstance(reason, int):
        return common_pb2.StopReason(stop_token_id=reason)
    return common_pb2.StopReason()


def stop_reason_from_proto(msg: common_pb2.StopReason) -> str | int | None:
    kind = msg.WhichOneof("reason")
    return None if kind is None else getattr(msg, kind)


# ----- KV descriptors ----------------------------------------------------------------------
def kv_handle_to_proto(handle: KVHandle) -> kvstore_pb2.KVHandle:
    return kvstore_pb2.KVHandle(
        lease_id=handle.lease_id,
        owner=kvstore_pb2.Endpoint(host_id=handle.owner.host_id, tcp_address=handle.owner.tcp_address,
                                   nixl=handle.owner.nixl),
        regions=[kvstore_pb2.RegionDesc(region_id=r.region_id, shm_path=r.shm_path, length=r.length)
                 for r in handle.regions],
        blocks=[kvstore_pb2.BlockDesc(region_id=b.region_id, offset=b.offset, length=b.length,
                                      checksum=b.checksum) for b in handle.blocks])


def kv_handle_from_proto(msg: kvstore_pb2.KVHandle) -> KVHandle:
    return KVHandle(
        lease_id=msg.lease_id, owner=Endpoint(msg.owner.host_id, msg.owner.tcp_address, msg.owner.nixl),
        regions=tuple(RegionDesc(r.region_id, r.shm_path, r.length) for r in msg.regions),
        blocks=tuple(BlockDesc(b.region_id, b.offset, b.length, b.checksum) for b in msg.blocks))


# ----- prefill and decode ------------------------------------------------------------------
def prefill_response_to_proto(r: PrefillResponse) -> prefill_pb2.PrefillResponse:
    msg = prefill_pb2.PrefillResponse(
        first_token_id=r.first_token_id, finish_reason=r.finish_reason or "",
        stop_reason=stop_reason_to_proto(r.stop_reason), num_cached_tokens=r.num_cached_tokens)
    if r.kv is not None:
        msg.kv.CopyFrom(kv_handle_to_proto(r.kv))
    if r.first_token_logprobs is not None:
        msg.first_token_logprobs.CopyFrom(logprobs_to_proto(r.first_token_logprobs))
    return msg


def prefill_response_from_proto(msg: prefill_pb2.PrefillResponse) -> PrefillResponse:
    return PrefillResponse(
        first_token_id=msg.first_token_id, finish_reason=msg.finish_reason or None,
        stop_reason=stop_reason_from_proto(msg.stop_reason), num_cached_tokens=msg.num_cached_tokens,
        kv=kv_handle_from_proto(msg.kv) if msg.HasField("kv") else None,
        first_token_logprobs=(logprobs_from_proto(msg.first_token_logprobs)
                              if msg.HasField("first_token_logprobs") else None))


def decode_request_to_proto(r: DecodeRequest) -> decode_pb2.DecodeRequest:
    msg = decode_pb2.DecodeRequest(
        spec=spec_to_proto(r.spec), output_token_ids=list(r.output_token_ids),
        num_cached_tokens=r.num_cached_tokens, prefill_address=r.prefill_address,
        num_migrations=r.num_migrations)
    if r.kv is not None:
        msg.kv.CopyFrom(kv_handle_to_proto(r.kv))
    return msg


def decode_request_from_proto(msg: decode_pb2.DecodeRequest) -> DecodeRequest:
    return DecodeRequest(
        spec=spec_from_proto(msg.spec), output_token_ids=tuple(msg.output_token_ids),
        kv=kv_handle_from_proto(msg.kv) if msg.HasField("kv") else None,
        num_cached_tokens=msg.num_cached_tokens, prefill_address=msg.prefill_address,
        num_migrations=msg.num_migrations)


def token_chunk_to_proto(c: TokenChunk) -> decode_pb2.TokenChunk:
    return decode_pb2.TokenChunk(
        token_ids=list(c.token_ids), finish_reason=c.finish_reason or "",
        stop_reason=stop_reason_to_proto(c.stop_reason), num_cached_tokens=c.num_cached_tokens,
        kv_recomputed=c.kv_recomputed, logprobs=[logprobs_to_proto(lp) for lp in c.logprobs])


def token_chunk_from_proto(msg: decode_pb2.TokenChunk) -> TokenChunk:
    return TokenChunk(
        token_ids=tuple(msg.token_ids), finish_reason=msg.finish_reason or None,
        stop_reason=stop_reason_from_proto(msg.stop_reason), num_cached_tokens=msg.num_cached_tokens,
        kv_recomputed=msg.kv_recomputed, logprobs=tuple(logprobs_from_proto(lp) for lp in msg.logprobs))


# ----- load and model info -----------------------------------------------------------------
def load_to_proto(report: LoadReport) -> common_pb2.LoadReport:
    fields = dataclasses.asdict(report)
    fields["step_time_samples_s"] = list(report.step_time_samples_s)
    return common_pb2.LoadReport(**fields)


def load_from_proto(msg: common_pb2.LoadReport) -> LoadReport:
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(LoadReport)}
    values["step_time_samples_s"] = tuple(msg.step_time_samples_s)
    return LoadReport(**values)


def model_info_to_proto(info: ModelInfo) -> common_pb2.ModelInfo:
    fields = dataclasses.asdict(info)
    fields["eos_token_ids"] = list(info.eos_token_ids)
    if info.image_token_id is None:
        del fields["image_token_id"]
    return common_pb2.ModelInfo(**fields)


def model_info_from_proto(msg: common_pb2.ModelInfo) -> ModelInfo:
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(ModelInfo)}
    values["eos_token_ids"] = tuple(msg.eos_token_ids)
    values["image_token_id"] = msg.image_token_id if msg.HasField("image_token_id") else None
    return ModelInfo(**values)
