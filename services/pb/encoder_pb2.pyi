from services.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("images", "lease_id")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedScalarFieldContainer[str]
    lease_id: str
    def __init__(self, images: _Optional[_Iterable[str]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ImageEmbedding(_message.Message):
    __slots__ = ("image_hash", "embeddings", "remote", "is_cached")
    IMAGE_HASH_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    IS_CACHED_FIELD_NUMBER: _ClassVar[int]
    image_hash: bytes
    embeddings: _common_pb2.Tensor
    remote: _common_pb2.RemoteEmbeddings
    is_cached: bool
    def __init__(self, image_hash: _Optional[bytes] = ..., embeddings: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., remote: _Optional[_Union[_common_pb2.RemoteEmbeddings, _Mapping]] = ..., is_cached: _Optional[bool] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[ImageEmbedding]
    def __init__(self, images: _Optional[_Iterable[_Union[ImageEmbedding, _Mapping]]] = ...) -> None: ...

class ReleaseEmbeddingsRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseEmbeddingsResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
