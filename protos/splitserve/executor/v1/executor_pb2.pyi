from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecutorInfo(_message.Message):
    __slots__ = ("model_id", "vocab_size", "eos_token_ids", "max_model_len", "block_size", "num_kv_blocks", "dtype", "device", "incarnation_id", "max_logprobs", "attention_backend", "lease_timeout_s", "supports_decode_handles", "tensor_parallel_size", "kv_cache_bytes", "access", "supports_late_bitmasks", "supports_block_copies", "num_state_slots", "state_slot_bytes", "supports_state_checkpoints", "supports_kv_transfer", "kv_layout", "role", "num_host_blocks", "supports_draft_tokens", "draft_model")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_DECODE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACCESS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_LATE_BITMASKS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_STATE_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    dtype: str
    device: str
    incarnation_id: str
    max_logprobs: int
    attention_backend: str
    lease_timeout_s: float
    supports_decode_handles: bool
    tensor_parallel_size: int
    kv_cache_bytes: int
    access: str
    supports_late_bitmasks: bool
    supports_block_copies: bool
    num_state_slots: int
    state_slot_bytes: int
    supports_state_checkpoints: bool
    supports_kv_transfer: bool
    kv_layout: str
    role: str
    num_host_blocks: int
    supports_draft_tokens: bool
    draft_model: str
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., incarnation_id: _Optional[str] = ..., max_logprobs: _Optional[int] = ..., attention_backend: _Optional[str] = ..., lease_timeout_s: _Optional[float] = ..., supports_decode_handles: _Optional[bool] = ..., tensor_parallel_size: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., access: _Optional[str] = ..., supports_late_bitmasks: _Optional[bool] = ..., supports_block_copies: _Optional[bool] = ..., num_state_slots: _Optional[int] = ..., state_slot_bytes: _Optional[int] = ..., supports_state_checkpoints: _Optional[bool] = ..., supports_kv_transfer: _Optional[bool] = ..., kv_layout: _Optional[str] = ..., role: _Optional[str] = ..., num_host_blocks: _Optional[int] = ..., supports_draft_tokens: _Optional[bool] = ..., draft_model: _Optional[str] = ...) -> None: ...

class SamplerConfig(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "has_seed", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "num_logprobs", "want_logprobs", "min_tokens", "min_tokens_stop_ids", "logit_bias_token_ids", "logit_bias_values", "allowed_token_ids", "want_prompt_logprobs", "num_prompt_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WANT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    WANT_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    has_seed: bool
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    num_logprobs: int
    want_logprobs: bool
    min_tokens: int
    min_tokens_stop_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    want_prompt_logprobs: bool
    num_prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., num_logprobs: _Optional[int] = ..., want_logprobs: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., min_tokens_stop_ids: _Optional[_Iterable[int]] = ..., logit_bias_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., want_prompt_logprobs: _Optional[bool] = ..., num_prompt_logprobs: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "sampling", "num_prompt_tokens", "handle", "allowed_token_bitmask", "state_slot", "state_source_slot", "state_in_slot")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    STATE_SOURCE_SLOT_FIELD_NUMBER: _ClassVar[int]
    STATE_IN_SLOT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: SamplerConfig
    num_prompt_tokens: int
    handle: int
    allowed_token_bitmask: bytes
    state_slot: int
    state_source_slot: int
    state_in_slot: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplerConfig, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., handle: _Optional[int] = ..., allowed_token_bitmask: _Optional[bytes] = ..., state_slot: _Optional[int] = ..., state_source_slot: _Optional[int] = ..., state_in_slot: _Optional[bool] = ...) -> None: ...

class ContinuingRequest(_message.Message):
    __slots__ = ("request_id", "num_scheduled_tokens", "new_block_ids", "allowed_token_bitmask", "bitmask_follows", "draft_token_ids", "num_model_drafts", "draft_bitmasks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    BITMASK_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_MODEL_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BITMASKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_scheduled_tokens: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    allowed_token_bitmask: bytes
    bitmask_follows: bool
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_model_drafts: int
    draft_bitmasks: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., num_scheduled_tokens: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., allowed_token_bitmask: _Optional[bytes] = ..., bitmask_follows: _Optional[bool] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., num_model_drafts: _Optional[int] = ..., draft_bitmasks: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "continuing_requests", "dropped_request_ids", "decode_handles", "decode_block_handles", "decode_block_ids", "want_held_requests", "bitmasks_for_step", "late_bitmasks", "copy_block_sources", "copy_block_destinations", "state_checkpoints", "kv_exports", "ended_exports", "kv_imports", "cancelled_imports", "swap_out_device_blocks", "swap_out_host_blocks", "swap_in_host_blocks", "swap_in_device_blocks")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CONTINUING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    DECODE_BLOCK_HANDLES_FIELD_NUMBER: _ClassVar[int]
    DECODE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    WANT_HELD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BITMASKS_FOR_STEP_FIELD_NUMBER: _ClassVar[int]
    LATE_BITMASKS_FIELD_NUMBER: _ClassVar[int]
    COPY_BLOCK_SOURCES_FIELD_NUMBER: _ClassVar[int]
    COPY_BLOCK_DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    KV_EXPORTS_FIELD_NUMBER: _ClassVar[int]
    ENDED_EXPORTS_FIELD_NUMBER: _ClassVar[int]
    KV_IMPORTS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_IMPORTS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    continuing_requests: _containers.RepeatedCompositeFieldContainer[ContinuingRequest]
    dropped_request_ids: _containers.RepeatedScalarFieldContainer[str]
    decode_handles: _containers.RepeatedScalarFieldContainer[int]
    decode_block_handles: _containers.RepeatedScalarFieldContainer[int]
    decode_block_ids: _containers.RepeatedScalarFieldContainer[int]
    want_held_requests: bool
    bitmasks_for_step: int
    late_bitmasks: _containers.RepeatedCompositeFieldContainer[LateBitmask]
    copy_block_sources: _containers.RepeatedScalarFieldContainer[int]
    copy_block_destinations: _containers.RepeatedScalarFieldContainer[int]
    state_checkpoints: _containers.RepeatedCompositeFieldContainer[StateCheckpoint]
    kv_exports: _containers.RepeatedCompositeFieldContainer[KvExport]
    ended_exports: _containers.RepeatedScalarFieldContainer[str]
    kv_imports: _containers.RepeatedCompositeFieldContainer[KvImport]
    cancelled_imports: _containers.RepeatedScalarFieldContainer[str]
    swap_out_device_blocks: _containers.RepeatedScalarFieldContainer[int]
    swap_out_host_blocks: _containers.RepeatedScalarFieldContainer[int]
    swap_in_host_blocks: _containers.RepeatedScalarFieldContainer[int]
    swap_in_device_blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., continuing_requests: _Optional[_Iterable[_Union[ContinuingRequest, _Mapping]]] = ..., dropped_request_ids: _Optional[_Iterable[str]] = ..., decode_handles: _Optional[_Iterable[int]] = ..., decode_block_handles: _Optional[_Iterable[int]] = ..., decode_block_ids: _Optional[_Iterable[int]] = ..., want_held_requests: _Optional[bool] = ..., bitmasks_for_step: _Optional[int] = ..., late_bitmasks: _Optional[_Iterable[_Union[LateBitmask, _Mapping]]] = ..., copy_block_sources: _Optional[_Iterable[int]] = ..., copy_block_destinations: _Optional[_Iterable[int]] = ..., state_checkpoints: _Optional[_Iterable[_Union[StateCheckpoint, _Mapping]]] = ..., kv_exports: _Optional[_Iterable[_Union[KvExport, _Mapping]]] = ..., ended_exports: _Optional[_Iterable[str]] = ..., kv_imports: _Optional[_Iterable[_Union[KvImport, _Mapping]]] = ..., cancelled_imports: _Optional[_Iterable[str]] = ..., swap_out_device_blocks: _Optional[_Iterable[int]] = ..., swap_out_host_blocks: _Optional[_Iterable[int]] = ..., swap_in_host_blocks: _Optional[_Iterable[int]] = ..., swap_in_device_blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class KvExport(_message.Message):
    __slots__ = ("transfer_id", "block_ids", "state_slot")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    state_slot: int
    def __init__(self, transfer_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., state_slot: _Optional[int] = ...) -> None: ...

class KvImport(_message.Message):
    __slots__ = ("transfer_id", "source_address", "first_block", "block_ids", "state_slot")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    source_address: str
    first_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    state_slot: int
    def __init__(self, transfer_id: _Optional[str] = ..., source_address: _Optional[str] = ..., first_block: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., state_slot: _Optional[int] = ...) -> None: ...

class KvImportResult(_message.Message):
    __slots__ = ("transfer_id", "ok", "error", "bytes", "seconds")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    ok: bool
    error: str
    bytes: int
    seconds: float
    def __init__(self, transfer_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class FetchBlocksRequest(_message.Message):
    __slots__ = ("transfer_id", "first_block")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    first_block: int
    def __init__(self, transfer_id: _Optional[str] = ..., first_block: _Optional[int] = ...) -> None: ...

class KvBlockChunk(_message.Message):
    __slots__ = ("first_block", "num_blocks", "kv_layout", "data", "state")
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    first_block: int
    num_blocks: int
    kv_layout: str
    data: bytes
    state: bytes
    def __init__(self, first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., kv_layout: _Optional[str] = ..., data: _Optional[bytes] = ..., state: _Optional[bytes] = ...) -> None: ...

class StateCheckpoint(_message.Message):
    __slots__ = ("request_id", "num_tokens", "slot")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    slot: int
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class LateBitmask(_message.Message):
    __slots__ = ("request_id", "allowed_token_bitmask")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    allowed_token_bitmask: bytes
    def __init__(self, request_id: _Optional[str] = ..., allowed_token_bitmask: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class RejectedRequest(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StepFailure(_message.Message):
    __slots__ = ("message", "request_ids")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    message: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, message: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "outputs", "rejected", "forward_time_s", "step_time_s", "failure", "decode_token_ids", "draining", "held_requests", "kv_imports_done")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    HELD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_IMPORTS_DONE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    outputs: _containers.RepeatedCompositeFieldContainer[RequestOutput]
    rejected: _containers.RepeatedCompositeFieldContainer[RejectedRequest]
    forward_time_s: float
    step_time_s: float
    failure: StepFailure
    decode_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draining: bool
    held_requests: _containers.RepeatedCompositeFieldContainer[HeldRequest]
    kv_imports_done: _containers.RepeatedCompositeFieldContainer[KvImportResult]
    def __init__(self, step_id: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[RequestOutput, _Mapping]]] = ..., rejected: _Optional[_Iterable[_Union[RejectedRequest, _Mapping]]] = ..., forward_time_s: _Optional[float] = ..., step_time_s: _Optional[float] = ..., failure: _Optional[_Union[StepFailure, _Mapping]] = ..., decode_token_ids: _Optional[_Iterable[int]] = ..., draining: _Optional[bool] = ..., held_requests: _Optional[_Iterable[_Union[HeldRequest, _Mapping]]] = ..., kv_imports_done: _Optional[_Iterable[_Union[KvImportResult, _Mapping]]] = ...) -> None: ...

class HeldRequest(_message.Message):
    __slots__ = ("request_id", "block_ids", "num_computed_tokens", "state_slot")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    state_slot: int
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., state_slot: _Optional[int] = ...) -> None: ...
