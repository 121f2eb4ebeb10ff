from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Endpoint(_message.Message):
    __slots__ = ("host_id", "tcp_address")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    tcp_address: str
    def __init__(self, host_id: _Optional[str] = ..., tcp_address: _Optional[str] = ...) -> None: ...

class RegionDesc(_message.Message):
    __slots__ = ("region_id", "shm_path", "length")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    shm_path: str
    length: int
    def __init__(self, region_id: _Optional[str] = ..., shm_path: _Optional[str] = ..., length: _Optional[int] = ...) -> None: ...

class BlockDesc(_message.Message):
    __slots__ = ("region_id", "offset", "length", "checksum")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    offset: int
    length: int
    checksum: int
    def __init__(self, region_id: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("lease_id", "owner", "regions", "blocks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    owner: Endpoint
    regions: _containers.RepeatedCompositeFieldContainer[RegionDesc]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockDesc]
    def __init__(self, lease_id: _Optional[str] = ..., owner: _Optional[_Union[Endpoint, _Mapping]] = ..., regions: _Optional[_Iterable[_Union[RegionDesc, _Mapping]]] = ..., blocks: _Optional[_Iterable[_Union[BlockDesc, _Mapping]]] = ...) -> None: ...
