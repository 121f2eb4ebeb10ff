from services.pb import common_pb2 as _common_pb2
from services.pb import kvstore_pb2 as _kvstore_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: _common_pb2.RequestSpec
    def __init__(self, spec: _Optional[_Union[_common_pb2.RequestSpec, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "finish_reason", "stop_reason", "num_cached_tokens", "kv", "first_token_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    finish_reason: str
    stop_reason: _common_pb2.StopReason
    num_cached_tokens: int
    kv: _kvstore_pb2.KVHandle
    first_token_logprobs: _common_pb2.TokenLogprobs
    def __init__(self, first_token_id: _Optional[int] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[_Union[_common_pb2.StopReason, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., kv: _Optional[_Union[_kvstore_pb2.KVHandle, _Mapping]] = ..., first_token_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
