"""Prefix caching for a hybrid model (SchedulerConfig.state_checkpoint_blocks): requests keep
their recurrent state every four blocks, a later request sharing a prefix resumes from the last
checkpoint its hit covers, and checkpoints share the state slots with running requests. The real
scheduler against the simulated executor, which refuses a checkpoint in a held slot or at a
point its request does not compute, and a resume from a slot no earlier checkpoint filled for
exactly those tokens; the audit (slots and checkpoints included) is clean after every step."""

import asyncio
from collections.abc import Callable
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
from scheduler_service.core.step_plan import (
    NewRequestPlan,
    StateCheckpoint,
    StepOutput,
    StepPlan,
)
from scheduler_service.planner.engine import Engine
from scheduler_service.planner.engine_options import EngineOptions
from scheduler_service.planner.executor_link import ExecutorLink
from scheduler_service.planner.executor_status import executor_status
from scheduler_service.planner.lane import ExecutorLane, LaneHooks, LaneOptions
from scheduler_service.planner.metrics import SchedulerMetrics
from scheduler_service.planner.plan_codec import plan_to_proto
from scheduler_service.planner.step_trace import StepTrace
from scheduler_service.replay.simulate import config_of, replay_timeline
from scheduler_service.replay.step_cost import StepCost
from scheduler_service.replay.trace_reader import read_trace

HYBRID = SchedulerConfig(
    num_kv_blocks=128, block_size=16, max_model_len=1024, max_num_batched_tokens=512,
    num_state_slots=8, state_checkpoint_blocks=4,
)


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def request(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def expected_output(prompt: list[int], count: int) -> list[int]:
    sequence = list(prompt)
    for _ in range(count):
        sequence.append(default_next_token("", sequence))
    return sequence[len(prompt) :]


@dataclass
class Rig:
    """A scheduler and its simulated executor, stepped by hand or to the end. Every plan is
    checked: no new request reads a slot the plan's own checkpoints write, and no checkpoint
    takes a running request's slot."""

    scheduler: Scheduler
    executor: SimulatedExecutor
    plans: list[StepPlan] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, config: SchedulerConfig, fail_step: FailFn | None = None) -> "Rig":
        executor = SimulatedExecutor(
            config.num_kv_blocks, config.block_size, fail_step=fail_step, num_state_slots=config.num_state_slots
        )
        return cls(Scheduler(config), executor)

    def plan(self) -> StepPlan:
        plan = self.scheduler.schedule()
        plan.want_held_requests = True
        written = {checkpoint.slot for checkpoint in plan.state_checkpoints}
        read = {new.state_source_slot for new in plan.new_requests} - {0}
        assert not written & read, f"step {plan.step_id} reads checkpoints it makes: {written & read}"
        held = {self.scheduler.kv.state_slots.slot_of(r.request_id) for r in self.scheduler.running}
        assert not written & held, f"step {plan.step_id} keeps checkpoints in held slots: {written & held}"
        self.plans.append(plan)
        return plan

    def apply(self, output: StepOutput, audit: bool = True) -> None:
        for update in self.scheduler.update(output):
            assert update.error is None, update.error
            self.outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        if audit:
            assert output.held_requests is not None
            assert audit_executor(self.scheduler, output.held_requests) == [], f"after step {output.step_id}"

    def step(self, arrivals: tuple[Request, ...] = ()) -> StepPlan:
        for arriving in arrivals:
            self.scheduler.add_request(arriving)
        plan = self.plan()
        self.apply(self.executor.execute(plan))
        return plan

    def finish(self, before_step: Callable[[int], None] | None = None) -> None:
        for _ in range(500):
            if not self.scheduler.has_unfinished():
                return
            if before_step is not None:
                before_step(len(self.plans) + 1)
            self.step()
        raise AssertionError("the scheduler did not finish")

    def new_request(self, request_id: str) -> tuple[int, NewRequestPlan]:
        """The index of the plan that admitted the request last, and its entry there."""
        found = [(i, new) for i, plan in enumerate(self.plans) for new in plan.new_requests if new.request_id == request_id]
        assert found, f"{request_id} was never admitted"
        return found[-1]

    def checkpoints(self, request_id: str) -> list[tuple[int, int]]:
        """(point, slot) of every checkpoint the request kept, in plan order."""
        return [(c.num_tokens, c.slot) for plan in self.plans for c in plan.state_checkpoints if c.request_id == request_id]


def test_a_prompt_keeps_a_checkpoint_every_four_blocks_and_a_later_prompt_resumes_from_the_last_it_covers() -> None:
    rig = Rig.of(HYBRID)
    a_prompt = tokens(1000, 250)
    a = request("a", a_prompt, 10)
    first = rig.step((a,))
    a_slot = rig.scheduler.kv.state_slots.slot_of("a")
    assert [(c.request_id, c.num_tokens) for c in first.state_checkpoints] == [("a", 64), ("a", 128), ("a", 192)]
    slots = [c.slot for c in first.state_checkpoints]
    assert len(set(slots)) == 3 and a_slot not in slots
    b_prompt = a_prompt[:200] + tokens(5000, 30)
    b = request("b", b_prompt, 5)
    second = rig.step((b,))
    (new,) = second.new_requests
    assert (new.request_id, new.num_computed_tokens, new.num_scheduled_tokens) == ("b", 192, 38)
    assert new.state_source_slot == slots[2] and new.state_slot not in (a_slot, *slots)
    stats = rig.scheduler.kv.stats()
    assert (stats.queried_tokens, stats.hit_tokens) == (250 + 230, 192)
    assert b.num_cached_tokens == 192
    rig.finish()
    assert rig.outputs["a"] == expected_output(a_prompt, 10)
    assert rig.outputs["b"] == expected_output(b_prompt, 5)
    # b's own computation, 192 to 235, passes no multiple of 64 it did not start from.
    assert rig.checkpoints("b") == []


def test_generated_tokens_keep_checkpoints_too_and_a_prompt_sharing_them_resumes_there() -> None:
    """a's decodes (in bulk) compute its token 256 in its sixth step: the checkpoint there
    keeps its prompt and first six outputs, which a follow-up turn shares."""
    rig = Rig.of(HYBRID)
    a_prompt = tokens(1000, 250)
    rig.step((request("a", a_prompt, 10),))
    rig.finish()
    assert [point for point, _ in rig.checkpoints("a")] == [64, 128, 192, 256]
    made_at = next(i for i, plan in enumerate(rig.plans) if any(c.num_tokens == 256 for c in plan.state_checkpoints))
    assert rig.plans[made_at].decode_handles, "the decode that computes token 256 goes in bulk"
    conversation = a_prompt + rig.outputs["a"][:7] + tokens(7000, 20)
    follow_up = request("c", conversation, 3)
    rig.step((follow_up,))
    _, new = rig.new_request("c")
    assert new.num_computed_tokens == 256 and new.state_source_slot == rig.checkpoints("a")[3][1]
    rig.finish()
    assert rig.outputs["c"] == expected_output(conversation, 3)


def test_a_checkpoint_is_read_only_by_plans_made_after_its_result() -> None:
    """a's checkpoints are taken by other requests, its blocks stay cached. b recomputes the
    shared prefix and keeps checkpoints again; c, planned while b's step is still out (the
    plans are pipelined), finds the blocks cached but the checkpoints pending, so it resumes
    from none, while d, planned after b's result, resumes from b's."""
    config = replace(HYBRID, num_state_slots=5)
    rig = Rig.of(config)
    shared = tokens(1000, 200)
    rig.step((request("a", shared + [1], 1),))
    rig.finish()
    assert len(rig.scheduler.kv.checkpoints.ready()) == 3
    for i in range(5):
        rig.scheduler.add_request(request(f"x{i}", tokens(3000 + 100 * i, 20), 3))
    rig.finish()
    assert rig.scheduler.kv.checkpoints.ready() == {}
    assert rig.scheduler.kv.is_cached(rig.scheduler.prefix_hashes(request("probe", shared + [2], 1))[11])
    rig.scheduler.add_request(request("b", shared + [2], 2))
    b_plan = rig.plan()
    b_output = rig.executor.execute(b_plan)
    assert [(c.request_id, c.num_tokens) for c in b_plan.state_checkpoints] == [("b", 64), ("b", 128), ("b", 192)]
    rig.scheduler.add_request(request("c", shared + [3], 2))
    c_plan = rig.plan()
    c_output = rig.executor.execute(c_plan)
    (c_new,) = c_plan.new_requests
    assert (c_new.request_id, c_new.num_computed_tokens, c_new.state_source_slot) == ("c", 0, 0)
    assert c_plan.state_checkpoints == [], "b's pending checkpoints already name those prefixes"
    rig.apply(b_output, audit=False)
    rig.apply(c_output)
    d = rig.step((request("d", shared + [4], 2),))
    (d_new,) = d.new_requests
    assert (d_new.num_computed_tokens, d_new.state_source_slot) == (192, b_plan.state_checkpoints[2].slot)
    rig.finish()
    for request_id, last in (("b", 2), ("c", 3), ("d", 4)):
        assert rig.outputs[request_id] == expected_output(shared + [last], 2)


def test_a_request_takes_the_least_recently_used_checkpoints_slot_and_everything_finishes() -> None:
    config = replace(HYBRID, num_state_slots=4)
    rig = Rig.of(config)
    a_prompt = tokens(1000, 250)
    rig.step((request("a", a_prompt, 2),))
    rig.finish()
    c64, c128, c192 = (slot for _, slot in rig.checkpoints("a"))
    ready = rig.scheduler.kv.checkpoints.ready
    assert list(ready().values()) == [c64, c128, c192] and rig.scheduler.kv.state_slots.num_free == 1
    # b resumes from 128 (the free slot is its own): that checkpoint is now the most recently used.
    rig.step((request("b", a_prompt[:140] + tokens(5000, 10), 30),))
    assert rig.new_request("b")[1].state_source_slot == c128
    assert list(ready().values()) == [c64, c192, c128]
    # No slot is free: x takes the least recently used checkpoint's, then y the next one's.
    x = rig.step((request("x", tokens(3000, 20), 30),))
    assert x.new_requests[0].state_slot == c64 and list(ready().values()) == [c192, c128]
    y = rig.step((request("y", tokens(4000, 20), 30),))
    assert y.new_requests[0].state_slot == c192 and list(ready().values()) == [c128]
    # And z the last one's: a checkpoint never keeps a request waiting.
    z = rig.step((request("z", tokens(6000, 20), 2),))
    assert z.new_requests[0].state_slot == c128 and ready() == {}
    rig.finish()
    for request_id in ("x", "y"):
        assert rig.outputs[request_id] == expected_output(tokens(3000 if request_id == "x" else 4000, 20), 30)
    assert rig.outputs["z"] == expected_output(tokens(6000, 20), 2)
    assert rig.scheduler.kv.state_slots.holders() == {}


def test_a_request_that_would_have_to_take_the_checkpoint_it_resumes_from_waits_for_a_slot() -> None:
    config = replace(HYBRID, num_state_slots=2)
    rig = Rig.of(config)
    a_prompt = tokens(1000, 250)
    # One slot spare beside a's own: a keeps its first checkpoint only.
    rig.step((request("a", a_prompt, 1),))
    rig.finish()
    ((_, c64),) = rig.checkpoints("a")
    rig.step((request("x", tokens(3000, 20), 6),))
    b = request("b", a_prompt[:200] + [7], 3)
    rig.step((b,))
    assert b in rig.scheduler.queued, "b waits for x's slot rather than take its checkpoint's"
    rig.finish()
    admitted_at, new = rig.new_request("b")
    assert (new.num_computed_tokens, new.state_source_slot) == (64, c64)
    # x computes in six plans (its prompt, then five decodes); b runs from the next.
    assert admitted_at == rig.new_request("x")[0] + 6
    assert rig.outputs["b"] == expected_output(a_prompt[:200] + [7], 3)


def test_a_failed_step_drops_its_pending_checkpoints_and_the_retry_keeps_them_again() -> None:
    rig = Rig.of(HYBRID, fail_step=lambda plan, ids: "boom" if plan.step_id == 1 else None)
    a_prompt = tokens(1000, 250)
    failed = rig.step((request("a", a_prompt, 3),))
    assert len(failed.state_checkpoints) == 3
    kv = rig.scheduler.kv
    assert kv.checkpoints.ready() == {} and kv.checkpoints.pending() == {} and kv.state_slots.lent_slots() == set()
    b_prompt = a_prompt[:200] + [9]
    retry = rig.step((request("b", b_prompt, 2),))
    assert [new.request_id for new in retry.new_requests] == ["a"], "the retry runs alone"
    assert [c.num_tokens for c in retry.state_checkpoints] == [64, 128, 192]
    rig.finish()
    _, b_new = rig.new_request("b")
    assert (b_new.num_computed_tokens, b_new.state_source_slot) == (192, retry.state_checkpoints[2].slot)
    assert rig.outputs["a"] == expected_output(a_prompt, 3) and rig.outputs["b"] == expected_output(b_prompt, 2)


@pytest.mark.parametrize("config", [replace(HYBRID, state_checkpoint_blocks=0), replace(HYBRID, enable_prefix_caching=False)])
def test_without_checkpoints_a_hybrid_model_has_no_prefix_hits(config: SchedulerConfig) -> None:
    rig = Rig.of(config)
    a_prompt = tokens(1000, 250)
    rig.step((request("a", a_prompt, 3),))
    rig.step((request("b", a_prompt[:200] + [9], 3),))
    rig.finish()
    assert not rig.scheduler.config.enable_prefix_caching and rig.scheduler.config.state_checkpoint_tokens == 0
    assert all(not plan.state_checkpoints for plan in rig.plans)
    assert {(new.num_computed_tokens, new.state_source_slot) for plan in rig.plans for new in plan.new_requests} == {(0, 0)}
    assert rig.scheduler.kv.stats().hit_tokens == 0


@pytest.mark.parametrize(("supported", "blocks"), [(True, 4), (False, 0)])
def test_the_lane_keeps_checkpoints_only_for_an_executor_that_supports_them(supported: bool, blocks: int) -> None:
    info = executor_pb2.ExecutorInfo(
        num_kv_blocks=64, block_size=16, max_model_len=1024, num_state_slots=4, supports_state_checkpoints=supported
    )
    config = ExecutorLane("x", cast(ExecutorLink, None), LaneOptions(), cast(LaneHooks, None))._config(info)
    assert (config.state_checkpoint_blocks, config.enable_prefix_caching) == (blocks, supported)
    off = ExecutorLane("x", cast(ExecutorLink, None), LaneOptions(state_checkpoint_blocks=0), cast(LaneHooks, None))
    assert not off._config(info).enable_prefix_caching


def test_the_status_counts_slots_keeping_only_checkpoints_as_free() -> None:
    rig = Rig.of(HYBRID)
    a_prompt = tokens(1000, 250)
    rig.step((request("a", a_prompt, 1),))
    rig.step((request("b", a_prompt[:200] + [7], 50),))
    assert len(rig.scheduler.kv.checkpoints.ready()) == 3 and len(rig.scheduler.running) == 1
    lanes = {}
    for address, scheduler in (("hybrid:1", rig.scheduler), ("plain:2", Scheduler(replace(HYBRID, num_state_slots=0)))):
        lanes[address] = ExecutorLane(address, cast(ExecutorLink, None), LaneOptions(), cast(LaneHooks, None))
        lanes[address].scheduler = scheduler
    hybrid = executor_status(lanes["hybrid:1"])
    assert (hybrid.state_slots_total, hybrid.state_slots_free) == (8, 7)
    plain = executor_status(lanes["plain:2"])
    assert (plain.state_slots_total, plain.state_slots_free) == (0, 0)
    engine = Engine("scheduler", None, EngineOptions(), SchedulerMetrics())
    engine.lanes = lanes
    status = asyncio.run(engine.server_status())
    assert (status.state_slots_total, status.state_slots_free) == (8, 7)
    assert status.kv_blocks_total == 2 * HYBRID.num_kv_blocks


def test_the_wire_carries_checkpoints_and_the_slot_a_request_resumes_from() -> None:
    plan = StepPlan(
        7,
        new_requests=[NewRequestPlan("b", [1] * 40, [0, 1, 2], 32, 8, SamplingParams(), 40, 1, state_slot=2, state_source_slot=3)],
        state_checkpoints=[StateCheckpoint("a", 64, 4), StateCheckpoint("a", 128, 5)],
    )
    message = plan_to_proto(plan)
    assert (message.new_requests[0].state_slot, message.new_requests[0].state_source_slot) == (2, 3)
    assert [(c.request_id, c.num_tokens, c.slot) for c in message.state_checkpoints] == [("a", 64, 4), ("a", 128, 5)]


def test_the_step_trace_records_checkpoints_and_resumes_and_an_unchanged_replay_makes_the_same(tmp_path: Path) -> None:
    now = [0.0]
    trace = StepTrace(tmp_path, clock=lambda: now[0])
    rig = Rig.of(HYBRID)
    trace.executor_up("x", HYBRID, pipeline_depth=1)
    shared = tokens(1000, 200)
    arrivals = {0: [request("a", shared + tokens(2000, 50), 4)], 2: [request("b", shared + [7], 3), request("c", tokens(5000, 90), 3)]}
    while rig.scheduler.has_unfinished() or any(at >= len(rig.plans) for at in arrivals):
        for added in arrivals.get(len(rig.plans), []):
            rig.scheduler.add_request(added)
            trace.request_added("x", added, rig.scheduler)
        now[0] += 0.1
        plan = rig.plan()
        trace.plan_sent("x", plan, rig.scheduler.decoded_in(plan), now[0])
        output = rig.executor.execute(plan)
        now[0] += 0.5
        trace.result_applied("x", output, rig.scheduler.update(output), rig.scheduler)
    trace.close()
    assert rig.new_request("b")[1].state_source_slot, "b was meant to resume from a's checkpoint"
    (timeline,) = read_trace(tmp_path)
    assert config_of(timeline) == HYBRID
    recorded = [(plan.signature[3], plan.signature[4]) for plan in timeline.plans]
    made = [(frozenset((c.request_id, c.num_tokens, c.slot) for c in plan.state_checkpoints),
             frozenset((n.request_id, n.state_source_slot) for n in plan.new_requests if n.state_source_slot))
            for plan in rig.plans if plan.has_work or plan.dropped_request_ids]
    assert recorded == made and any(sources for _, sources in recorded)
    replayed = replay_timeline(timeline, None, StepCost(0.5, 0.0, 0.0, 0.0, 1.0, 0))
    assert replayed.matched_steps == replayed.num_recorded_steps == rig.scheduler.num_steps
    # A trace from before hybrid models' prefix caching replays without checkpoints.
    del timeline.config["state_checkpoint_blocks"]
    assert config_of(timeline).state_checkpoint_blocks == 0 and not config_of(timeline).enable_prefix_caching


def test_the_simulated_executor_refuses_what_a_real_one_would() -> None:
    def new(request_id: str, slot: int, source: int = 0, computed: int = 0, prompt: list[int] | None = None) -> NewRequestPlan:
        sequence = prompt or [1, 2, 3, 4, 5, 6, 7, 8, 9]
        return NewRequestPlan(
            request_id, sequence, [0, 1, 2], computed, len(sequence) - computed, SamplingParams(), len(sequence),
            state_slot=slot, state_source_slot=source,
        )

    executor = SimulatedExecutor(8, 4, num_state_slots=4)
    with pytest.raises(PlanMismatch, match="a request holds that slot"):
        executor.execute(StepPlan(1, new_requests=[new("a", 1)], state_checkpoints=[StateCheckpoint("a", 4, 1)]))
    executor = SimulatedExecutor(8, 4, num_state_slots=4)
    with pytest.raises(PlanMismatch, match="computes its tokens 0 to 9"):
        executor.execute(StepPlan(1, new_requests=[new("a", 1)], state_checkpoints=[StateCheckpoint("a", 10, 2)]))
    executor = SimulatedExecutor(8, 4, num_state_slots=4)
    with pytest.raises(PlanMismatch, match="outside 1..4"):
        executor.execute(StepPlan(1, new_requests=[new("a", 1)], state_checkpoints=[StateCheckpoint("a", 4, 5)]))
    executor = SimulatedExecutor(8, 4, num_state_slots=4)
    with pytest.raises(PlanMismatch, match="computes nothing"):
        executor.execute(StepPlan(1, new_requests=[new("a", 1)], state_checkpoints=[StateCheckpoint("z", 4, 2)]))
    executor = SimulatedExecutor(8, 4, num_state_slots=4)
    # Read in the plan that makes it: the copy at admission finds nothing there yet.
    with pytest.raises(PlanMismatch, match="which no earlier checkpoint filled"):
        executor.execute(
            StepPlan(1, new_requests=[new("a", 1), new("b", 3, source=2, computed=4)], state_checkpoints=[StateCheckpoint("a", 4, 2)])
        )
    executor = SimulatedExecutor(8, 4, num_state_slots=4)
    executor.execute(StepPlan(1, new_requests=[new("a", 1)], state_checkpoints=[StateCheckpoint("a", 8, 2)]))
    with pytest.raises(PlanMismatch, match="keeps the state after 8 other tokens"):
        executor.execute(StepPlan(2, new_requests=[new("b", 3, source=2, computed=4)]))
    with pytest.raises(PlanMismatch, match="keeps the state after 8 other tokens"):
        executor.execute(StepPlan(3, new_requests=[new("b", 3, source=2, computed=8, prompt=[9] * 9)]))
    with pytest.raises(PlanMismatch, match="which a holds"):
        executor.execute(StepPlan(4, new_requests=[new("b", 3, source=1, computed=8)]))
    executor.execute(StepPlan(5, new_requests=[new("b", 3, source=2, computed=8)]))
    # Once a request has taken the slot, the checkpoint there is gone.
    executor.execute(StepPlan(6, new_requests=[new("c", 2)], dropped_request_ids=["b"]))
    with pytest.raises(PlanMismatch, match="which no earlier checkpoint filled"):
        executor.execute(StepPlan(7, new_requests=[new("d", 3, source=2, computed=8)], dropped_request_ids=["c"]))


def test_affinity_counts_a_hybrid_prefix_only_up_to_where_its_state_is_kept() -> None:
    """The router's measure of what an executor holds of a request: for a hybrid model, the
    cached blocks up to the last checkpoint among them (192 tokens), not every cached block (240),
    since a hit resumes only from there."""
    a_prompt = tokens(1000, 250)
    b = request("b", a_prompt[:240] + tokens(7000, 20), 5)
    hybrid, plain = Rig.of(HYBRID), Rig.of(replace(HYBRID, num_state_slots=0, state_checkpoint_blocks=0, enable_prefix_caching=True))
    for rig in (hybrid, plain):
        rig.step((request("a", a_prompt, 10),))
        rig.step()
    assert hybrid.scheduler.affinity(b) == 192
    assert plain.scheduler.affinity(b) == 240
