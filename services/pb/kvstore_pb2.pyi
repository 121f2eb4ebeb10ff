from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Endpoint(_message.Message):
    __slots__ = ("host_id", "tcp_address", "nixl")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    tcp_address: str
    nixl: str
    def __init__(self, host_id: _Optional[str] = ..., tcp_address: _Optional[str] = ..., nixl: _Optional[str] = ...) -> None: ...

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

class LookupRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Holders(_message.Message):
    __slots__ = ("node_addresses",)
    NODE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    node_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("holders",)
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    holders: _containers.RepeatedCompositeFieldContainer[Holders]
    def __init__(self, holders: _Optional[_Iterable[_Union[Holders, _Mapping]]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("hashes", "release_lease_ids")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    release_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ..., release_lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("kv",)
    KV_FIELD_NUMBER: _ClassVar[int]
    kv: KVHandle
    def __init__(self, kv: _Optional[_Union[KVHandle, _Mapping]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("hashes", "source", "request_class")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    source: KVHandle
    request_class: str
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ..., source: _Optional[_Union[KVHandle, _Mapping]] = ..., request_class: _Optional[str] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_stored", "num_renewed", "num_failed")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_RENEWED_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_renewed: int
    num_failed: int
    def __init__(self, num_stored: _Optional[int] = ..., num_renewed: _Optional[int] = ..., num_failed: _Optional[int] = ...) -> None: ...

class StoreReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class StoreReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class NodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreNode(_message.Message):
    __slots__ = ("node_id", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class NodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[StoreNode]
    def __init__(self, nodes: _Optional[_Iterable[_Union[StoreNode, _Mapping]]] = ...) -> None: ...

class WindowKey(_message.Message):
    __slots__ = ("sequence_hash", "window_end")
    SEQUENCE_HASH_FIELD_NUMBER: _ClassVar[int]
    WINDOW_END_FIELD_NUMBER: _ClassVar[int]
    sequence_hash: bytes
    window_end: int
    def __init__(self, sequence_hash: _Optional[bytes] = ..., window_end: _Optional[int] = ...) -> None: ...

class PutWindowRequest(_message.Message):
    __slots__ = ("key", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: WindowKey
    data: bytes
    def __init__(self, key: _Optional[_Union[WindowKey, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutWindowResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WindowResponse(_message.Message):
    __slots__ = ("found", "data")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    found: bool
    data: bytes
    def __init__(self, found: _Optional[bool] = ..., data: _Optional[bytes] = ...) -> None: ...

class StoreStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreStats(_message.Message):
    __slots__ = ("node_id", "num_blocks", "num_host_blocks", "num_disk_blocks", "host_capacity_blocks", "disk_capacity_blocks", "num_leases", "num_windows", "num_hits", "num_misses", "num_corrupt", "block_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSES_FIELD_NUMBER: _ClassVar[int]
    NUM_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    num_blocks: int
    num_host_blocks: int
    num_disk_blocks: int
    host_capacity_blocks: int
    disk_capacity_blocks: int
    num_leases: int
    num_windows: int
    num_hits: int
    num_misses: int
    num_corrupt: int
    block_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., num_disk_blocks: _Optional[int] = ..., host_capacity_blocks: _Optional[int] = ..., disk_capacity_blocks: _Optional[int] = ..., num_leases: _Optional[int] = ..., num_windows: _Optional[int] = ..., num_hits: _Optional[int] = ..., num_misses: _Optional[int] = ..., num_corrupt: _Optional[int] = ..., block_bytes: _Optional[int] = ...) -> None: ...
