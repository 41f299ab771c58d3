"""What travels between the planner and an executor for one step, as plain records.

The plan is a diff: a request the executor has not seen arrives whole, a continuing one carries
only its token count and new blocks, so a plan's size follows the step's work, not the length of
the conversations. The protobuf form is built by plan_codec.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler_service.core.errors import RequestError
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestPlan:
    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: SamplingParams
    num_prompt_tokens: int


@dataclass(slots=True)
class ContinuingRequestPlan:
    request_id: str
    num_scheduled_tokens: int
    new_block_ids: list[int]


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new_requests: list[NewRequestPlan] = field(default_factory=list)
    continuing_requests: list[ContinuingRequestPlan] = field(default_factory=list)
    dropped_request_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(
            r.num_scheduled_tokens for r in self.continuing_requests
        )

    @property
    def has_work(self) -> bool:
        return bool(self.new_requests or self.continuing_requests)


@dataclass(slots=True)
class StepOutput:
    """An executor's answer to one plan."""

    step_id: int
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # The executor's per-token logprob records, opaque to the planner: they pass through to the
    # client as they came (see service/output_stream.py).
    logprobs: dict[str, Sequence[object]] = field(default_factory=dict)
    rejected: dict[str, RequestError] = field(default_factory=dict)
    # Seconds the executor spent in the forward pass and sampling, and on the whole step.
    forward_time_s: float = 0.0
    step_time_s: float = 0.0
    # Set when the step's forward raised: no tokens, and the executor dropped the state of
    # every request the step ran (rejected entries excepted).
    failure: str | None = None


@dataclass(slots=True)
class RequestUpdate:
    """What one request gained from a step, for streaming to its client."""

    request: Request
    new_token_ids: list[int]
    # The executor's logprob records of those tokens (empty unless the request asked).
    new_logprobs: Sequence[object]
    # The request ended with this step (a stop condition, or an error).
    finished: bool
    # Why the request ended in error, for its client.
    error: RequestError | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id
