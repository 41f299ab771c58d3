"""The first token of every request queued on an executor, were one more queued now: the check
behind deadline admission's promises (core/deadline_admission.py).

forecast_ttft (core/ttft_forecast.py) judges a new request by the requests ahead of it. But
served before requests already admitted (an earlier deadline under priority and fair, its
tenant's turn under fair) it also delays them, and under fair the order moves while they wait:
a tenant with more requests running is charged more a step, and its queued requests fall behind
the others'. Here the seats are simulated over the whole queue, the new request in it, in the
order the policy admits it: under FCFS arrival, under priority rank, under fair at each seat
that frees the tenant with the smallest counter, every counter charged as its tenant's requests
are computed (their prompts as they start, a token a step while they run).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_service.core.policy import Policy, rank
from scheduler_service.core.prefill_share import prefill_within
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.ttft_forecast import expected_output, running_ends


@dataclass(slots=True, frozen=True)
class QueueForecast:
    # The queued requests and the new one, in the order they are forecast to be admitted.
    order: list[Request]
    # Forecast seconds from now to the first token of the new request and of each request with
    # a TTFT deadline admitted after it, by identity (the others' are not needed).
    ttft_s: dict[Request, float]

    def overtaken(self, request: Request) -> list[Request]:
        """The requests admitted after `request` (the new one): each was queued before it."""
        return self.order[next(i for i, r in enumerate(self.order) if r is request) + 1 :]


def forecast_queue(
    scheduler: Scheduler,
    request: Request,
    step_seconds: Callable[[float], float],
    mean_output: float,
    step_token_limit: int | None = None,
) -> QueueForecast:
    config = scheduler.config
    policy = config.policy
    fair = policy is Policy.FAIR
    budget = config.max_num_batched_tokens
    share = scheduler.share
    queued = scheduler.queued

    def arrival(r: Request) -> float:
        # Not yet numbered: it arrived after every queued request.
        return math.inf if r is request else r.arrival_index

    if policy is Policy.FCFS:
        ranked = [*queued, request]
    else:
        ranked = sorted([*queued, request], key=lambda r: (*rank(r, policy)[:2], arrival(r)))
    # One queue; under fair one per tenant, each by rank.
    queues: dict[str, list[Request]] = {}
    for r in ranked:
        queues.setdefault(r.tenant if fair else "", []).append(r)
    # Requests on seats, by tenant: under fair each is charged a token a step.
    seated = Counter(r.tenant for r in scheduler.running)
    weights = {tenant: share.weight_of(tenant) for tenant in {*queues, *seated}} if fair else {}
    counters = {tenant: share.counter(tenant) for tenant in weights}
    if fair and len(queues[request.tenant]) == 1:
        # Lifted as it queues into an empty queue (FairShare.queued): to the least served of the
        # other tenants with requests queued, else running.
        for active in (queued, scheduler.running):
            others = [counters[r.tenant] for r in active if r.tenant != request.tenant]
            if others:
                counters[request.tenant] = max(counters[request.tenant], min(others))
                break
    # Seats as (free at step, tie-breaker, tenant of the request freeing it; None: free now).
    ties = itertools.count()
    seats: list[tuple[float, int, str | None]] = [
        (0.0, next(ties), None) for _ in range(max(0, config.max_num_seqs - len(scheduler.running)))
    ]
    running = running_ends(scheduler.running, mean_output, budget, config.max_seq_len)
    seats += [(steps, next(ties), r.tenant) for steps, r in running]
    heapq.heapify(seats)
    prompts = sum(r.num_uncomputed_tokens for r in scheduler.running if r.in_prefill)
    heads = dict.fromkeys(queues, 0)
    clock = 0.0
    order: list[Request] = []
    ttft_s: dict[Request, float] = {}
    while heads:
        start, _, leaving = heapq.heappop(seats) if seats else (clock, 0, None)
        if fair:
            for tenant, count in seated.items():
                counters[tenant] += count * (start - clock) / weights[tenant]
        clock = start
        if leaving is not None:
            seated[leaving] -= 1
        queue = min(heads, key=lambda t: (counters[t], arrival(queues[t][heads[t]]))) if fair else ""
        admitted = queues[queue][heads[queue]]
        heads[queue] += 1
        if heads[queue] == len(queues[queue]):
            del heads[queue]
        own_prompt = admitted.num_uncomputed_tokens
        if fair:
            counters[admitted.tenant] += own_prompt / weights[admitted.tenant]
        seated[admitted.tenant] += 1
        ends = start + math.ceil(own_prompt / budget) + expected_output(admitted, mean_output, config.max_seq_len)
        heapq.heappush(seats, (ends, next(ties), admitted.tenant))
        if admitted is request or (request in ttft_s and admitted.ttft_deadline_s):
            # As forecast_ttft judges a request with those before it in this order ahead.
            decodes = min(config.max_num_seqs, len(scheduler.running) + len(order) + 1)
            prefill_room = max(1, prefill_within(budget - decodes, decodes, step_token_limit))
            steps = max(start + math.ceil(own_prompt / budget), math.ceil((prompts + own_prompt) / prefill_room))
            prefill_per_step = min(prefill_room, (prompts + own_prompt) / max(steps, 1))
            ttft_s[admitted] = steps * step_seconds(decodes + prefill_per_step) + step_seconds(decodes)
        prompts += own_prompt
        order.append(admitted)
    return QueueForecast(order, ttft_s)
