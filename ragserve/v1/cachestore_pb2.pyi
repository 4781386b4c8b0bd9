from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_MEMORY: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_REDIS: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_MEMORY: Tier
TIER_DISK: Tier
TIER_REDIS: Tier

class Block(_message.Message):
    __slots__ = ("key", "data", "dtype", "shape", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    checksum: int
    def __init__(self, key: _Optional[bytes] = ..., data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., checksum: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("layout", "keys")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    layout: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layout: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_len", "tiers")
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    prefix_len: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, prefix_len: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("layout", "keys")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    layout: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layout: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("layout", "blocks")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    layout: str
    blocks: _containers.RepeatedCompositeFieldContainer[Block]
    def __init__(self, layout: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[Block, _Mapping]]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "skipped")
    STORED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    skipped: int
    def __init__(self, stored: _Optional[int] = ..., skipped: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("layout", "keys")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    layout: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layout: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "used_bytes", "capacity_bytes", "blocks", "hits")
    TIER_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    used_bytes: int
    capacity_bytes: int
    blocks: int
    hits: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., hits: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "lookups", "hits", "misses", "corrupt", "puts", "evictions")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    lookups: int
    hits: int
    misses: int
    corrupt: int
    puts: int
    evictions: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., corrupt: _Optional[int] = ..., puts: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...
