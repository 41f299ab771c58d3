"""How long until a request's first token, were it queued on an executor now: the step-cost
model behind deadline admission (core/deadline_admission.py).

The executor's seats (max_num_seqs) are simulated in steps: each running request keeps its seat
until it is expected to end (running_seats), each request queued ahead of this one takes the
first seat to free for its prompt and expected output, and this request takes the next, then
computes its prompt. The token budget bounds it too: the prompts ahead share
max_num_batched_tokens a step with the decodes, and under a step token limit (--target-itl-ms)
what that leaves them (core/prefill_share.py). Steps cost what the executor's StepTimer says a
step of that many tokens costs.

Expected output: max_tokens left when the request ignores EOS, else the smaller of that and the
mean output of the requests finished so far.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scheduler_service.core.policy import Policy, rank
from scheduler_service.core.prefill_share import prefill_within
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.stop_checker import length_limit


@dataclass(slots=True, frozen=True)
class Forecast:
    # Seconds from now to the request's first token.
    ttft_s: float
    # Seconds per step while it decodes (its time per output token).
    step_s: float


def expected_output(request: Request, mean_output: float, max_seq_len: int) -> float:
    """Tokens the request is expected still to generate."""
    left = length_limit(request, max_seq_len) - request.num_tokens
    if request.sampling.ignore_eos:
        return max(1.0, left)
    return max(1.0, min(left, mean_output - request.num_output_tokens))


def forecast_ttft(
    scheduler: Scheduler,
    request: Request,
    step_seconds: Callable[[float], float],
    mean_output: float,
    step_token_limit: int | None = None,
) -> Forecast:
    config = scheduler.config
    budget = config.max_num_batched_tokens
    ahead = queued_ahead(scheduler, request)
    seats = [0.0] * max(0, config.max_num_seqs - len(scheduler.running))
    seats += running_seats(scheduler.running, mean_output, budget, config.max_seq_len)
    heapq.heapify(seats)
    prompts = sum(r.num_uncomputed_tokens for r in scheduler.running if r.in_prefill)
    for queued in ahead:
        prompts += queued.num_uncomputed_tokens
        start = heapq.heappop(seats) if seats else 0.0
        heapq.heappush(seats, start + math.ceil(queued.num_uncomputed_tokens / budget) + expected_output(queued, mean_output, config.max_seq_len))
    start = heapq.heappop(seats) if seats else 0.0
    own_prompt = request.num_uncomputed_tokens
    decodes = min(config.max_num_seqs, len(scheduler.running) + len(ahead) + 1)
    prefill_room = max(1, prefill_within(budget - decodes, decodes, step_token_limit))
    steps = max(start + math.ceil(own_prompt / budget), math.ceil((prompts + own_prompt) / prefill_room))
    prefill_per_step = min(prefill_room, (prompts + own_prompt) / max(steps, 1))
    step_s = step_seconds(decodes + prefill_per_step)
    # One step more: the plan in flight when it arrives runs first. Its size is not this
    # request's to spread: costed as one of decodes, not as a share of these prompts, which made
    # a forecast fall when a request queued ahead spread them over more steps.
    return Forecast(steps * step_s + step_seconds(decodes), step_seconds(decodes))


def running_seats(running: Sequence[Request], mean_output: float, budget: int, max_seq_len: int) -> list[float]:
    """Steps until each running request frees its seat (running_ends)."""
    return [steps for steps, _ in running_ends(running, mean_output, budget, max_seq_len)]


def running_ends(
    running: Sequence[Request], mean_output: float, budget: int, max_seq_len: int
) -> list[tuple[float, Request]]:
    """Steps until each running request frees its seat, with the request taken to free it. One
    that ignores EOS runs to its length limit. Of one that may stop sooner only the mean output
    is known, and the mean less what it has would be wrong twice: with lengths heavy-tailed a
    request past the mean is expected to run on, not to end at once; and a seat frees at the
    soonest of several random ends, sooner than the soonest expected end. n such requests end, in
    steady state, one every mean / n steps (Little's law): the k-th to end is taken to end at
    k x mean / n, none past its limit."""
    seats = []
    open_ended = []
    for request in running:
        prompt_steps = math.ceil(request.num_uncomputed_tokens / budget)
        left = max(1, length_limit(request, max_seq_len) - request.num_tokens)
        if request.sampling.ignore_eos:
            seats.append((prompt_steps + left, request))
        else:
            open_ended.append((left, prompt_steps, request))
    open_ended.sort(key=lambda entry: entry[:2])
    for k, (left, prompt_steps, request) in enumerate(open_ended, 1):
        seats.append((prompt_steps + min(left, k * mean_output / len(open_ended)), request))
    return seats


def queued_ahead(scheduler: Scheduler, request: Request) -> Sequence[Request]:
    """The requests queued on this executor that would be admitted before this one: under FCFS
    all; under priority those of a better rank; under fair its own tenant's of a better rank, and
    from each other tenant with requests on this executor as many as the round robin serves for
    them (by weight), fewer from one served more than its own, whether queued now or sent while
    this one waits: a tenant served less than its share goes first with every request it sends."""
    queued = scheduler.queued
    policy = scheduler.config.policy
    if policy is Policy.FCFS:
        return queued
    mine = rank(request, policy)
    if policy is Policy.PRIORITY:
        return [q for q in queued if rank(q, policy) < mine]
    share = scheduler.share
    own = [q for q in queued if q.tenant == request.tenant and rank(q, policy) < mine]
    own_weight = share.weight_of(request.tenant)
    # Every other tenant with requests here, queued or running: one whose queue is empty now
    # takes its turns with what it sends while this request waits.
    by_tenant: dict[str, list[Request]] = {r.tenant: [] for r in scheduler.requests.values() if r.tenant != request.tenant}
    for q in queued:
        if q.tenant != request.tenant:
            by_tenant.setdefault(q.tenant, []).append(q)
    ahead = list(own)
    for tenant, theirs in by_tenant.items():
        turns = (len(own) + 1) * share.weight_of(tenant) / own_weight
        if share.counter(tenant) > share.counter(request.tenant):
            turns -= 1
        turns = max(0, math.ceil(turns))
        # Turns beyond its queue are taken by requests it has yet to send, sized as this one.
        ahead += theirs[:turns] + [request] * max(0, turns - len(theirs))
    return ahead
