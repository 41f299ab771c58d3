from protos.splitserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

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
