from protos.splitserve.executor.v1 import executor_pb2 as _executor_pb2
from protos.splitserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Hello(_message.Message):
    __slots__ = ("frontend_id",)
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    def __init__(self, frontend_id: _Optional[str] = ...) -> None: ...

class SubmittedRequest(_message.Message):
    __slots__ = ("handle", "request_id", "prompt_token_ids", "output_token_ids", "sampling", "priority", "cache_salt", "received_ago_s", "trace_context", "num_planner_losses", "fork_of", "tenant", "ttft_deadline_ms", "tpot_target_ms")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_AGO_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_PLANNER_LOSSES_FIELD_NUMBER: _ClassVar[int]
    FORK_OF_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TTFT_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_TARGET_MS_FIELD_NUMBER: _ClassVar[int]
    handle: int
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    priority: int
    cache_salt: bytes
    received_ago_s: float
    trace_context: _containers.ScalarMap[str, str]
    num_planner_losses: int
    fork_of: str
    tenant: str
    ttft_deadline_ms: int
    tpot_target_ms: int
    def __init__(self, handle: _Optional[int] = ..., request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[bytes] = ..., received_ago_s: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., num_planner_losses: _Optional[int] = ..., fork_of: _Optional[str] = ..., tenant: _Optional[str] = ..., ttft_deadline_ms: _Optional[int] = ..., tpot_target_ms: _Optional[int] = ...) -> None: ...

class EndedRequest(_message.Message):
    __slots__ = ("handle", "stop_string")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    handle: int
    stop_string: str
    def __init__(self, handle: _Optional[int] = ..., stop_string: _Optional[str] = ...) -> None: ...

class FrontendBatch(_message.Message):
    __slots__ = ("hello", "submitted", "ended")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    submitted: _containers.RepeatedCompositeFieldContainer[SubmittedRequest]
    ended: _containers.RepeatedCompositeFieldContainer[EndedRequest]
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., submitted: _Optional[_Iterable[_Union[SubmittedRequest, _Mapping]]] = ..., ended: _Optional[_Iterable[_Union[EndedRequest, _Mapping]]] = ...) -> None: ...

class PlannerStatus(_message.Message):
    __slots__ = ("serving", "model", "reason", "planner_id", "draining")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PLANNER_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    model: _executor_pb2.ExecutorInfo
    reason: str
    planner_id: str
    draining: bool
    def __init__(self, serving: _Optional[bool] = ..., model: _Optional[_Union[_executor_pb2.ExecutorInfo, _Mapping]] = ..., reason: _Optional[str] = ..., planner_id: _Optional[str] = ..., draining: _Optional[bool] = ...) -> None: ...

class FinishedRequest(_message.Message):
    __slots__ = ("handle", "finish_reason", "num_preemptions", "stop_reason")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    handle: int
    finish_reason: _generation_pb2.FinishReason
    num_preemptions: int
    stop_reason: str
    def __init__(self, handle: _Optional[int] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., num_preemptions: _Optional[int] = ..., stop_reason: _Optional[str] = ...) -> None: ...

class FailedRequest(_message.Message):
    __slots__ = ("handle", "code", "message", "retry_after_s")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    handle: int
    code: int
    message: str
    retry_after_s: float
    def __init__(self, handle: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class RequestLogprobs(_message.Message):
    __slots__ = ("handle", "logprobs")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    handle: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_executor_pb2.TokenLogprob]
    def __init__(self, handle: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_executor_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class PlannerBatch(_message.Message):
    __slots__ = ("handles", "num_tokens", "token_ids", "logprobs", "started", "queued_s", "cached_tokens", "finished", "failed", "status")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[RequestLogprobs]
    started: _containers.RepeatedScalarFieldContainer[int]
    queued_s: _containers.RepeatedScalarFieldContainer[float]
    cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    finished: _containers.RepeatedCompositeFieldContainer[FinishedRequest]
    failed: _containers.RepeatedCompositeFieldContainer[FailedRequest]
    status: PlannerStatus
    def __init__(self, handles: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[RequestLogprobs, _Mapping]]] = ..., started: _Optional[_Iterable[int]] = ..., queued_s: _Optional[_Iterable[float]] = ..., cached_tokens: _Optional[_Iterable[int]] = ..., finished: _Optional[_Iterable[_Union[FinishedRequest, _Mapping]]] = ..., failed: _Optional[_Iterable[_Union[FailedRequest, _Mapping]]] = ..., status: _Optional[_Union[PlannerStatus, _Mapping]] = ...) -> None: ...
