from protos.splitserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrainExecutorRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class ResumeExecutorRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class GetSchedulingConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulingConfig(_message.Message):
    __slots__ = ("policy", "mode", "max_num_batched_tokens", "max_num_seqs")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    mode: str
    max_num_batched_tokens: int
    max_num_seqs: int
    def __init__(self, policy: _Optional[str] = ..., mode: _Optional[str] = ..., max_num_batched_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ...) -> None: ...

class UpdateSchedulingConfigRequest(_message.Message):
    __slots__ = ("policy", "mode", "max_num_batched_tokens", "max_num_seqs")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    mode: str
    max_num_batched_tokens: int
    max_num_seqs: int
    def __init__(self, policy: _Optional[str] = ..., mode: _Optional[str] = ..., max_num_batched_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ...) -> None: ...

class AuditRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AuditReport(_message.Message):
    __slots__ = ("executors", "num_mismatches")
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    NUM_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    executors: _containers.RepeatedCompositeFieldContainer[ExecutorAudit]
    num_mismatches: int
    def __init__(self, executors: _Optional[_Iterable[_Union[ExecutorAudit, _Mapping]]] = ..., num_mismatches: _Optional[int] = ...) -> None: ...

class ExecutorAudit(_message.Message):
    __slots__ = ("address", "audited", "skipped_reason", "mismatches")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AUDITED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_REASON_FIELD_NUMBER: _ClassVar[int]
    MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    address: str
    audited: bool
    skipped_reason: str
    mismatches: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, address: _Optional[str] = ..., audited: _Optional[bool] = ..., skipped_reason: _Optional[str] = ..., mismatches: _Optional[_Iterable[str]] = ...) -> None: ...

class ReloadTenantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTenantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TenantStatus(_message.Message):
    __slots__ = ("name", "weight", "max_running", "max_waiting", "tokens_per_minute", "num_running", "num_waiting", "tokens_last_minute", "served_tokens_per_weight", "configured")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_LAST_MINUTE_FIELD_NUMBER: _ClassVar[int]
    SERVED_TOKENS_PER_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    max_running: int
    max_waiting: int
    tokens_per_minute: int
    num_running: int
    num_waiting: int
    tokens_last_minute: int
    served_tokens_per_weight: float
    configured: bool
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ..., max_running: _Optional[int] = ..., max_waiting: _Optional[int] = ..., tokens_per_minute: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., tokens_last_minute: _Optional[int] = ..., served_tokens_per_weight: _Optional[float] = ..., configured: _Optional[bool] = ...) -> None: ...

class TenantsReport(_message.Message):
    __slots__ = ("tenants", "source")
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStatus]
    source: str
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantStatus, _Mapping]]] = ..., source: _Optional[str] = ...) -> None: ...
