"""A trace's requests replayed over N simulated executors (--executors N): each request goes,
at its recorded arrival, where the scheduler's own router (core/router.py) sends it, and every
executor steps at its own pace with its own pipelined plans, as the engine drives them. Time is
the simulation's own throughout; moving queued requests between executors (work stealing) is
not reproduced."""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field, replace

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.router import DEFAULT_TOKENS_PER_REQUEST, route
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor
from scheduler_service.core.step_plan import StepOutput
from scheduler_service.replay.simulate import (
    REPLAY_EOS,
    Replayed,
    StepRecord,
    SyntheticModel,
    planned_step,
    rebuild_requests,
    record_result,
)
from scheduler_service.replay.step_cost import StepCost
from scheduler_service.replay.trace_reader import Timeline, TracedRequest


@dataclass(slots=True)
class _Lane:
    scheduler: Scheduler
    executor: SimulatedExecutor
    replayed: Replayed
    in_flight: deque[tuple[StepOutput, float, StepRecord]] = field(default_factory=deque)
    busy_until: float = 0.0


def replay_fleet(
    timelines: list[Timeline], config: SchedulerConfig, cost: StepCost, executors: int, depth: int = 2,
    tokens_per_request: int = DEFAULT_TOKENS_PER_REQUEST,
) -> list[Replayed]:
    traced = _first_placements(timelines)
    requests = rebuild_requests(traced, config.block_size)
    model = SyntheticModel(traced, requests)
    clock = 0.0
    lanes = [
        _Lane(
            Scheduler(config, eos_token_ids=(REPLAY_EOS,), clock=lambda: clock),
            SimulatedExecutor(
                config.num_kv_blocks, config.block_size, next_token=model.next_token, verify_kv=False,
                num_state_slots=config.num_state_slots,
            ),
            Replayed(f"executor {index}", config),
        )
        for index in range(executors)
    ]
    events: list[tuple[float, int, str, int]] = []
    for order, original in enumerate(traced):
        heapq.heappush(events, (original.arrival_s, order, "add", order))
        if original.aborted_s is not None:
            heapq.heappush(events, (original.aborted_s, order, "abort", order))
    placed: dict[int, _Lane] = {}
    while True:
        for lane in lanes:
            _plan(lane, clock, depth, cost)
        results = [(lane.in_flight[0][1], index) for index, lane in enumerate(lanes) if lane.in_flight]
        next_result = min(results, default=None)
        if events and (next_result is None or events[0][0] <= next_result[0]):
            at, _, kind, order = heapq.heappop(events)
            clock = max(clock, at)
            request = requests[order]
            if kind == "add":
                choice = route(request, [lane.scheduler for lane in lanes], tokens_per_request)
                lane = lanes[choice.index if choice is not None else 0]
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
        _apply(lanes[index], clock)
    return [lane.replayed for lane in lanes]


def _plan(lane: _Lane, clock: float, depth: int, cost: StepCost) -> None:
    scheduler = lane.scheduler
    while len(lane.in_flight) < depth:
        plan = scheduler.schedule()
        if not plan.has_work and not plan.dropped_request_ids:
            return
        step = planned_step(scheduler, plan, clock, 0.0)
        lane.busy_until = step.done_s = max(clock, lane.busy_until) + cost.seconds(step.prefill_tokens, step.decode_tokens)
        lane.in_flight.append((lane.executor.execute(plan), lane.busy_until, step))


def _apply(lane: _Lane, clock: float) -> None:
    output, _, step = lane.in_flight.popleft()
    record_result(lane.replayed, lane.scheduler, lane.scheduler.update(output).updates, step, clock)


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
