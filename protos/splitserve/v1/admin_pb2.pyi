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
