from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_F32: _ClassVar[DType]
    DTYPE_F16: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_FP8_E4M3: _ClassVar[DType]
    DTYPE_INT4: _ClassVar[DType]
    DTYPE_KIVI_INT4: _ClassVar[DType]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_SESSION_CREATED: _ClassVar[EventKind]
    EVENT_SESSION_FORKED: _ClassVar[EventKind]
    EVENT_SESSION_CLOSED: _ClassVar[EventKind]
    EVENT_SESSION_EXPIRED: _ClassVar[EventKind]
    EVENT_SESSION_MOVED_OUT: _ClassVar[EventKind]
    EVENT_SESSION_MOVED_IN: _ClassVar[EventKind]
    EVENT_EVICTIONS: _ClassVar[EventKind]
    EVENT_POOL_PRESSURE: _ClassVar[EventKind]
DTYPE_UNSPECIFIED: DType
DTYPE_F32: DType
DTYPE_F16: DType
DTYPE_BF16: DType
DTYPE_INT8: DType
DTYPE_FP8_E4M3: DType
DTYPE_INT4: DType
DTYPE_KIVI_INT4: DType
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_SESSION_CREATED: EventKind
EVENT_SESSION_FORKED: EventKind
EVENT_SESSION_CLOSED: EventKind
EVENT_SESSION_EXPIRED: EventKind
EVENT_SESSION_MOVED_OUT: EventKind
EVENT_SESSION_MOVED_IN: EventKind
EVENT_EVICTIONS: EventKind
EVENT_POOL_PRESSURE: EventKind

class Layout(_message.Message):
    __slots__ = ("name", "num_layers", "kv_heads", "query_heads", "head_dim", "dtype", "page_tokens", "keys_pre_rope", "page_bytes", "group_size", "append_dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    QUERY_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_PRE_ROPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    APPEND_DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_layers: int
    kv_heads: int
    query_heads: int
    head_dim: int
    dtype: DType
    page_tokens: int
    keys_pre_rope: bool
    page_bytes: int
    group_size: int
    append_dtype: DType
    def __init__(self, name: _Optional[str] = ..., num_layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., query_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., page_tokens: _Optional[int] = ..., keys_pre_rope: _Optional[bool] = ..., page_bytes: _Optional[int] = ..., group_size: _Optional[int] = ..., append_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class Pool(_message.Message):
    __slots__ = ("layout", "capacity_pages", "used_pages", "page_bytes", "sessions", "allocation_failures", "shared_pages", "page_references", "free_pages")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SHARED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_REFERENCES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    layout: str
    capacity_pages: int
    used_pages: int
    page_bytes: int
    sessions: int
    allocation_failures: int
    shared_pages: int
    page_references: int
    free_pages: int
    def __init__(self, layout: _Optional[str] = ..., capacity_pages: _Optional[int] = ..., used_pages: _Optional[int] = ..., page_bytes: _Optional[int] = ..., sessions: _Optional[int] = ..., allocation_failures: _Optional[int] = ..., shared_pages: _Optional[int] = ..., page_references: _Optional[int] = ..., free_pages: _Optional[int] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "backend", "layouts", "pools", "policies", "max_sessions", "max_message_bytes", "policy_info", "default_idle_timeout_seconds", "max_idle_timeout_seconds", "replica", "address", "public_prefixes", "draining")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    POLICY_INFO_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    version: str
    backend: str
    layouts: _containers.RepeatedCompositeFieldContainer[Layout]
    pools: _containers.RepeatedCompositeFieldContainer[Pool]
    policies: _containers.RepeatedScalarFieldContainer[str]
    max_sessions: int
    max_message_bytes: int
    policy_info: _containers.RepeatedCompositeFieldContainer[PolicyInfo]
    default_idle_timeout_seconds: float
    max_idle_timeout_seconds: float
    replica: str
    address: str
    public_prefixes: bool
    draining: bool
    def __init__(self, version: _Optional[str] = ..., backend: _Optional[str] = ..., layouts: _Optional[_Iterable[_Union[Layout, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[Pool, _Mapping]]] = ..., policies: _Optional[_Iterable[str]] = ..., max_sessions: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., policy_info: _Optional[_Iterable[_Union[PolicyInfo, _Mapping]]] = ..., default_idle_timeout_seconds: _Optional[float] = ..., max_idle_timeout_seconds: _Optional[float] = ..., replica: _Optional[str] = ..., address: _Optional[str] = ..., public_prefixes: _Optional[bool] = ..., draining: _Optional[bool] = ...) -> None: ...

class PolicyInfo(_message.Message):
    __slots__ = ("name", "summary", "input", "accepts_probabilities", "accepts_queries", "params", "budget_rule")
    class Input(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        INPUT_UNSPECIFIED: _ClassVar[PolicyInfo.Input]
        INPUT_NONE: _ClassVar[PolicyInfo.Input]
        INPUT_PER_STEP: _ClassVar[PolicyInfo.Input]
        INPUT_COMPRESS: _ClassVar[PolicyInfo.Input]
    INPUT_UNSPECIFIED: PolicyInfo.Input
    INPUT_NONE: PolicyInfo.Input
    INPUT_PER_STEP: PolicyInfo.Input
    INPUT_COMPRESS: PolicyInfo.Input
    NAME_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_RULE_FIELD_NUMBER: _ClassVar[int]
    name: str
    summary: str
    input: PolicyInfo.Input
    accepts_probabilities: bool
    accepts_queries: bool
    params: _containers.RepeatedCompositeFieldContainer[PolicyParam]
    budget_rule: str
    def __init__(self, name: _Optional[str] = ..., summary: _Optional[str] = ..., input: _Optional[_Union[PolicyInfo.Input, str]] = ..., accepts_probabilities: _Optional[bool] = ..., accepts_queries: _Optional[bool] = ..., params: _Optional[_Iterable[_Union[PolicyParam, _Mapping]]] = ..., budget_rule: _Optional[str] = ...) -> None: ...

class PolicyParam(_message.Message):
    __slots__ = ("name", "type", "default_value", "min", "max", "choices", "rule", "description")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TYPE_UNSPECIFIED: _ClassVar[PolicyParam.Type]
        TYPE_INT: _ClassVar[PolicyParam.Type]
        TYPE_DOUBLE: _ClassVar[PolicyParam.Type]
        TYPE_CHOICE: _ClassVar[PolicyParam.Type]
    TYPE_UNSPECIFIED: PolicyParam.Type
    TYPE_INT: PolicyParam.Type
    TYPE_DOUBLE: PolicyParam.Type
    TYPE_CHOICE: PolicyParam.Type
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_VALUE_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: PolicyParam.Type
    default_value: str
    min: float
    max: float
    choices: _containers.RepeatedScalarFieldContainer[str]
    rule: str
    description: str
    def __init__(self, name: _Optional[str] = ..., type: _Optional[_Union[PolicyParam.Type, str]] = ..., default_value: _Optional[str] = ..., min: _Optional[float] = ..., max: _Optional[float] = ..., choices: _Optional[_Iterable[str]] = ..., rule: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class Budget(_message.Message):
    __slots__ = ("tokens", "per_layer", "schedule", "pyramid_beta")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    PYRAMID_BETA_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    per_layer: _containers.RepeatedScalarFieldContainer[int]
    schedule: str
    pyramid_beta: float
    def __init__(self, tokens: _Optional[int] = ..., per_layer: _Optional[_Iterable[int]] = ..., schedule: _Optional[str] = ..., pyramid_beta: _Optional[float] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("layout", "policy", "policy_params", "budget", "idempotency_key", "idle_timeout_seconds", "prefix", "prefix_evictable")
    class PolicyParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    layout: str
    policy: str
    policy_params: _containers.ScalarMap[str, str]
    budget: Budget
    idempotency_key: str
    idle_timeout_seconds: float
    prefix: str
    prefix_evictable: bool
    def __init__(self, layout: _Optional[str] = ..., policy: _Optional[str] = ..., policy_params: _Optional[_Mapping[str, str]] = ..., budget: _Optional[_Union[Budget, _Mapping]] = ..., idempotency_key: _Optional[str] = ..., idle_timeout_seconds: _Optional[float] = ..., prefix: _Optional[str] = ..., prefix_evictable: _Optional[bool] = ...) -> None: ...

class PublishPrefixRequest(_message.Message):
    __slots__ = ("session_id", "name", "is_public")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    IS_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    name: str
    is_public: bool
    def __init__(self, session_id: _Optional[str] = ..., name: _Optional[str] = ..., is_public: _Optional[bool] = ...) -> None: ...

class UnpublishPrefixRequest(_message.Message):
    __slots__ = ("name", "is_public")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IS_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    name: str
    is_public: bool
    def __init__(self, name: _Optional[str] = ..., is_public: _Optional[bool] = ...) -> None: ...

class UnpublishPrefixResponse(_message.Message):
    __slots__ = ("holders",)
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    holders: int
    def __init__(self, holders: _Optional[int] = ...) -> None: ...

class ListPrefixesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPrefixesResponse(_message.Message):
    __slots__ = ("prefixes",)
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    prefixes: _containers.RepeatedCompositeFieldContainer[PrefixInfo]
    def __init__(self, prefixes: _Optional[_Iterable[_Union[PrefixInfo, _Mapping]]] = ...) -> None: ...

class PrefixInfo(_message.Message):
    __slots__ = ("name", "tenant", "is_public", "published", "layout", "source_session_id", "tokens", "resident_tokens", "pages", "shared_pages", "holders")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    IS_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SHARED_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tenant: str
    is_public: bool
    published: bool
    layout: str
    source_session_id: str
    tokens: int
    resident_tokens: int
    pages: int
    shared_pages: int
    holders: int
    def __init__(self, name: _Optional[str] = ..., tenant: _Optional[str] = ..., is_public: _Optional[bool] = ..., published: _Optional[bool] = ..., layout: _Optional[str] = ..., source_session_id: _Optional[str] = ..., tokens: _Optional[int] = ..., resident_tokens: _Optional[int] = ..., pages: _Optional[int] = ..., shared_pages: _Optional[int] = ..., holders: _Optional[int] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session_id", "layer_budgets", "layer_versions", "layout")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_BUDGETS_FIELD_NUMBER: _ClassVar[int]
    LAYER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    layer_budgets: _containers.RepeatedScalarFieldContainer[int]
    layer_versions: _containers.RepeatedScalarFieldContainer[int]
    layout: str
    def __init__(self, session_id: _Optional[str] = ..., layer_budgets: _Optional[_Iterable[int]] = ..., layer_versions: _Optional[_Iterable[int]] = ..., layout: _Optional[str] = ...) -> None: ...

class ForkSessionRequest(_message.Message):
    __slots__ = ("session_id", "policy", "policy_params", "budget", "idempotency_key", "idle_timeout_seconds")
    class PolicyParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    policy: str
    policy_params: _containers.ScalarMap[str, str]
    budget: Budget
    idempotency_key: str
    idle_timeout_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., policy: _Optional[str] = ..., policy_params: _Optional[_Mapping[str, str]] = ..., budget: _Optional[_Union[Budget, _Mapping]] = ..., idempotency_key: _Optional[str] = ..., idle_timeout_seconds: _Optional[float] = ...) -> None: ...

class ForkSessionResponse(_message.Message):
    __slots__ = ("session_id", "layer_budgets", "layer_versions", "shared_pages")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_BUDGETS_FIELD_NUMBER: _ClassVar[int]
    LAYER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SHARED_PAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    layer_budgets: _containers.RepeatedScalarFieldContainer[int]
    layer_versions: _containers.RepeatedScalarFieldContainer[int]
    shared_pages: int
    def __init__(self, session_id: _Optional[str] = ..., layer_budgets: _Optional[_Iterable[int]] = ..., layer_versions: _Optional[_Iterable[int]] = ..., shared_pages: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("freed_pages",)
    FREED_PAGES_FIELD_NUMBER: _ClassVar[int]
    freed_pages: int
    def __init__(self, freed_pages: _Optional[int] = ...) -> None: ...

class GetSessionStatsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionStats(_message.Message):
    __slots__ = ("session_id", "layout", "policy", "tenant", "resident_tokens", "pages", "resident_bytes", "evicted_tokens", "evicted_score", "score_updates", "compressed", "layer_resident", "layer_budget", "layer_version", "idle_timeout_seconds", "lease_seconds_left", "lease_held", "shared_pages")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_SCORE_FIELD_NUMBER: _ClassVar[int]
    SCORE_UPDATES_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    LAYER_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    LAYER_BUDGET_FIELD_NUMBER: _ClassVar[int]
    LAYER_VERSION_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    LEASE_HELD_FIELD_NUMBER: _ClassVar[int]
    SHARED_PAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    layout: str
    policy: str
    tenant: str
    resident_tokens: int
    pages: int
    resident_bytes: int
    evicted_tokens: int
    evicted_score: float
    score_updates: int
    compressed: bool
    layer_resident: _containers.RepeatedScalarFieldContainer[int]
    layer_budget: _containers.RepeatedScalarFieldContainer[int]
    layer_version: _containers.RepeatedScalarFieldContainer[int]
    idle_timeout_seconds: float
    lease_seconds_left: float
    lease_held: bool
    shared_pages: int
    def __init__(self, session_id: _Optional[str] = ..., layout: _Optional[str] = ..., policy: _Optional[str] = ..., tenant: _Optional[str] = ..., resident_tokens: _Optional[int] = ..., pages: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., evicted_tokens: _Optional[int] = ..., evicted_score: _Optional[float] = ..., score_updates: _Optional[int] = ..., compressed: _Optional[bool] = ..., layer_resident: _Optional[_Iterable[int]] = ..., layer_budget: _Optional[_Iterable[int]] = ..., layer_version: _Optional[_Iterable[int]] = ..., idle_timeout_seconds: _Optional[float] = ..., lease_seconds_left: _Optional[float] = ..., lease_held: _Optional[bool] = ..., shared_pages: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("idle_timeout_seconds", "lease_seconds_left", "lease_held")
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    LEASE_HELD_FIELD_NUMBER: _ClassVar[int]
    idle_timeout_seconds: float
    lease_seconds_left: float
    lease_held: bool
    def __init__(self, idle_timeout_seconds: _Optional[float] = ..., lease_seconds_left: _Optional[float] = ..., lease_held: _Optional[bool] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionStats]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionStats, _Mapping]]] = ...) -> None: ...

class LayerKv(_message.Message):
    __slots__ = ("keys", "values")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    values: bytes
    def __init__(self, keys: _Optional[bytes] = ..., values: _Optional[bytes] = ...) -> None: ...

class AppendRequest(_message.Message):
    __slots__ = ("session_id", "positions", "layers")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    positions: _containers.RepeatedScalarFieldContainer[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerKv]
    def __init__(self, session_id: _Optional[str] = ..., positions: _Optional[_Iterable[int]] = ..., layers: _Optional[_Iterable[_Union[LayerKv, _Mapping]]] = ...) -> None: ...

class AppendPrefillResponse(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[StepResult]
    def __init__(self, chunks: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ...) -> None: ...

class PageCopy(_message.Message):
    __slots__ = ("index", "from_page", "to_page")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FROM_PAGE_FIELD_NUMBER: _ClassVar[int]
    TO_PAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    from_page: int
    to_page: int
    def __init__(self, index: _Optional[int] = ..., from_page: _Optional[int] = ..., to_page: _Optional[int] = ...) -> None: ...

class SlotMove(_message.Message):
    __slots__ = ("from_slot", "to_slot")
    FROM_SLOT_FIELD_NUMBER: _ClassVar[int]
    TO_SLOT_FIELD_NUMBER: _ClassVar[int]
    from_slot: int
    to_slot: int
    def __init__(self, from_slot: _Optional[int] = ..., to_slot: _Optional[int] = ...) -> None: ...

class LayerChange(_message.Message):
    __slots__ = ("layer", "version", "resident", "evicted_positions", "moves", "pages_freed", "pages_added", "pages_copied")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    EVICTED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    PAGES_ADDED_FIELD_NUMBER: _ClassVar[int]
    PAGES_COPIED_FIELD_NUMBER: _ClassVar[int]
    layer: int
    version: int
    resident: int
    evicted_positions: _containers.RepeatedScalarFieldContainer[int]
    moves: _containers.RepeatedCompositeFieldContainer[SlotMove]
    pages_freed: _containers.RepeatedScalarFieldContainer[int]
    pages_added: _containers.RepeatedScalarFieldContainer[int]
    pages_copied: _containers.RepeatedCompositeFieldContainer[PageCopy]
    def __init__(self, layer: _Optional[int] = ..., version: _Optional[int] = ..., resident: _Optional[int] = ..., evicted_positions: _Optional[_Iterable[int]] = ..., moves: _Optional[_Iterable[_Union[SlotMove, _Mapping]]] = ..., pages_freed: _Optional[_Iterable[int]] = ..., pages_added: _Optional[_Iterable[int]] = ..., pages_copied: _Optional[_Iterable[_Union[PageCopy, _Mapping]]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerChange]
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerChange, _Mapping]]] = ...) -> None: ...

class PerHeadProbabilities(_message.Message):
    __slots__ = ("rows", "values")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    rows: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rows: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class ReducedProbabilities(_message.Message):
    __slots__ = ("rows", "values")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    rows: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rows: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class Queries(_message.Message):
    __slots__ = ("rows", "values")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    rows: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rows: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class LayerScores(_message.Message):
    __slots__ = ("layer", "version", "per_head", "reduced", "queries")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PER_HEAD_FIELD_NUMBER: _ClassVar[int]
    REDUCED_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    layer: int
    version: int
    per_head: PerHeadProbabilities
    reduced: ReducedProbabilities
    queries: Queries
    def __init__(self, layer: _Optional[int] = ..., version: _Optional[int] = ..., per_head: _Optional[_Union[PerHeadProbabilities, _Mapping]] = ..., reduced: _Optional[_Union[ReducedProbabilities, _Mapping]] = ..., queries: _Optional[_Union[Queries, _Mapping]] = ...) -> None: ...

class DecodeStep(_message.Message):
    __slots__ = ("session_id", "append", "scores")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    append: AppendRequest
    scores: _containers.RepeatedCompositeFieldContainer[LayerScores]
    def __init__(self, session_id: _Optional[str] = ..., append: _Optional[_Union[AppendRequest, _Mapping]] = ..., scores: _Optional[_Iterable[_Union[LayerScores, _Mapping]]] = ...) -> None: ...

class DecodeStepResult(_message.Message):
    __slots__ = ("append", "scores")
    APPEND_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    append: StepResult
    scores: StepResult
    def __init__(self, append: _Optional[_Union[StepResult, _Mapping]] = ..., scores: _Optional[_Union[StepResult, _Mapping]] = ...) -> None: ...

class CompressPromptRequest(_message.Message):
    __slots__ = ("session_id", "window")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    window: _containers.RepeatedCompositeFieldContainer[LayerScores]
    def __init__(self, session_id: _Optional[str] = ..., window: _Optional[_Iterable[_Union[LayerScores, _Mapping]]] = ...) -> None: ...

class GetBlockTablesRequest(_message.Message):
    __slots__ = ("session_id", "layers", "page_token", "max_page_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    page_token: str
    max_page_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., page_token: _Optional[str] = ..., max_page_bytes: _Optional[int] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("layer", "version", "page_tokens", "pages", "positions", "cache_positions", "first_slot")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SLOT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    version: int
    page_tokens: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    cache_positions: _containers.RepeatedScalarFieldContainer[int]
    first_slot: int
    def __init__(self, layer: _Optional[int] = ..., version: _Optional[int] = ..., page_tokens: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., cache_positions: _Optional[_Iterable[int]] = ..., first_slot: _Optional[int] = ...) -> None: ...

class GetBlockTablesResponse(_message.Message):
    __slots__ = ("tables", "next_page_token")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[BlockTable]
    next_page_token: str
    def __init__(self, tables: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ReadKvRequest(_message.Message):
    __slots__ = ("session_id", "layers", "dtype")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, session_id: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("layer", "version", "first_slot", "positions", "keys", "values", "dtype")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FIRST_SLOT_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    version: int
    first_slot: int
    positions: _containers.RepeatedScalarFieldContainer[int]
    keys: bytes
    values: bytes
    dtype: DType
    def __init__(self, layer: _Optional[int] = ..., version: _Optional[int] = ..., first_slot: _Optional[int] = ..., positions: _Optional[_Iterable[int]] = ..., keys: _Optional[bytes] = ..., values: _Optional[bytes] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class TransferSessionRequest(_message.Message):
    __slots__ = ("session_id", "target", "target_token", "transfer_id", "transport")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    target: str
    target_token: str
    transfer_id: str
    transport: str
    def __init__(self, session_id: _Optional[str] = ..., target: _Optional[str] = ..., target_token: _Optional[str] = ..., transfer_id: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class TransferSessionResponse(_message.Message):
    __slots__ = ("session_id", "transfer_id", "transport", "bytes", "seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    transfer_id: str
    transport: str
    bytes: int
    seconds: float
    def __init__(self, session_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., transport: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class LayerState(_message.Message):
    __slots__ = ("positions", "arrivals", "scores", "history", "appended", "version", "budget", "kivi_staging")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ARRIVALS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    APPENDED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    KIVI_STAGING_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    arrivals: _containers.RepeatedScalarFieldContainer[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    history: _containers.RepeatedScalarFieldContainer[int]
    appended: int
    version: int
    budget: int
    kivi_staging: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, positions: _Optional[_Iterable[int]] = ..., arrivals: _Optional[_Iterable[int]] = ..., scores: _Optional[_Iterable[float]] = ..., history: _Optional[_Iterable[int]] = ..., appended: _Optional[int] = ..., version: _Optional[int] = ..., budget: _Optional[int] = ..., kivi_staging: _Optional[_Iterable[float]] = ...) -> None: ...

class SessionState(_message.Message):
    __slots__ = ("session_id", "layout", "policy", "policy_params", "tenant", "last_position", "compressed", "evicted_tokens", "evicted_score", "score_updates", "evictions", "layers", "idle_timeout_seconds", "protect_first", "format")
    class PolicyParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_PARAMS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LAST_POSITION_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_SCORE_FIELD_NUMBER: _ClassVar[int]
    SCORE_UPDATES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROTECT_FIRST_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    layout: str
    policy: str
    policy_params: _containers.ScalarMap[str, str]
    tenant: str
    last_position: int
    compressed: bool
    evicted_tokens: int
    evicted_score: float
    score_updates: int
    evictions: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerState]
    idle_timeout_seconds: float
    protect_first: int
    format: int
    def __init__(self, session_id: _Optional[str] = ..., layout: _Optional[str] = ..., policy: _Optional[str] = ..., policy_params: _Optional[_Mapping[str, str]] = ..., tenant: _Optional[str] = ..., last_position: _Optional[int] = ..., compressed: _Optional[bool] = ..., evicted_tokens: _Optional[int] = ..., evicted_score: _Optional[float] = ..., score_updates: _Optional[int] = ..., evictions: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerState, _Mapping]]] = ..., idle_timeout_seconds: _Optional[float] = ..., protect_first: _Optional[int] = ..., format: _Optional[int] = ...) -> None: ...

class TransferChunk(_message.Message):
    __slots__ = ("layer", "first_slot", "keys", "values", "crc32c")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_SLOT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    layer: int
    first_slot: int
    keys: bytes
    values: bytes
    crc32c: int
    def __init__(self, layer: _Optional[int] = ..., first_slot: _Optional[int] = ..., keys: _Optional[bytes] = ..., values: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class TransferMessage(_message.Message):
    __slots__ = ("transfer_id", "header", "chunk", "commit", "resolve", "nccl", "tcp")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    RESOLVE_FIELD_NUMBER: _ClassVar[int]
    NCCL_FIELD_NUMBER: _ClassVar[int]
    TCP_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    header: SessionState
    chunk: TransferChunk
    commit: bool
    resolve: bool
    nccl: NcclOffer
    tcp: TcpOffer
    def __init__(self, transfer_id: _Optional[str] = ..., header: _Optional[_Union[SessionState, _Mapping]] = ..., chunk: _Optional[_Union[TransferChunk, _Mapping]] = ..., commit: _Optional[bool] = ..., resolve: _Optional[bool] = ..., nccl: _Optional[_Union[NcclOffer, _Mapping]] = ..., tcp: _Optional[_Union[TcpOffer, _Mapping]] = ...) -> None: ...

class TcpOffer(_message.Message):
    __slots__ = ("required",)
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    required: bool
    def __init__(self, required: _Optional[bool] = ...) -> None: ...

class NcclOffer(_message.Message):
    __slots__ = ("link_id", "unique_id", "chunk_slots", "required")
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SLOTS_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    link_id: str
    unique_id: bytes
    chunk_slots: int
    required: bool
    def __init__(self, link_id: _Optional[str] = ..., unique_id: _Optional[bytes] = ..., chunk_slots: _Optional[int] = ..., required: _Optional[bool] = ...) -> None: ...

class TransferReply(_message.Message):
    __slots__ = ("phase", "transport", "data_port", "data_ticket", "replica")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[TransferReply.Phase]
        READY: _ClassVar[TransferReply.Phase]
        COMMITTED: _ClassVar[TransferReply.Phase]
        ABORTED: _ClassVar[TransferReply.Phase]
    PHASE_UNSPECIFIED: TransferReply.Phase
    READY: TransferReply.Phase
    COMMITTED: TransferReply.Phase
    ABORTED: TransferReply.Phase
    PHASE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_TICKET_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    phase: TransferReply.Phase
    transport: str
    data_port: int
    data_ticket: bytes
    replica: str
    def __init__(self, phase: _Optional[_Union[TransferReply.Phase, str]] = ..., transport: _Optional[str] = ..., data_port: _Optional[int] = ..., data_ticket: _Optional[bytes] = ..., replica: _Optional[str] = ...) -> None: ...

class MapPoolRequest(_message.Message):
    __slots__ = ("layout", "session_id")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    layout: str
    session_id: str
    def __init__(self, layout: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class MapPoolResponse(_message.Message):
    __slots__ = ("layout", "device", "arena_bytes", "capacity_pages", "cuda_ipc_handle", "shm_name", "server_pid", "tables")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SERVER_PID_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    layout: Layout
    device: str
    arena_bytes: int
    capacity_pages: int
    cuda_ipc_handle: bytes
    shm_name: str
    server_pid: int
    tables: _containers.RepeatedCompositeFieldContainer[BlockTable]
    def __init__(self, layout: _Optional[_Union[Layout, _Mapping]] = ..., device: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., capacity_pages: _Optional[int] = ..., cuda_ipc_handle: _Optional[bytes] = ..., shm_name: _Optional[str] = ..., server_pid: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("after_sequence", "incarnation", "kinds")
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    after_sequence: int
    incarnation: int
    kinds: _containers.RepeatedScalarFieldContainer[EventKind]
    def __init__(self, after_sequence: _Optional[int] = ..., incarnation: _Optional[int] = ..., kinds: _Optional[_Iterable[_Union[EventKind, str]]] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("incarnation", "events", "oldest_sequence", "latest_sequence")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    OLDEST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LATEST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    events: _containers.RepeatedCompositeFieldContainer[Event]
    oldest_sequence: int
    latest_sequence: int
    def __init__(self, incarnation: _Optional[int] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., oldest_sequence: _Optional[int] = ..., latest_sequence: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("sequence", "kind", "time_unix_micros", "session", "evictions", "pool")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_MICROS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    kind: EventKind
    time_unix_micros: int
    session: SessionEvent
    evictions: EvictionSummary
    pool: PoolPressure
    def __init__(self, sequence: _Optional[int] = ..., kind: _Optional[_Union[EventKind, str]] = ..., time_unix_micros: _Optional[int] = ..., session: _Optional[_Union[SessionEvent, _Mapping]] = ..., evictions: _Optional[_Union[EvictionSummary, _Mapping]] = ..., pool: _Optional[_Union[PoolPressure, _Mapping]] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("session_id", "tenant", "layout", "policy", "parent_session_id", "peer", "pages")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PARENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    layout: str
    policy: str
    parent_session_id: str
    peer: str
    pages: int
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., layout: _Optional[str] = ..., policy: _Optional[str] = ..., parent_session_id: _Optional[str] = ..., peer: _Optional[str] = ..., pages: _Optional[int] = ...) -> None: ...

class EvictionSummary(_message.Message):
    __slots__ = ("session_id", "tenant", "calls", "evicted_tokens", "resident_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    calls: int
    evicted_tokens: int
    resident_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., calls: _Optional[int] = ..., evicted_tokens: _Optional[int] = ..., resident_tokens: _Optional[int] = ...) -> None: ...

class PoolPressure(_message.Message):
    __slots__ = ("layout", "level", "free_pages", "capacity_pages")
    class Level(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        LEVEL_UNSPECIFIED: _ClassVar[PoolPressure.Level]
        LEVEL_OK: _ClassVar[PoolPressure.Level]
        LEVEL_LOW: _ClassVar[PoolPressure.Level]
        LEVEL_CRITICAL: _ClassVar[PoolPressure.Level]
    LEVEL_UNSPECIFIED: PoolPressure.Level
    LEVEL_OK: PoolPressure.Level
    LEVEL_LOW: PoolPressure.Level
    LEVEL_CRITICAL: PoolPressure.Level
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    layout: str
    level: PoolPressure.Level
    free_pages: int
    capacity_pages: int
    def __init__(self, layout: _Optional[str] = ..., level: _Optional[_Union[PoolPressure.Level, str]] = ..., free_pages: _Optional[int] = ..., capacity_pages: _Optional[int] = ...) -> None: ...
