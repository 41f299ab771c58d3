"""One Scheduler and a SimulatedExecutor in lockstep on a fake clock, the block books audited
against the executor's after every step, and the tokens each request computed counted by
step: the driver of the tenant, priority and deadline tests."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from scheduler_service.core.audit import audit_executor
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor
from scheduler_service.core.step_plan import StepPlan
from tests.helpers.sched_harness import HandleBook

STEP_S = 0.01


@dataclass(slots=True)
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Lockstep:
    scheduler: Scheduler
    executor: SimulatedExecutor
    clock: FakeClock
    book: HandleBook = field(default_factory=HandleBook)
    # Every request ever added, by id.
    requests: dict[str, Request] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    # The step (1-based) in which each request finished.
    finished_at: dict[str, int] = field(default_factory=dict)
    plans: list[StepPlan] = field(default_factory=list)
    # Tokens computed per request id, one dict per step.
    work: list[dict[str, int]] = field(default_factory=list)

    @classmethod
    def of(cls, config: SchedulerConfig, share: FairShare | None = None) -> Lockstep:
        clock = FakeClock()
        executor = SimulatedExecutor(config.num_kv_blocks, config.block_size, num_state_slots=config.num_state_slots)
        return cls(Scheduler(config, clock=clock, share=share), executor, clock)

    def add(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.requests[request.request_id] = request
            self.scheduler.add_request(request)

    def step(self, arrivals: Iterable[Request] = ()) -> StepPlan:
        """Adds the arrivals, plans a step, runs it and takes its result; returns the plan."""
        self.add(arrivals)
        plan = self.scheduler.schedule()
        plan.want_held_requests = True
        self.work.append(self.book.scheduled(plan))
        output = self.executor.execute(plan)
        self.clock.now += STEP_S
        for update in self.scheduler.update(output):
            self.outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
            assert update.error is None, update.error
            if update.finished:
                self.finished_at[update.request_id] = len(self.work)
        self.plans.append(plan)
        assert output.held_requests is not None
        assert audit_executor(self.scheduler, output.held_requests) == [], f"step {len(self.work)}"
        return plan

    def run_until_done(self, max_steps: int = 2000) -> None:
        while self.scheduler.has_unfinished():
            assert len(self.work) < max_steps, "the scheduler did not finish"
            self.step()
        assert self.scheduler.kv.num_free_blocks == self.scheduler.config.num_kv_blocks

    def tokens_by_tenant(self, first_step: int, last_step: int) -> dict[str, int]:
        """Tokens computed for each tenant in steps first_step..last_step (1-based, inclusive)."""
        totals: dict[str, int] = {}
        for work in self.work[first_step - 1 : last_step]:
            for request_id, tokens in work.items():
                tenant = self.requests[request_id].tenant
                totals[tenant] = totals.get(tenant, 0) + tokens
        return totals
