"""Drives a Scheduler against the SimulatedExecutor and records each step as one line."""

from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.errors import RequestError
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import (
    FailFn,
    SimulatedExecutor,
    TokenFn,
    default_next_token,
)
from scheduler_service.core.step_plan import StepPlan
from scheduler_service.replay.scenarios import Scenario, scenario_request


def make_request(index: int, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    """Distinct prompts per index, so no two requests share cached blocks by accident."""
    prompt = list(range(100 * index + 1, 100 * index + prompt_len + 1))
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(f"r{index}", prompt, sampling, priority=priority)


class HandleBook:
    """Request ids of the decode handles plans use, learnt from the plans that send them."""

    def __init__(self) -> None:
        self._ids: dict[int, str] = {}

    def scheduled(self, plan: StepPlan) -> dict[str, int]:
        """Tokens computed per request id: new ones first, then continuing ones and decodes by
        handle (both in the order the planner met them)."""
        for new in plan.new_requests:
            self._ids[new.handle] = new.request_id
        work = {r.request_id: r.num_scheduled_tokens for r in plan.new_requests}
        work |= {r.request_id: r.num_scheduled_tokens for r in plan.continuing_requests}
        work |= {self._ids[h]: 1 for h in plan.decode_handles}
        return work


def scheduled_ids(plan: StepPlan, book: HandleBook) -> list[str]:
    """Ids of the requests a plan computes for, new ones first."""
    return list(book.scheduled(plan))


def describe_step(plan: StepPlan, scheduler: Scheduler, book: HandleBook, order: list[str]) -> str:
    """'r0:5 r1:1 | W: r2 | R: r0 r1': scheduled tokens per request (new ones first, then the
    others in running order as planned), then the queues after."""
    work = book.scheduled(plan)
    new = [r.request_id for r in plan.new_requests]
    ranked = new + sorted(set(work) - set(new), key=lambda i: order.index(i) if i in order else len(order))
    steps = [f"{request_id}:{work[request_id]}" for request_id in ranked]
    waiting = " ".join(r.request_id for r in scheduler.queued)
    running = " ".join(r.request_id for r in scheduler.running)
    return f"{' '.join(steps)} | W: {waiting} | R: {running}".replace("  ", " ").strip()


@dataclass
class Run:
    scheduler: Scheduler
    executor: SimulatedExecutor
    lines: list[str] = field(default_factory=list)
    plans: list[StepPlan] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finished_at: dict[str, int] = field(default_factory=dict)
    errors: dict[str, RequestError] = field(default_factory=dict)


def run(
    config: SchedulerConfig,
    arrivals: dict[int, list[Request]],
    max_steps: int = 500,
    fail_step: FailFn | None = None,
    before_step: Callable[[int, Scheduler], None] | None = None,
    next_token: TokenFn = default_next_token,
    step_token_limit: int | None = None,
) -> Run:
    """Adds arrivals[n] before planning step n (1-based) and runs until every request finished.
    before_step(n, scheduler) runs after step n's arrivals, before it is planned; every step is
    planned under step_token_limit (Scheduler.schedule)."""
    executor = SimulatedExecutor(
        config.num_kv_blocks, config.block_size, next_token, fail_step=fail_step, num_state_slots=config.num_state_slots
    )
    result = Run(Scheduler(config), executor)
    book = HandleBook()
    step = 0
    while result.scheduler.has_unfinished() or any(s > step for s in arrivals):
        step += 1
        assert step <= max_steps, "scheduler did not finish"
        for request in arrivals.get(step, []):
            result.scheduler.add_request(request)
        if before_step is not None:
            before_step(step, result.scheduler)
        plan = result.scheduler.schedule(step_token_limit)
        order = [r.request_id for r in result.scheduler.running]
        updates = result.scheduler.update(result.executor.execute(plan))
        for update in updates:
            result.outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finished:
                result.finished_at[update.request_id] = step
            if update.error is not None:
                result.errors[update.request_id] = update.error
        result.plans.append(plan)
        result.lines.append(describe_step(plan, result.scheduler, book, order))
    return result


def run_seed(scenario: Scenario) -> Run:
    """A built-in scenario of scheduler_service.replay, through this harness."""
    arrivals = {step: [scenario_request(*spec) for spec in specs] for step, specs in scenario.arrivals.items()}
    return run(scenario.config, arrivals)
