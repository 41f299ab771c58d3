"""Requests replayed over N simulated executors (--executors N, and synthesised traces): each
request takes, at its arrival, the engine's path: the scheduler's own router (core/router.py)
picks an executor, deadline admission (core/deadline_admission.py) keeps that choice, places it
where its TTFT deadline or per-token target is better met, or refuses it, forecasting with each
executor's StepTimer as the engine's lanes learn it from the steps they ran; one FairShare keeps
the fair policy's books over every executor. Every executor steps at its own pace with its own
pipelined plans, as the engine drives them. Time is the simulation's own throughout; moving
queued requests between executors (work stealing) and tenants' quotas are not reproduced."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.deadline_admission import Candidate, DeadlineAdmission
from scheduler_service.core.errors import AdmissionRefused
from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.router import DEFAULT_TOKENS_PER_REQUEST, route
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor
from scheduler_service.core.step_plan import StepOutput
from scheduler_service.core.step_timer import StepTimer
from scheduler_service.core.suffix_proposer import SuffixTable
from scheduler_service.replay.simulate import (
    REPLAY_EOS,
    Replayed,
    StepRecord,
    SyntheticModel,
    planned_step,
    rebuild_requests,
    record_result,
    recorded_acceptance,
)
from scheduler_service.replay.step_cost import StepCost
from scheduler_service.replay.trace_reader import Timeline, TracedRequest


@dataclass(slots=True)
class _Lane:
    scheduler: Scheduler
    executor: SimulatedExecutor
    replayed: Replayed
    # The step time by tokens computed, learned from the steps run, as the engine's lane does.
    step_timer: StepTimer = field(default_factory=StepTimer)
    # (output, tokens computed, seconds the executor spent on it, record) of each plan on the wire.
    in_flight: deque[tuple[StepOutput, int, float, StepRecord]] = field(default_factory=deque)
    busy_until: float = 0.0


@dataclass(slots=True)
class FleetRun:
    replays: list[Replayed]
    # Every request replayed, in arrival order, with its times on the simulation's clock.
    requests: list[Request]
    # Those refused at arrival (deadline admission), and why.
    refused: list[tuple[Request, AdmissionRefused]] = field(default_factory=list)


def replay_fleet(
    timelines: list[Timeline], config: SchedulerConfig, cost: StepCost, executors: int, depth: int = 2,
    tokens_per_request: int = DEFAULT_TOKENS_PER_REQUEST, target_itl_s: float = 0.0,
) -> list[Replayed]:
    return replay_requests(
        _first_placements(timelines), config, cost, executors, depth, tokens_per_request,
        acceptance=recorded_acceptance(timelines), target_itl_s=target_itl_s,
    ).replays


def replay_requests(
    traced: Sequence[TracedRequest], config: SchedulerConfig, cost: StepCost, executors: int, depth: int = 2,
    tokens_per_request: int = DEFAULT_TOKENS_PER_REQUEST, weight_of: Callable[[str], float] = lambda tenant: 1.0,
    acceptance: float = 0.0, target_itl_s: float = 0.0,
) -> FleetRun:
    """Replays requests (in arrival order) until every one admitted has ended; weight_of gives
    each tenant's weight under the fair policy, acceptance the share of drafts a recording that
    speculated accepted (SyntheticModel), target_itl_s the scheduler's --target-itl-ms in
    seconds (0: none), each executor's step token limit read from its timer as a lane does."""
    requests = rebuild_requests(traced, config.block_size)
    model = SyntheticModel(traced, requests, acceptance)
    share = FairShare(weight_of)
    # One table of recent outputs for every executor, as the engine has (suffix proposer).
    suffixes = SuffixTable()
    admission = DeadlineAdmission()
    clock = 0.0
    lanes = [
        _Lane(
            Scheduler(config, eos_token_ids=(REPLAY_EOS,), clock=lambda: clock, share=share, suffixes=suffixes),
            SimulatedExecutor(
                config.num_kv_blocks, config.block_size, next_token=model.next_token, verify_kv=False,
                num_state_slots=config.num_state_slots, draft_token=model.draft_token,
            ),
            Replayed(f"executor {index}", config),
        )
        for index in range(executors)
    ]
    run = FleetRun([lane.replayed for lane in lanes], requests)
    events: list[tuple[float, int, str, int]] = []
    for order, original in enumerate(traced):
        heapq.heappush(events, (original.arrival_s, order, "add", order))
        if original.aborted_s is not None:
            heapq.heappush(events, (original.aborted_s, order, "abort", order))
    placed: dict[int, _Lane] = {}
    while True:
        for lane in lanes:
            _plan(lane, clock, depth, cost, target_itl_s)
        results = [(lane.in_flight[0][3].done_s, index) for index, lane in enumerate(lanes) if lane.in_flight]
        next_result = min(results, default=None)
        if events and (next_result is None or events[0][0] <= next_result[0]):
            at, _, kind, order = heapq.heappop(events)
            clock = max(clock, at)
            request = requests[order]
            if kind == "add":
                request.arrival_time = clock
                choice = route(request, [lane.scheduler for lane in lanes], tokens_per_request)
                index = choice.index if choice is not None else 0
                if admission.judges(request):
                    candidates = [Candidate.of_lane(lane.scheduler, lane.step_timer, target_itl_s) for lane in lanes]
                    try:
                        index = admission.choose(request, candidates, index, clock)
                    except AdmissionRefused as refused:
                        run.refused.append((request, refused))
                        continue
                lane = lanes[index]
                lane.scheduler.add_request(request)
                lane.replayed.arrival_s[request.request_id] = at
                placed[order] = lane
            elif order in placed and not request.is_finished:
                placed[order].scheduler.abort(request.request_id)
                placed[order].replayed.finished_s[request.request_id] = at
            continue
        if next_result is None:
            break
        done, index = next_result
        clock = max(clock, done)
        _apply(lanes[index], clock, admission)
    return run


def _plan(lane: _Lane, clock: float, depth: int, cost: StepCost, target_itl_s: float) -> None:
    scheduler = lane.scheduler
    while len(lane.in_flight) < depth:
        plan = scheduler.schedule(lane.step_timer.step_token_limit(target_itl_s))
        if not plan.has_work and not plan.dropped_request_ids:
            return
        step = planned_step(scheduler, plan, clock, 0.0)
        seconds = cost.seconds(step.prefill_tokens, step.decode_tokens)
        lane.busy_until = step.done_s = max(clock, lane.busy_until) + seconds
        lane.in_flight.append((lane.executor.execute(plan), plan.num_scheduled_tokens, seconds, step))


def _apply(lane: _Lane, clock: float, admission: DeadlineAdmission) -> None:
    output, tokens, seconds, step = lane.in_flight.popleft()
    if tokens:
        lane.step_timer.observe(tokens, seconds)
    updates = lane.scheduler.update(output)
    record_result(lane.replayed, lane.scheduler, updates, step, clock)
    for update in updates.updates:
        # As the engine: the mean output its forecasts assume is learned from requests that
        # ended by themselves.
        if update.finished and update.request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            admission.finished(update.request)


def _first_placements(timelines: list[Timeline]) -> list[TracedRequest]:
    """Each request once, as it first arrived (a request moved or recomputed elsewhere appears
    in several timelines), in arrival order; how it ended is taken from its last timeline."""
    first: dict[str, TracedRequest] = {}
    for timeline in timelines:
        for request in timeline.requests.values():
            if request.request_id not in first:
                first[request.request_id] = replace(request)
            elif request.finish not in (None, "left"):
                kept = first[request.request_id]
                kept.finish, kept.outputs, kept.aborted_s = request.finish, request.prior_outputs + request.outputs, request.aborted_s
    return sorted(first.values(), key=lambda r: r.arrival_s)
