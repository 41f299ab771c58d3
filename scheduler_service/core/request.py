"""One generation request as the scheduler tracks it."""

import enum
import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.structured_output import TokenConstraint
from scheduler_service.core.tenants import DEFAULT_TENANT


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class ProgressHome(Protocol):
    """Where a request's progress lives while it decodes in bulk (a DecodeSet): one slot of
    these arrays is its."""

    computed: np.ndarray
    pending: np.ndarray
    # NaN: no token yet.
    last_token_at: np.ndarray

    def flush_tokens(self, slot: int, tokens: list[int]) -> None:
        """Appends the tokens the slot holds for the request to its list, and empties the slot's."""


@dataclass(slots=True, eq=False)
class Request:
    """Compared by identity: a request id may be reused once the request has finished.

    Its progress (num_computed_tokens, num_pending_outputs, last_token_at) has one home at a
    time: these fields, or while it decodes in bulk its slot in a DecodeSet's arrays, which plan
    and apply a step for all their requests at once. move_progress moves it and makes the request
    an _InDecodeSet meanwhile, whose properties read and write that slot under the same names:
    whoever reads a request's progress gets the true figure without asking where it decodes,
    and a request planned one entry at a time pays nothing for it (plain fields, no property).
    Its newest tokens wait in that slot too, and token_ids takes them in when read.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Lower runs first under the priority policy.
    priority: int = 0
    # Mixed into every block hash: requests share cached prefixes only under the same salt.
    cache_salt: bytes = b""
    # Who sent it (core/tenants.py): its API key's tenant, or x-splitserve-tenant.
    tenant: str = DEFAULT_TENANT
    # Seconds from arrival to its first token that its client accepts (GenerateRequest's
    # ttft_deadline_ms); 0: none.
    ttft_deadline_s: float = 0.0
    # Target seconds between its tokens (tpot_target_ms); 0: none.
    tpot_target_s: float = 0.0
    # When it arrived (the scheduler's clock), for TTFT and latency.
    arrival_time: float = 0.0
    # Tie-breaker among equal priorities: arrival order across the whole service (set by whoever
    # first queues it; -1 until then).
    arrival_index: int = -1
    # Prompt followed by every output token received so far.
    token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV the executor has (or will have, once the steps in flight run). Progress:
    # see the class's docstring.
    num_computed_tokens: int = 0
    # Tokens scheduled to be sampled whose values have not come back yet: with pipelining the
    # next step is planned before the last result arrives.
    num_pending_outputs: int = 0
    # Tokens to compute before the first sample of this admission (the prompt, or prompt and
    # earlier output when resuming after preemption).
    prefill_target: int = 0
    # Prompt tokens served from the prefix cache at first admission.
    num_cached_tokens: int = 0
    # Names it in plans' decode_handles on the executor it was last sent to (set when sent).
    handle: int = 0
    # Times it lost its blocks and went back to waiting (also its epoch: a result planned
    # before a preemption is stale).
    num_preemptions: int = 0
    # Times an executor was lost while this request ran on it: a request that keeps taking its
    # executor down is given up on rather than retried forever.
    num_executor_losses: int = 0
    # Set when a step that ran this request failed in the executor: it is recomputed in steps of
    # its own until it samples again, so a second failure is its own and not a neighbour's.
    retry_alone: bool = False
    status: RequestStatus = RequestStatus.WAITING
    # Why it finished, and the stop string that ended it (when one did).
    finish_reason: FinishReason | None = None
    stop_reason: str | None = None
    # First admission, first output token and finish, on the scheduler's clock.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # When its last token came back, on the scheduler's clock, for the inter-token latency.
    last_token_at: float | None = None
    # Hashes of the leading full blocks of token_ids a prefix hit may cover, for blocks of
    # prefix_hashes_block_size tokens: computed once and extended as tokens are added, not
    # re-hashed at every admission attempt or routing decision.
    prefix_hashes: list[bytes] = field(default_factory=list)
    prefix_hashes_block_size: int = 0
    # Where the service layer sends this request's output (its client's stream); opaque to the
    # planner, and kept here so that no second table of requests by id has to mirror this one.
    output: object = None
    # An opaque number the service layer routes this request's tokens by, handed back with the
    # steady decodes' tokens as an array (StepUpdates.decoded_keys), so that an owner sending
    # tokens on in bulk (the planner, to its front-ends) need not look at each request.
    delivery_key: int = 0
    # Where it stands in its grammar (sampling.structured_output), advanced with every token it
    # receives; set by the planner when it takes the request, from the tokens it has.
    grammar: TokenConstraint | None = None
    # The sibling choice (same prompt, SamplingParams.n > 1) whose prompt K/V this request takes
    # instead of computing it (Scheduler: a fork), when both are on one executor; empty: none.
    fork_of: str = ""
    # Set while it is to leave this executor with its K/V (planner/kv_moves.py): it is planned
    # no more here, and goes once the tokens of the steps in flight are in.
    moving: bool = False
    # K/V it lost (a preemption, a lost executor, a failed transfer), and why: the tokens its
    # next admission computes again, short of a prefix hit, count as recomputed for that reason.
    num_lost_tokens: int = 0
    lost_reason: str = ""
    # Where its progress lives while it decodes in bulk, and its slot there (see move_progress).
    _home: ProgressHome | None = field(default=None, init=False, repr=False)
    _slot: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    def move_progress(self, home: ProgressHome | None, slot: int = 0) -> None:
        """Makes `home` (at `slot`) the home of its progress, or its own fields when None,
        carrying the figures over (DecodeSet calls it on join and leave)."""
        computed, pending, last = self.num_computed_tokens, self.num_pending_outputs, self.last_token_at
        if self._home is not None:
            # Leaving (or changing) its set: its list takes the tokens waiting in its slot.
            self._home.flush_tokens(self._slot, token_list_of(self))
        self.__class__ = Request if home is None else _InDecodeSet
        self._home, self._slot = home, slot
        self.num_computed_tokens, self.num_pending_outputs, self.last_token_at = computed, pending, last

    def lose_kv(self, reason: str) -> None:
        """Its computed K/V is gone (counted as recomputed for reason when computed again)."""
        if self.num_computed_tokens > self.num_lost_tokens:
            self.num_lost_tokens, self.lost_reason = self.num_computed_tokens, reason
        self.num_computed_tokens = 0

    @property
    def ttft_deadline(self) -> float:
        """When its first token is due, on the scheduler's clock; inf: no deadline."""
        return self.arrival_time + self.ttft_deadline_s if self.ttft_deadline_s else math.inf

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.prefill_target

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens + self.num_pending_outputs - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


# The list Request.token_ids holds, under the property _InDecodeSet puts over it.
_TOKEN_IDS = Request.token_ids


def token_list_of(request: Request) -> list[int]:
    """The request's own token list, without the tokens its DecodeSet slot holds (for that set
    to hand them over)."""
    tokens: list[int] = _TOKEN_IDS.__get__(request)
    return tokens


class _InDecodeSet(Request):
    """A request while it decodes in bulk: its progress is its slot of its DecodeSet's arrays
    (the fields of the same names are shadowed and unused until it leaves), and its tokens are
    its list followed by those its slot holds, which the list takes in when token_ids is read."""

    __slots__ = ()
    _home: ProgressHome

    @property  # type: ignore[override]
    def token_ids(self) -> list[int]:
        tokens = token_list_of(self)
        self._home.flush_tokens(self._slot, tokens)
        return tokens

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        # The whole list is given: the slot's tokens are dropped, not added to it.
        self._home.flush_tokens(self._slot, [])
        _TOKEN_IDS.__set__(self, value)

    @property  # type: ignore[override]
    def num_computed_tokens(self) -> int:
        return int(self._home.computed[self._slot])

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self._home.computed[self._slot] = value

    @property  # type: ignore[override]
    def num_pending_outputs(self) -> int:
        return int(self._home.pending[self._slot])

    @num_pending_outputs.setter
    def num_pending_outputs(self, value: int) -> None:
        self._home.pending[self._slot] = value

    @property  # type: ignore[override]
    def last_token_at(self) -> float | None:
        last = float(self._home.last_token_at[self._slot])
        return None if math.isnan(last) else last

    @last_token_at.setter
    def last_token_at(self, value: float | None) -> None:
        self._home.last_token_at[self._slot] = math.nan if value is None else value
