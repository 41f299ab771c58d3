"""What travels between the planner and an executor for one step, as plain records.

The plan is a diff: a request the executor has not seen arrives whole, a continuing one carries
only its token count and new blocks, and a steady decode only its handle (see decode_set), so a
plan's size follows the step's work, not the length of the conversations. The protobuf form is
built by plan_codec.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kv_manager import BlockCopy
from scheduler_service.core.errors import RequestError
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestPlan:
    """A request the executor does not hold: first admission, or again after a preemption or a
    lost executor. It travels whole."""

    request_id: str
    # Every token known: the prompt, then any output generated before a preemption.
    token_ids: list[int]
    # The request's whole block table: token i lives in block_ids[i // block_size].
    block_ids: list[int]
    # Leading tokens whose K/V are already in those blocks (a prefix-cache hit, a multiple of
    # the block size; or a fork of a sibling's prompt); the executor computes from here. A
    # hybrid model's hit also names the checkpoint of its recurrent state (state_source_slot).
    num_computed_tokens: int
    # Tokens to compute this step (a whole prefill, or one chunk of it).
    num_scheduled_tokens: int
    sampling: SamplingParams
    # Tokens of token_ids that are prompt (the rest count as output for penalties).
    num_prompt_tokens: int
    # Names the request in later plans' decode_handles (0: never).
    handle: int = 0
    # The tokens this step may sample (TokenConstraint.allowed_token_bitmask), for a request
    # with a grammar whose step samples; empty otherwise.
    allowed_token_bitmask: bytes = b""
    # Its recurrent-state slot, for a hybrid model (SchedulerConfig.num_state_slots): free
    # until now, its state empty (num_computed_tokens 0) unless state_source_slot names where
    # it is. 0: the model keeps no state.
    state_slot: int = 0
    # A checkpoint's slot holding the recurrent state after the first num_computed_tokens
    # tokens (a cached prefix's, made by an earlier plan), copied into state_slot before the
    # step computes. 0: none.
    state_source_slot: int = 0
    # Its state_slot holds its recurrent state after num_computed_tokens already (it moved
    # here with it): nothing to copy.
    state_in_slot: bool = False


@dataclass(slots=True, frozen=True)
class StateCheckpoint:
    """Keep a hybrid model's request's recurrent state after its first num_tokens tokens (a
    point inside or at the end of what it computes in the plan) in slot, a slot no request
    holds, for later requests that share the prefix."""

    request_id: str
    num_tokens: int
    slot: int


@dataclass(slots=True)
class ContinuingRequestPlan:
    """A request the executor holds from an earlier step; only what changed travels."""

    request_id: str
    # Tokens to compute this step, from where its last step ended: the next prefill chunk, or
    # 1 for a decode, whose input is the token the executor itself sampled last (and its drafts).
    num_scheduled_tokens: int
    # Blocks appended to the request's block table for this step's tokens.
    new_block_ids: list[int]
    # As NewRequestPlan.allowed_token_bitmask.
    allowed_token_bitmask: bytes = b""
    # The bitmask comes after the plan (LateBitmasks), once the token before is back.
    bitmask_follows: bool = False
    # Speculative decoding: tokens proposed to follow its last one, which the executor verifies
    # (core/speculation.py); its answer is the accepted ones and the token after them.
    draft_token_ids: list[int] = field(default_factory=list)
    # Or how many the executor's draft model proposes (ContinuingRequest.num_model_drafts).
    num_model_drafts: int = 0
    # With a grammar: the tokens the position after each draft may sample (draft_bitmasks).
    draft_bitmasks: list[bytes] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class LateBitmasks:
    """The bitmasks of a plan's entries that had bitmask_follows, sent once the plan before it
    has answered: (request id, bitmask) for each whose request still wants its token."""

    step_id: int
    bitmasks: list[tuple[str, bytes]]


@dataclass(slots=True, frozen=True)
class KvExport:
    """Blocks offered to another executor under a transfer id (the source side of a move)."""

    transfer_id: str
    block_ids: list[int]
    # A hybrid model's request's state slot, offered with the blocks (0: none).
    state_slot: int = 0


@dataclass(slots=True, frozen=True)
class KvImport:
    """Blocks to fill from another executor's offer (the destination side of a move): offer
    positions first_block.. go into block_ids; those before are cached here already."""

    transfer_id: str
    source_address: str
    first_block: int
    block_ids: list[int]
    # The slot a hybrid model's request's recurrent state goes into (0: none).
    state_slot: int = 0


@dataclass(slots=True, frozen=True)
class ImportDone:
    """What an import came to, as the destination executor reports it."""

    transfer_id: str
    ok: bool
    error: str = ""
    num_bytes: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class StepPlan:
    """The work of one forward pass."""

    # Increases with every plan the scheduler sends; a result names the plan it answers.
    step_id: int
    new_requests: list[NewRequestPlan] = field(default_factory=list)
    continuing_requests: list[ContinuingRequestPlan] = field(default_factory=list)
    # Requests the executor must forget before this step (finished, aborted or preempted).
    dropped_request_ids: list[str] = field(default_factory=list)
    # Steady decodes by handle, one token each; answered in StepOutput.decode_token_ids.
    decode_handles: list[int] = field(default_factory=list)
    # Blocks appended to steady decodes first: decode_block_handles[i] gains decode_block_ids[i].
    decode_block_handles: list[int] = field(default_factory=list)
    decode_block_ids: list[int] = field(default_factory=list)
    # Ask the executor for every request it holds after this plan (the audit).
    want_held_requests: bool = False
    # Blocks to copy before the step runs (forks' copies of a shared partial block).
    block_copies: list[BlockCopy] = field(default_factory=list)
    # Recurrent states to keep as the step computes (a hybrid model with prefix caching).
    state_checkpoints: list[StateCheckpoint] = field(default_factory=list)
    # K/V moving between executors (planner/kv_moves.py): offers made and ended here, imports
    # started and abandoned here.
    kv_exports: list[KvExport] = field(default_factory=list)
    ended_exports: list[str] = field(default_factory=list)
    kv_imports: list[KvImport] = field(default_factory=list)
    cancelled_imports: list[str] = field(default_factory=list)
    # The host tier's copies before the step: (device block, host block) out, then (host block,
    # device block) in.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # The step token limit it was planned under (Scheduler.schedule; --target-itl-ms), if any:
    # the step trace records it, so that a replay plans under the same one.
    step_token_limit: int | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return (
            sum(r.num_scheduled_tokens for r in self.new_requests)
            + sum(r.num_scheduled_tokens for r in self.continuing_requests)
            + len(self.decode_handles)
        )

    @property
    def has_work(self) -> bool:
        return bool(self.new_requests or self.continuing_requests or self.decode_handles)

    @property
    def has_moves(self) -> bool:
        """Whether it carries K/V transfer or swap entries, which go even in a plan with no work."""
        return bool(
            self.kv_exports or self.ended_exports or self.kv_imports or self.cancelled_imports or self.swap_out or self.swap_in
        )

    def prefill_and_decode_tokens(self) -> tuple[int, int]:
        """The step's batch composition: a one-token continuation counts as a decode (a
        prefill chunk of one token is rare enough not to matter in a picture), and so does a
        decode with its drafts, token for token."""
        decoding = [r.num_scheduled_tokens for r in self.continuing_requests if r.num_scheduled_tokens == 1 or r.draft_token_ids]
        continuing = sum(r.num_scheduled_tokens for r in self.continuing_requests) - sum(decoding)
        prefill = sum(r.num_scheduled_tokens for r in self.new_requests) + continuing
        return prefill, len(self.decode_handles) + sum(decoding)


@dataclass(slots=True, frozen=True)
class HeldState:
    """One request's state on the executor, as it reports it for an audit."""

    block_ids: tuple[int, ...]
    num_computed_tokens: int
    # Its recurrent-state slot (0: none).
    state_slot: int = 0


@dataclass(slots=True)
class StepOutput:
    """An executor's answer to one plan."""

    # The plan this answers.
    step_id: int
    # Tokens sampled this step, by request (one each for requests whose computation reached
    # their last known token; none for a prefill chunk that did not). Read only: an executor's
    # answer passes its repeated field through as it came.
    sampled: dict[str, Sequence[int]] = field(default_factory=dict)
    # The executor's per-token logprob records, opaque to the planner: they pass through to the
    # client as they came (see frontend/output_stream.py).
    logprobs: dict[str, Sequence[object]] = field(default_factory=dict)
    # Likewise the records of the prompt tokens scored (prompt_logprobs), on the step that
    # samples a request's first token after its prompt.
    prompt_logprobs: dict[str, Sequence[object]] = field(default_factory=dict)
    # One token per StepPlan.decode_handles entry, in that order.
    decode_token_ids: Sequence[int] = ()
    # Entries the executor refused, by request, with why: those requests end in error.
    rejected: dict[str, RequestError] = field(default_factory=dict)
    # Seconds the executor spent in the forward pass and sampling, and on the whole step.
    forward_time_s: float = 0.0
    step_time_s: float = 0.0
    # Set when the step's forward raised: no tokens, and the executor dropped the state of
    # every request the step ran (rejected entries excepted).
    failure: str | None = None
    # When the plan asked: request id -> its state on the executor after the plan ran.
    held_requests: dict[str, HeldState] | None = None
    # Imports that ended since the executor's last answer.
    kv_imports_done: list[ImportDone] = field(default_factory=list)


@dataclass(slots=True)
class RequestUpdate:
    """What one request gained from a step, for streaming to its client."""

    request: Request
    # Tokens appended to the request by this step (up to any stop condition they met).
    new_token_ids: list[int]
    # The executor's logprob records of those tokens (empty unless the request asked); with a
    # request's first token, those of its prompt's tokens first (prompt_logprobs).
    new_logprobs: Sequence[object]
    # The request ended with this step (a stop condition, or an error).
    finished: bool
    # Why the request ended in error, for its client.
    error: RequestError | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class StepUpdates:
    """What a step gave its requests: one record each for those that need their own (their
    first token, an error, an end), and a bulk of steady decodes that got one token each and
    go on."""

    updates: list[RequestUpdate] = field(default_factory=list)
    decoded_requests: list[Request] = field(default_factory=list)
    decoded_token_ids: list[int] = field(default_factory=list)
    # The decoded requests' delivery keys (Request.delivery_key), in the same order.
    decoded_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # Seconds between each token that came back in this step and the request's token before
    # it (requests with an earlier token; one figure per request, however many tokens it got).
    inter_token_gaps: list[float] = field(default_factory=list)
    # Bitmasks of steps in flight that can go now: their requests' earlier tokens are all in.
    late_bitmasks: list[LateBitmasks] = field(default_factory=list)
    # Speculative decoding: (request id, drafts sent, drafts accepted) of each verified entry.
    verified: list[tuple[str, int, int]] = field(default_factory=list)
    # K/V moves: offers this step's executor now serves (the transfer can start), and imports
    # that ended here, with the request each brought (None: it was cancelled meanwhile).
    offers_ready: list[str] = field(default_factory=list)
    imports_done: list[tuple[ImportDone, Request | None]] = field(default_factory=list)

    def __iter__(self) -> Iterator[RequestUpdate]:
        """Every update as a RequestUpdate (the bulk ones built on the way; for callers that
        do not need the speed)."""
        yield from self.updates
        for request, token in zip(self.decoded_requests, self.decoded_token_ids, strict=True):
            yield RequestUpdate(request, [token], [], False)
