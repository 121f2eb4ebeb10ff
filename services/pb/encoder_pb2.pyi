from services.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, images: _Optional[_Iterable[str]] = ...) -> None: ...

class ImageEmbedding(_message.Message):
    __slots__ = ("image_hash", "embeddings")
    IMAGE_HASH_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    image_hash: bytes
    embeddings: _common_pb2.Tensor
    def __init__(self, image_hash: _Optional[bytes] = ..., embeddings: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[ImageEmbedding]
    def __init__(self, images: _Optional[_Iterable[_Union[ImageEmbedding, _Mapping]]] = ...) -> None: ...
