"""Speculative decoding from the flags to the lanes, the metrics and the step trace: on only for
an executor that verifies drafts, counted per proposer, and recorded per plan and result in a
trace that replays with it (and older traces read as before)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import cast

import pytest
from prometheus_client import CollectorRegistry

from protos.splitserve.executor.v1 import executor_pb2
from scheduler_service.__main__ import parse_args
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.errors import ErrorKind
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor
from scheduler_service.planner.executor_link import ExecutorLink
from scheduler_service.planner.lane import ExecutorLane, LaneHooks, LaneOptions
from scheduler_service.planner.metrics import SchedulerMetrics
from scheduler_service.planner.plan_codec import plan_to_proto
from scheduler_service.planner.step_trace import StepTrace
from scheduler_service.replay.simulate import config_of, replay_timeline
from scheduler_service.replay.step_cost import StepCost
from scheduler_service.replay.trace_reader import read_trace
from tests.helpers.speculation_models import echo


def test_the_flags_reach_the_lane_options() -> None:
    args = parse_args(["--speculative-method", "suffix", "--num-speculative-tokens", "5", "--speculative-max-batch", "8"])
    assert (args.speculative_method, args.num_speculative_tokens, args.speculative_max_batch) == ("suffix", 5, 8)
    off = parse_args([])
    assert (off.speculative_method, off.num_speculative_tokens, off.speculative_max_batch) == ("ngram", 0, 16)


@pytest.mark.parametrize(("flag", "value"), [("--speculative-method", "eagle"), ("--num-speculative-tokens", "-1"), ("--speculative-max-batch", "0")])
def test_a_meaningless_speculation_flag_is_refused(flag: str, value: str) -> None:
    with pytest.raises(SystemExit):
        parse_args([flag, value])


def _lane_config(info: executor_pb2.ExecutorInfo, **options: object) -> SchedulerConfig:
    lane = ExecutorLane("x", cast(ExecutorLink, None), LaneOptions(**options), cast(LaneHooks, None))  # type: ignore[arg-type]
    return lane._config(info)


def test_speculation_is_on_only_for_an_executor_that_verifies_drafts() -> None:
    info = executor_pb2.ExecutorInfo(num_kv_blocks=64, block_size=16, max_model_len=1024, supports_draft_tokens=True)
    on = _lane_config(info, speculative_method="suffix", num_speculative_tokens=4, speculative_max_batch=8)
    assert (on.speculative_method, on.num_speculative_tokens, on.speculative_max_batch) == ("suffix", 4, 8)
    info.supports_draft_tokens = False
    assert _lane_config(info, num_speculative_tokens=4).num_speculative_tokens == 0
    # A hybrid model's recurrent state cannot be wound back past rejected drafts.
    hybrid = executor_pb2.ExecutorInfo(
        num_kv_blocks=64, block_size=16, max_model_len=1024, supports_draft_tokens=True, num_state_slots=4
    )
    assert _lane_config(hybrid, num_speculative_tokens=4).num_speculative_tokens == 0


def test_the_draft_method_is_on_only_for_an_executor_with_a_draft_model() -> None:
    info = executor_pb2.ExecutorInfo(num_kv_blocks=64, block_size=16, max_model_len=1024, supports_draft_tokens=True)
    assert _lane_config(info, speculative_method="draft", num_speculative_tokens=4).num_speculative_tokens == 0
    info.draft_model = "draft-4-layers"
    on = _lane_config(info, speculative_method="draft", num_speculative_tokens=4)
    assert (on.speculative_method, on.num_speculative_tokens) == ("draft", 4)


def test_drafts_travel_in_the_plan() -> None:
    config = SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=256, num_speculative_tokens=3)
    scheduler = Scheduler(config)
    executor = SimulatedExecutor(64, 4, echo(10))
    scheduler.add_request(Request("r", list(range(10, 20)) * 3, SamplingParams(max_tokens=20, ignore_eos=True)))
    while True:
        plan = scheduler.schedule()
        if any(c.draft_token_ids for c in plan.continuing_requests):
            break
        scheduler.update(executor.execute(plan))
    [entry] = plan_to_proto(plan).continuing_requests
    assert list(entry.draft_token_ids) == plan.continuing_requests[0].draft_token_ids
    assert entry.num_scheduled_tokens == 1 + len(entry.draft_token_ids) == 4


def test_metrics_count_drafts_and_acceptance_per_proposer() -> None:
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry)
    metrics.drafts_verified("ngram", [("a", 4, 3), ("b", 2, 0)])
    metrics.drafts_verified("suffix", [("c", 4, 4)])

    def value(name: str, method: str) -> float | None:
        return registry.get_sample_value(name, {"method": method})

    assert value("splitserve:spec_draft_tokens_total", "ngram") == 6
    assert value("splitserve:spec_accepted_tokens_total", "ngram") == 3
    assert value("splitserve:spec_accepted_tokens_per_verify_count", "ngram") == 2
    assert value("splitserve:spec_accepted_tokens_per_verify_sum", "ngram") == 3
    assert value("splitserve:spec_accepted_tokens_total", "suffix") == 4


def _record(directory: Path, method: str = "ngram") -> dict[str, list[int]]:
    """A speculating run written to a step trace as the engine writes it; returns outputs."""
    config = SchedulerConfig(
        num_kv_blocks=128, block_size=4, max_model_len=512, num_speculative_tokens=4, speculative_method=method
    )
    scheduler = Scheduler(config)
    executor = SimulatedExecutor(128, 4, echo(10), draft_token=echo(10, every=7))
    trace = StepTrace(directory)
    trace.executor_up("ex", config, 1)
    for index in range(3):
        request = Request(f"r{index}", list(range(10 * index, 10 * index + 10)) * 3, SamplingParams(max_tokens=30, ignore_eos=True))
        scheduler.add_request(request)
        trace.request_added("ex", request, scheduler)
    outputs: dict[str, list[int]] = {}
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        trace.plan_sent("ex", plan, scheduler.decoded_in(plan), time.monotonic())
        output = executor.execute(plan)
        updates = scheduler.update(output)
        for update in updates:
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        trace.result_applied("ex", output, updates, scheduler)
    trace.close()
    return outputs


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_the_trace_records_drafts_and_acceptance_and_replays_with_speculation(tmp_path: Path, method: str) -> None:
    outputs = _record(tmp_path, method)
    events = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    plans = [e for e in events if e["e"] == "plan" and "drafts" in e]
    results = {e["step"]: e for e in events if e["e"] == "result"}
    assert plans
    for plan in plans:
        accepted = results[plan["step"]]["accepted"]
        assert accepted.keys() == plan["drafts"].keys()
        assert all(0 <= accepted[r] <= plan["drafts"][r] == plan["cont"][r] - 1 for r in accepted)
    [timeline] = read_trace(tmp_path)
    drafted = [p for p in timeline.plans if p.draft_tokens]
    assert len(drafted) == len(plans) and sum(p.accepted_tokens for p in drafted) > 0
    config = config_of(timeline)
    assert (config.num_speculative_tokens, config.speculative_method) == (4, method)
    replayed = replay_timeline(timeline, None, StepCost(0.001, 0.0001, 0.0001, 0.0, 1.0, 0))
    assert replayed.outputs == {request_id: len(tokens) for request_id, tokens in outputs.items()}
    # The replay verified drafts too (its prompts fit one step: a continuation of several tokens
    # is a decode and its drafts).
    assert any(tokens > 1 for step in replayed.steps for _, tokens in step.signature[1])


def test_a_trace_from_before_speculation_reads_and_replays_without_it(tmp_path: Path) -> None:
    _record(tmp_path)
    lines = []
    for line in (tmp_path / "steps.jsonl").read_text().splitlines():
        event = json.loads(line)
        for key in ("drafts", "accepted", "speculative_method", "num_speculative_tokens", "speculative_max_batch"):
            event.pop(key, None)
            event.get("config", {}).pop(key, None)
        lines.append(json.dumps(event))
    (tmp_path / "steps.jsonl").write_text("\n".join(lines) + "\n")
    [timeline] = read_trace(tmp_path)
    assert not any(p.draft_tokens or p.accepted_tokens for p in timeline.plans)
    assert config_of(timeline).num_speculative_tokens == 0


def test_an_executor_that_cannot_verify_drafts_refuses_the_entry_and_the_request_ends_in_error() -> None:
    """What the lane's check spares: drafts sent anyway are refused by name, not misread."""
    config = SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=256, num_speculative_tokens=3)
    scheduler = Scheduler(config)
    executor = SimulatedExecutor(64, 4, echo(10), supports_draft_tokens=False)
    scheduler.add_request(Request("r", list(range(10, 20)) * 3, SamplingParams(max_tokens=20, ignore_eos=True)))
    errors = []
    while scheduler.has_unfinished():
        errors += [update.error for update in scheduler.update(executor.execute(scheduler.schedule())) if update.error]
    [error] = errors
    assert error.kind is ErrorKind.INVALID and "draft tokens are not supported" in error.message
