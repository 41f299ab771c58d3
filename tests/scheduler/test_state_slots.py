"""A hybrid model's requests (SchedulerConfig.num_state_slots > 0) each hold a recurrent-state
slot while they run: the real scheduler against the simulated executor, which refuses a slot
another request holds or a request that would not compute from its first token, with the audit
(slots included) clean after every step."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

import pytest

from protos.splitserve.executor.v1 import executor_pb2
from scheduler_service.core.audit import audit_executor
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import (
    FailFn,
    PlanMismatch,
    SimulatedExecutor,
    default_next_token,
)
from scheduler_service.core.step_plan import NewRequestPlan, StepPlan
from scheduler_service.planner.executor_link import ExecutorLink
from scheduler_service.planner.lane import ExecutorLane, LaneHooks, LaneOptions
from scheduler_service.planner.plan_codec import output_from_proto, plan_to_proto
from scheduler_service.planner.step_trace import StepTrace
from scheduler_service.replay.simulate import config_of, replay_timeline
from scheduler_service.replay.step_cost import StepCost
from scheduler_service.replay.trace_reader import read_trace

HYBRID = SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=256, max_num_batched_tokens=64, num_state_slots=3)


def prompt(index: int, length: int) -> list[int]:
    return list(range(100 * index + 1, 100 * index + length + 1))


def request(request_id: str, tokens: list[int], max_tokens: int, fork_of: str = "") -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), fork_of=fork_of)


def expected_output(tokens: list[int], count: int) -> list[int]:
    tokens = list(tokens)
    for _ in range(count):
        tokens.append(default_next_token("", tokens))
    return tokens[-count:]


@dataclass
class Drive:
    scheduler: Scheduler
    executor: SimulatedExecutor
    plans: list[StepPlan] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    # Requests running after each step was planned.
    running: list[set[str]] = field(default_factory=list)

    def new_requests(self) -> list[NewRequestPlan]:
        return [new for plan in self.plans for new in plan.new_requests]


def drive(
    config: SchedulerConfig,
    arrivals: dict[int, list[Request]],
    fail_step: FailFn | None = None,
    before_step: Callable[[int, Scheduler], None] | None = None,
    adopted: Sequence[Request] = (),
) -> Drive:
    """Adopts `adopted` (requests from a lost executor), adds arrivals[n] before planning step
    n (1-based), runs to the end, and audits the
    scheduler's books against the executor's after every step. The executor's held slots are
    checked against each plan's new requests too, beside the executor's own check: a new
    request's slot is one no request the executor still holds after the plan's drops has."""
    executor = SimulatedExecutor(
        config.num_kv_blocks, config.block_size, fail_step=fail_step, num_state_slots=config.num_state_slots
    )
    result = Drive(Scheduler(config), executor)
    for moved in adopted:
        assert result.scheduler.adopt(moved)
    held_slots: dict[str, int] = {}
    step = 0
    while result.scheduler.has_unfinished() or any(s > step for s in arrivals):
        step += 1
        assert step <= 500, "the scheduler did not finish"
        for arriving in arrivals.get(step, []):
            result.scheduler.add_request(arriving)
        if before_step is not None:
            before_step(step, result.scheduler)
        plan = result.scheduler.schedule()
        plan.want_held_requests = True
        result.running.append({r.request_id for r in result.scheduler.running})
        for dropped in plan.dropped_request_ids:
            held_slots.pop(dropped, None)
        taken = [new.state_slot for new in plan.new_requests if new.state_slot]
        assert len(set(taken)) == len(taken), f"step {step}: one slot for two new requests {taken}"
        assert not set(taken) & set(held_slots.values()), f"step {step}: {taken} reuses a held slot {held_slots}"
        output = executor.execute(plan)
        for update in result.scheduler.update(output):
            result.outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
            assert update.error is None, update.error
        assert output.held_requests is not None
        held_slots = {request_id: state.state_slot for request_id, state in output.held_requests.items()}
        assert audit_executor(result.scheduler, output.held_requests) == [], f"step {step}"
        result.plans.append(plan)
    slots = result.scheduler.kv.state_slots
    assert slots.holders() == {} and slots.num_free == config.num_state_slots
    return result


def test_at_most_num_state_slots_requests_run_and_finished_requests_give_their_slot_to_the_next() -> None:
    def workload() -> list[Request]:
        return [request(f"r{i}", prompt(i, 6 + i), 3 + i % 4) for i in range(8)]

    requests = workload()
    result = drive(HYBRID, {1: requests})
    assert max(len(running) for running in result.running) == 3
    news = result.new_requests()
    assert sorted(new.request_id for new in news) == [f"r{i}" for i in range(8)], "one admission each"
    assert {new.state_slot for new in news} == {1, 2, 3}
    assert all(new.num_computed_tokens == 0 for new in news)
    for r in requests:
        assert result.outputs[r.request_id] == expected_output(r.prompt_token_ids, r.sampling.max_tokens)
    # The first three take the three slots at once; each later one takes the slot of a request
    # that finished, and only once one did.
    first_step = {new.request_id: index for index, plan in enumerate(result.plans) for new in plan.new_requests}
    assert sorted(first_step, key=first_step.__getitem__)[:3] == ["r0", "r1", "r2"]
    assert all(first_step[f"r{i}"] > 0 for i in range(3, 8))
    # Without recurrent state the same workload runs all at once.
    stateless = drive(replace(HYBRID, num_state_slots=0), {1: workload()})
    assert max(len(running) for running in stateless.running) == 8
    assert {new.state_slot for new in stateless.new_requests()} == {0}


def test_preemption_gives_the_slot_back_and_readmission_takes_one_with_an_empty_state() -> None:
    config = replace(HYBRID, num_kv_blocks=10, max_num_batched_tokens=16)
    requests = [request(f"r{i}", prompt(i, 5 + i), 10) for i in range(5)]
    result = drive(config, {1: requests[:3], 2: requests[3:]})
    assert result.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    admissions: dict[str, int] = {}
    for new in result.new_requests():
        admissions[new.request_id] = admissions.get(new.request_id, 0) + 1
        assert new.num_computed_tokens == 0
    assert max(admissions.values()) > 1, "a preempted request was meant to be admitted again"
    assert max(len(running) for running in result.running) <= 3
    for r in requests:
        assert result.outputs[r.request_id] == expected_output(r.prompt_token_ids, 10)


def test_a_failed_step_and_an_abort_give_slots_back() -> None:
    """The failed step's requests lose their state and are retried; the aborted running
    request's slot goes to a waiting request in the very plan that tells the executor to drop
    it (the drop comes first there)."""
    requests = [request(f"r{i}", prompt(i, 7), 6) for i in range(5)]
    aborted_slot = []

    def fail_step_3(plan: StepPlan, ids: list[str]) -> str | None:
        return "boom" if plan.step_id == 3 else None

    def abort_r1(step: int, scheduler: Scheduler) -> None:
        if step == 8:
            aborted_slot.append(scheduler.kv.state_slots.slot_of("r1"))
            assert aborted_slot[0] and scheduler.abort("r1")

    result = drive(HYBRID, {1: requests}, fail_step=fail_step_3, before_step=abort_r1)
    assert result.scheduler.num_preemptions == 3
    step_8 = result.plans[7]
    assert step_8.dropped_request_ids == ["r1"]
    assert [(new.request_id, new.state_slot) for new in step_8.new_requests] == [("r3", aborted_slot[0])]
    for r in requests:
        if r.request_id != "r1":
            assert result.outputs[r.request_id] == expected_output(r.prompt_token_ids, 6)


def test_a_lost_executor_frees_every_slot() -> None:
    scheduler = Scheduler(HYBRID)
    executor = SimulatedExecutor(HYBRID.num_kv_blocks, HYBRID.block_size, num_state_slots=3)
    for i in range(5):
        scheduler.add_request(request(f"r{i}", prompt(i, 6), 8))
    for _ in range(3):
        scheduler.update(executor.execute(scheduler.schedule()))
    assert scheduler.kv.state_slots.num_free == 0
    evicted = scheduler.evict_all()
    assert scheduler.kv.state_slots.num_free == 3 and scheduler.kv.state_slots.holders() == {}
    # Elsewhere (a fresh executor), they are admitted again, three at a time, and finish.
    elsewhere = drive(HYBRID, {}, adopted=evicted)
    assert max(len(running) for running in elsewhere.running) == 3
    assert all(r.num_output_tokens == 8 for r in evicted)


def test_a_hybrid_model_gets_no_prefix_hits_from_shared_prefixes() -> None:
    shared = prompt(9, 12)
    arrivals = {1: [request("a", shared + [1, 2], 3)], 6: [request("b", shared + [3], 3), request("c", shared + [4, 5], 3)]}
    result = drive(HYBRID, arrivals)
    assert not result.scheduler.config.enable_prefix_caching
    assert result.scheduler.kv.stats().hit_tokens == 0
    assert all(new.num_computed_tokens == 0 for new in result.new_requests())
    fresh = {step: [request(r.request_id, r.prompt_token_ids, 3) for r in group] for step, group in arrivals.items()}
    stateless = drive(replace(HYBRID, num_state_slots=0, enable_prefix_caching=True), fresh)
    assert stateless.scheduler.kv.stats().hit_tokens > 0, "the prompts were meant to share cached blocks"


def test_sibling_choices_of_a_hybrid_model_compute_their_own_prompt() -> None:
    def choices() -> list[Request]:
        tokens = prompt(3, 10)
        return [request("a", tokens, 4)] + [request(f"a#{i}", tokens, 4, fork_of="a") for i in (1, 2)]

    config = replace(HYBRID, block_copies=True)
    assert not config.block_copies
    result = drive(config, {1: choices()})
    assert not any(plan.block_copies for plan in result.plans)
    assert {new.request_id: (new.num_computed_tokens, new.num_scheduled_tokens) for new in result.new_requests()} == {
        "a": (0, 10), "a#1": (0, 10), "a#2": (0, 10)
    }
    forked = drive(replace(config, num_state_slots=0, block_copies=True), {1: choices()})
    assert any(plan.block_copies for plan in forked.plans), "the choices were meant to fork without state"


def test_the_simulated_executor_refuses_what_a_real_one_would() -> None:
    def new(request_id: str, slot: int, computed: int = 0) -> NewRequestPlan:
        tokens = [1, 2, 3, 4, 5]
        return NewRequestPlan(request_id, tokens, [0, 1], computed, 5 - computed, SamplingParams(), 5, state_slot=slot)

    executor = SimulatedExecutor(8, 4, num_state_slots=2)
    executor.execute(StepPlan(1, new_requests=[new("a", 1)]))
    with pytest.raises(PlanMismatch, match="which a holds"):
        executor.execute(StepPlan(2, new_requests=[new("b", 1)]))
    with pytest.raises(PlanMismatch, match="outside 1..2"):
        executor.execute(StepPlan(3, new_requests=[new("b", 3)]))
    with pytest.raises(PlanMismatch, match="starts empty"):
        executor.execute(StepPlan(4, new_requests=[new("b", 2, computed=4)]))
    # Once a is dropped, its slot is free for the next.
    executor.execute(StepPlan(5, new_requests=[new("b", 1)], dropped_request_ids=["a"]))
    with pytest.raises(PlanMismatch, match="keeps no state"):
        SimulatedExecutor(8, 4).execute(StepPlan(1, new_requests=[new("a", 1)]))


def test_the_audit_names_a_slot_the_executor_disagrees_on() -> None:
    scheduler = Scheduler(HYBRID)
    executor = SimulatedExecutor(HYBRID.num_kv_blocks, HYBRID.block_size, num_state_slots=3)
    scheduler.add_request(request("a", prompt(1, 6), 4))
    plan = scheduler.schedule()
    plan.want_held_requests = True
    output = executor.execute(plan)
    scheduler.update(output)
    assert output.held_requests is not None and audit_executor(scheduler, output.held_requests) == []
    held = {"a": replace(output.held_requests["a"], state_slot=2)}
    assert audit_executor(scheduler, held) == ["request a: state slot 2 on the executor, 1 in the scheduler"]
    scheduler.kv.state_slots.free("a")
    assert "request a: running without a state slot" in audit_executor(scheduler, output.held_requests)


def test_the_step_trace_records_the_slots_and_an_unchanged_replay_follows_the_recorded_schedule(tmp_path: Path) -> None:
    now = [0.0]
    trace = StepTrace(tmp_path, clock=lambda: now[0])
    scheduler = Scheduler(HYBRID)
    executor = SimulatedExecutor(HYBRID.num_kv_blocks, HYBRID.block_size, num_state_slots=3)
    trace.executor_up("x", HYBRID, pipeline_depth=1)
    for i in range(6):
        added = request(f"r{i}", prompt(i, 5 + i), 4)
        scheduler.add_request(added)
        trace.request_added("x", added, scheduler)
    while scheduler.has_unfinished():
        now[0] += 0.1
        plan = scheduler.schedule()
        trace.plan_sent("x", plan, scheduler.decoded_in(plan), now[0])
        output = executor.execute(plan)
        now[0] += 0.5
        trace.result_applied("x", output, scheduler.update(output), scheduler)
    trace.close()
    (timeline,) = read_trace(tmp_path)
    assert config_of(timeline) == HYBRID
    replayed = replay_timeline(timeline, None, StepCost(0.5, 0.0, 0.0, 0.0, 1.0, 0))
    assert replayed.matched_steps == replayed.num_recorded_steps == scheduler.num_steps
    assert max(step.running for step in replayed.steps) == 3
    # A trace from before state slots were recorded replays as a model without them.
    del timeline.config["num_state_slots"]
    assert config_of(timeline).num_state_slots == 0


def test_the_lane_configures_from_the_executor_and_the_wire_carries_the_slots() -> None:
    info = executor_pb2.ExecutorInfo(
        num_kv_blocks=64, block_size=4, max_model_len=256, supports_block_copies=True, num_state_slots=4
    )
    config = ExecutorLane("x", cast(ExecutorLink, None), LaneOptions(), cast(LaneHooks, None))._config(info)
    assert (config.num_state_slots, config.enable_prefix_caching, config.block_copies) == (4, False, False)
    scheduler = Scheduler(config)
    scheduler.add_request(request("a", prompt(1, 6), 2))
    plan = scheduler.schedule()
    (sent,) = plan_to_proto(plan).new_requests
    assert sent.state_slot == 1
    answer = executor_pb2.StepResult(
        step_id=plan.step_id, held_requests=[executor_pb2.HeldRequest(request_id="a", block_ids=[0, 1], state_slot=1)]
    )
    held = output_from_proto(answer).held_requests
    assert held is not None and held["a"].state_slot == 1
