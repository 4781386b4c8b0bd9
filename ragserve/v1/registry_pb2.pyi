from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodePath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECODE_UNMEASURED: _ClassVar[DecodePath]
    DECODE_EAGER: _ClassVar[DecodePath]
    DECODE_EAGER_BEFORE_GRAPHS: _ClassVar[DecodePath]
    DECODE_GRAPH: _ClassVar[DecodePath]
DECODE_UNMEASURED: DecodePath
DECODE_EAGER: DecodePath
DECODE_EAGER_BEFORE_GRAPHS: DecodePath
DECODE_GRAPH: DecodePath

class EngineIdentity(_message.Message):
    __slots__ = ("engine_id", "url", "served_model_name", "model_id", "key_scheme", "block_size", "layout_fingerprint", "tokenizer_fingerprint", "version", "labels", "cachestore", "role")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_SCHEME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CACHESTORE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    url: str
    served_model_name: str
    model_id: str
    key_scheme: str
    block_size: int
    layout_fingerprint: str
    tokenizer_fingerprint: str
    version: str
    labels: _containers.ScalarMap[str, str]
    cachestore: str
    role: str
    def __init__(self, engine_id: _Optional[str] = ..., url: _Optional[str] = ..., served_model_name: _Optional[str] = ..., model_id: _Optional[str] = ..., key_scheme: _Optional[str] = ..., block_size: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., version: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., cachestore: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("identity", "tokenizer_json", "chat_template", "special_tokens_json", "num_blocks", "max_model_len", "probe_block_hashes")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_JSON_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PROBE_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    identity: EngineIdentity
    tokenizer_json: bytes
    chat_template: str
    special_tokens_json: str
    num_blocks: int
    max_model_len: int
    probe_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, identity: _Optional[_Union[EngineIdentity, _Mapping]] = ..., tokenizer_json: _Optional[bytes] = ..., chat_template: _Optional[str] = ..., special_tokens_json: _Optional[str] = ..., num_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., probe_block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("router_id", "resume_from_seq", "heartbeat_interval_ms")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    resume_from_seq: int
    heartbeat_interval_ms: int
    def __init__(self, router_id: _Optional[str] = ..., resume_from_seq: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_usage", "free_blocks", "total_blocks", "prefill_tokens_per_s", "decode_step_s", "queued_prefill_tokens", "step_token_budget", "fetch_s_per_block", "computed_prompt_tokens", "fetched_prompt_tokens", "decode_seq_s", "long_prefill_token_threshold", "decode_path", "decode_seq_measured", "max_long_partial_prefills")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    FETCH_S_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SEQ_S_FIELD_NUMBER: _ClassVar[int]
    LONG_PREFILL_TOKEN_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    DECODE_PATH_FIELD_NUMBER: _ClassVar[int]
    DECODE_SEQ_MEASURED_FIELD_NUMBER: _ClassVar[int]
    MAX_LONG_PARTIAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_usage: float
    free_blocks: int
    total_blocks: int
    prefill_tokens_per_s: float
    decode_step_s: float
    queued_prefill_tokens: int
    step_token_budget: int
    fetch_s_per_block: float
    computed_prompt_tokens: int
    fetched_prompt_tokens: int
    decode_seq_s: float
    long_prefill_token_threshold: int
    decode_path: DecodePath
    decode_seq_measured: bool
    max_long_partial_prefills: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_step_s: _Optional[float] = ..., queued_prefill_tokens: _Optional[int] = ..., step_token_budget: _Optional[int] = ..., fetch_s_per_block: _Optional[float] = ..., computed_prompt_tokens: _Optional[int] = ..., fetched_prompt_tokens: _Optional[int] = ..., decode_seq_s: _Optional[float] = ..., long_prefill_token_threshold: _Optional[int] = ..., decode_path: _Optional[_Union[DecodePath, str]] = ..., decode_seq_measured: _Optional[bool] = ..., max_long_partial_prefills: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("engine_id", "load", "last_event_seq")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    load: Load
    last_event_seq: int
    def __init__(self, engine_id: _Optional[str] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., last_event_seq: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class BlocksStored(_message.Message):
    __slots__ = ("block_hashes", "parent_hash")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ...) -> None: ...

class BlocksRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("seq", "stored", "removed", "cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stored: BlocksStored
    removed: BlocksRemoved
    cleared: AllBlocksCleared
    def __init__(self, seq: _Optional[int] = ..., stored: _Optional[_Union[BlocksStored, _Mapping]] = ..., removed: _Optional[_Union[BlocksRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("engine_id", "events")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, engine_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class KVEventAck(_message.Message):
    __slots__ = ("acked_seq",)
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    acked_seq: int
    def __init__(self, acked_seq: _Optional[int] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("engine_id", "reason")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    reason: str
    def __init__(self, engine_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
