"""Which executor a request goes to: the one whose KV cache holds, or is about to hold, most of
its prompt, weighed against how busy each executor is.

The scheduler hands out every block of every executor, so this is exact (no approximate radix
index as in SGLang's router or Dynamo's KV router). For each executor that can take the request:

    score = affinity - tokens_per_request * load

- affinity: leading prompt tokens whose KV the executor's prefix cache holds, or that requests
  already placed on it will compute (Scheduler.affinity);
- load: requests placed on it, running or waiting;
- tokens_per_request (--route-tokens-per-request): how many cached prompt tokens one more
  request in an executor's queue is worth. 0 routes by prefix alone; a large value routes by
  load alone.

The highest score wins; ties go to the executor with the most free blocks, then the one caching
the fewest blocks (so unrelated prefixes spread out), then the first listed. An executor whose
KV cache could never hold the request is not a candidate.

Under a policy where priority preempts (priority, fair), an executor where the request would
start at once comes before every other, whatever the scores: one with a seat to spare, or one
running a request it preempts (policy.preempts) with no request of its priority or higher queued
ahead of it. A high-priority request arriving at a fleet
whose batches are full thus goes where it can take a lower-priority request's place, not where
the batch is full of its equals.

A sibling choice of a prompt (Request.fork_of) goes where its first choice is, whatever the
scores, when it would fork there from that prompt's computation instead of repeating it
(Scheduler.may_fork); else, as after its executor was lost, it is routed like any request.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_service.core.policy import Policy, preempts
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler

# One more queued request outweighs 32 cached prompt tokens: a long shared prefix keeps its
# requests together until their executor is well ahead of the others, a short one hardly counts.
DEFAULT_TOKENS_PER_REQUEST = 32


@dataclass(slots=True, frozen=True)
class RouteChoice:
    index: int
    affinity: int
    score: int


def route(
    request: Request,
    candidates: Sequence[Scheduler],
    tokens_per_request: int = DEFAULT_TOKENS_PER_REQUEST,
) -> RouteChoice | None:
    """The candidate to place the request on (by index), or None when none can hold it."""
    best: tuple[bool, int, int, int, int] | None = None
    choice: RouteChoice | None = None
    for index, scheduler in enumerate(candidates):
        if request.num_tokens >= scheduler.config.max_seq_len:
            continue
        if request.fork_of and scheduler.may_fork(request):
            affinity = scheduler.affinity(request)
            return RouteChoice(index, affinity, affinity - tokens_per_request * scheduler.load)
        affinity = scheduler.affinity(request)
        score = affinity - tokens_per_request * scheduler.load
        kv = scheduler.kv
        key = (_starts_at_once(request, scheduler), score, kv.num_free_blocks, -kv.num_cached_blocks, -index)
        if best is None or key > best:
            best, choice = key, RouteChoice(index, affinity, score)
    return choice


def _starts_at_once(request: Request, scheduler: Scheduler) -> bool:
    """Whether the request would start at the next step there, under a policy where priority
    preempts (True for every executor under FCFS, which leaves the choice to the scores)."""
    config = scheduler.config
    if config.policy is Policy.FCFS or len(scheduler.running) + scheduler.num_waiting < config.max_num_seqs:
        return True
    # Requests queued there of its priority or higher go first.
    if scheduler.waiting and scheduler.waiting.peek().priority <= request.priority:
        return False
    return any(not r.moving and preempts(request, r, config.policy, scheduler.share) for r in scheduler.running)
