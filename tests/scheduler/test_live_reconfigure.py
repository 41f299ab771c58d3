"""Knobs turned on a running scheduler (the Admin API's UpdateSchedulingConfig) take effect from
the next step: the waiting queue takes the new order at once, the next plan the new limits."""

from dataclasses import replace

import pytest

from scheduler_service.core.config import SchedulerConfig, SchedulingKnobs
from scheduler_service.core.policy import Policy, StepMode
from scheduler_service.core.scheduler import Scheduler
from tests.helpers.sched_harness import make_request, run


def config(**overrides: object) -> SchedulerConfig:
    base: dict[str, object] = dict(num_kv_blocks=64, block_size=4, max_model_len=512)
    base.update(overrides)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def arrivals() -> dict[int, list]:
    # One runs at a time; three wait, queued FCFS against their priorities.
    return {1: [make_request(0, 4, 6)], 2: [make_request(1, 4, 2, priority=5), make_request(2, 4, 2, priority=1), make_request(3, 4, 2, priority=3)]}


def start_order(lines: list[str]) -> list[str]:
    """Request ids in the order they first ran."""
    seen: list[str] = []
    for line in lines:
        for work in line.split(" | ")[0].split():
            request_id = work.split(":")[0]
            if request_id not in seen:
                seen.append(request_id)
    return seen


def test_switching_to_priority_reorders_the_queue_from_the_next_step() -> None:
    cfg = config(max_num_seqs=1)

    def switch(step: int, scheduler: Scheduler) -> None:
        if step == 3:
            scheduler.reconfigure(replace(SchedulingKnobs.of(cfg), policy=Policy.PRIORITY))

    unchanged = run(cfg, arrivals())
    switched = run(cfg, arrivals(), before_step=switch)
    assert start_order(unchanged.lines) == ["r0", "r1", "r2", "r3"]
    assert switched.lines[1].endswith("W: r1 r2 r3 | R: r0")
    assert switched.lines[2].endswith("W: r2 r3 r1 | R: r0")
    assert start_order(switched.lines) == ["r0", "r2", "r3", "r1"]
    assert switched.outputs == unchanged.outputs


def test_a_smaller_token_budget_and_more_running_requests_apply_to_the_next_plan() -> None:
    cfg = config(max_num_batched_tokens=32, max_num_seqs=1)

    def tighten(step: int, scheduler: Scheduler) -> None:
        if step == 2:
            scheduler.reconfigure(replace(SchedulingKnobs.of(cfg), max_num_batched_tokens=8, max_num_seqs=4))

    result = run(cfg, {1: [make_request(0, 60, 3), make_request(1, 60, 3)]}, before_step=tighten)
    assert result.plans[0].num_scheduled_tokens == 32
    assert all(plan.num_scheduled_tokens <= 8 for plan in result.plans[1:])
    # Both run together once the limit allows it.
    assert any(line.endswith("R: r0 r1") for line in result.lines[1:])


def test_switching_mode_to_decode_first_holds_new_requests_back() -> None:
    cfg = config()

    def decode_first(step: int, scheduler: Scheduler) -> None:
        if step == 2:
            scheduler.reconfigure(replace(SchedulingKnobs.of(cfg), mode=StepMode.DECODE_FIRST))

    arrivals = {1: [make_request(0, 4, 5)], 2: [make_request(1, 4, 2)]}
    assert run(cfg, arrivals).lines[1] == "r1:4 r0:1 | W: | R: r0 r1"
    arrivals = {1: [make_request(0, 4, 5)], 2: [make_request(1, 4, 2)]}
    result = run(cfg, arrivals, before_step=decode_first)
    # r1 waits until r0 has decoded to its end.
    assert result.lines[1:6] == [
        "r0:1 | W: r1 | R: r0",
        "r0:1 | W: r1 | R: r0",
        "r0:1 | W: r1 | R: r0",
        "r0:1 | W: r1 | R:",
        "r1:4 | W: | R: r1",
    ]


@pytest.mark.parametrize("name", ["max_num_batched_tokens", "max_num_seqs"])
def test_limits_below_one_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be at least 1"):
        replace(SchedulingKnobs.of(config()), **{name: 0})
