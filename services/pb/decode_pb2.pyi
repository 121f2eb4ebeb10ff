from services.pb import common_pb2 as _common_pb2
from services.pb import kvstore_pb2 as _kvstore_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("spec", "output_token_ids", "kv", "num_cached_tokens", "prefill_address", "num_migrations")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    spec: _common_pb2.RequestSpec
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv: _kvstore_pb2.KVHandle
    num_cached_tokens: int
    prefill_address: str
    num_migrations: int
    def __init__(self, spec: _Optional[_Union[_common_pb2.RequestSpec, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., kv: _Optional[_Union[_kvstore_pb2.KVHandle, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., prefill_address: _Optional[str] = ..., num_migrations: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "stop_reason", "num_cached_tokens", "kv_recomputed", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stop_reason: _common_pb2.StopReason
    num_cached_tokens: int
    kv_recomputed: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[_Union[_common_pb2.StopReason, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., kv_recomputed: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...
