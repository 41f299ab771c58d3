"""--target-itl-ms: while requests decode, a long prompt's prefill is spread over steps the
executor's step times say fit the target, and no token changes for it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from protos.splitserve.executor.v1 import executor_pb2 as pb
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.errors import RequestError
from scheduler_service.core.prefill_share import MIN_PREFILL_TOKENS
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor
from scheduler_service.core.step_timer import MIN_STEPS, StepTimer
from scheduler_service.planner.engine_options import EngineOptions
from scheduler_service.planner.executor_link import ExecutorLink
from scheduler_service.planner.lane import LaneOptions
from scheduler_service.planner.step_trace import StepTrace
from scheduler_service.replay.__main__ import main as replay_main
from scheduler_service.replay.__main__ import replay_trace
from scheduler_service.replay.simulate import replay_timeline
from scheduler_service.replay.step_cost import StepCost
from scheduler_service.replay.summary import summarize
from scheduler_service.replay.trace_reader import read_trace
from tests.helpers.engine_in_process import engine_over
from tests.helpers.executor_process import start_executor
from tests.helpers.model_factory import build_model
from tests.helpers.sched_harness import make_request, run
from tests.scheduler.test_scheduler import config

LONG_PROMPT = 300
# A target no step can meet: every step that decodes gets the smallest prefill share.
UNREACHABLE_TARGET_S = 1e-6
# The recorded and replayed steps' times: 1 ms a step, 0.1 ms a token.
COST = StepCost(0.001, 0.0001, 0.0001, 0.0, 1.0, 0)


class PlanLog(ExecutorLink):
    """The real link, keeping each plan's prefill chunk for one request id."""

    watched = "long"

    def __init__(self, address: str, scheduler_id: str, token: str | None = None) -> None:
        super().__init__(address, scheduler_id, token=token)
        # (tokens the watched request computes, whether the step decoded others), per plan.
        self.chunks: list[tuple[int, bool]] = []

    async def send(self, plan: pb.StepPlan) -> None:
        chunk = sum(
            r.num_scheduled_tokens
            for r in [*plan.new_requests, *plan.continuing_requests]
            if r.request_id == self.watched
        )
        decodes = bool(plan.decode_handles) or any(
            r.num_scheduled_tokens == 1 and r.request_id != self.watched for r in plan.continuing_requests
        )
        if chunk:
            self.chunks.append((chunk, decodes))
        await super().send(plan)


def test_decodes_first_then_prefill_gets_what_the_step_token_limit_leaves() -> None:
    arrivals = {1: [make_request(0, 60, 8), make_request(1, 6, 8)], 3: [make_request(2, 200, 2)]}
    plain = run(config(max_num_batched_tokens=128, num_kv_blocks=128), arrivals)
    arrivals = {1: [make_request(0, 60, 8), make_request(1, 6, 8)], 3: [make_request(2, 200, 2)]}
    limited = run(config(max_num_batched_tokens=128, num_kv_blocks=128), arrivals, step_token_limit=40)
    assert plain.lines[2:4] == ["r2:126 r0:1 r1:1 | W: | R: r0 r1 r2", "r0:1 r1:1 r2:74 | W: | R: r0 r1 r2"]
    assert limited.lines == [
        "r0:60 r1:6 | W: | R: r0 r1",          # no decodes yet: the limit does not apply
        "r0:1 r1:1 | W: | R: r0 r1",
        "r2:38 r0:1 r1:1 | W: | R: r0 r1 r2",  # 40 tokens: two decodes, 38 of the prompt
        "r0:1 r1:1 r2:38 | W: | R: r0 r1 r2",
        "r0:1 r1:1 r2:38 | W: | R: r0 r1 r2",
        "r0:1 r1:1 r2:38 | W: | R: r0 r1 r2",
        "r0:1 r1:1 r2:38 | W: | R: r0 r1 r2",
        "r0:1 r1:1 r2:10 | W: | R: r2",
        "r2:1 | W: | R:",
    ]
    assert limited.outputs == plain.outputs


def test_a_prompt_still_advances_when_the_decodes_alone_pass_the_limit() -> None:
    arrivals = {1: [make_request(i, 4, 12) for i in range(3)], 3: [make_request(5, 100, 1)]}
    result = run(config(max_num_batched_tokens=128, num_kv_blocks=128), arrivals, step_token_limit=1)
    chunks = [int(part.split(":")[1]) for line in result.lines for part in line.split(" | ")[0].split() if part.startswith("r5:")]
    assert chunks == [MIN_PREFILL_TOKENS] * 3 + [100 - 3 * MIN_PREFILL_TOKENS]
    assert len(result.outputs["r5"]) == 1


def test_the_engine_spreads_a_long_prefill_beside_decodes_and_no_token_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = build_model("llama", tmp_path / "llama")

    async def scenario(address: str, target_s: float) -> tuple[dict[str, list[int]], list[tuple[int, bool]]]:
        options = EngineOptions(lane=LaneOptions(target_itl_s=target_s))
        async with engine_over(address, PlanLog, options) as (engine, links):
            # A tiny model's step times on a shared machine need not tell a cost per token (the
            # fit itself is test_deadline_forecast's): the lane's timer is given one, 1 ms a
            # token, so that every step that decodes is over the target.
            timer = engine._lane(address).step_timer
            for tokens in (8, 512) * MIN_STEPS:
                timer.observe(tokens, tokens / 1000)
            sampling = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
            streams = {f"d{i}": engine.submit(Request(f"d{i}", [7 + i] * (8 + 40 * i), sampling)) for i in range(4)}
            outputs: dict[str, list[int]] = {request_id: [] for request_id in streams}

            async def read(request_id: str, items: int | None = None) -> None:
                stream = streams[request_id]
                while (items is None or items > 0) and (item := await stream.next_item()) is not None:
                    assert not isinstance(item, RequestError), item
                    outputs[request_id].extend(item.token_ids)
                    items = None if items is None else items - 1

            # The long prompt comes while the others decode.
            for request_id in list(streams):
                await read(request_id, 1)
            long = [3 + (i * 7) % 90 for i in range(LONG_PROMPT)]
            streams["long"] = engine.submit(Request("long", long, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
            outputs["long"] = []
            for request_id in streams:
                await read(request_id)
        return outputs, links[0].chunks

    with start_executor(model_dir, num_kv_blocks=128, block_size=16) as (address, _):
        plain_outputs, plain_chunks = asyncio.run(scenario(address, 0.0))
        assert "event=itl_target_missed" not in caplog.text
        spread_outputs, spread_chunks = asyncio.run(scenario(address, UNREACHABLE_TARGET_S))
    # The operator is told, once, that the decodes alone take longer than the target.
    assert caplog.text.count("event=itl_target_missed") == 1
    assert plain_chunks[0] == (LONG_PROMPT, True), "without a target the prompt is one chunk"
    assert sum(chunk for chunk, _ in spread_chunks) == LONG_PROMPT
    beside_decodes = [chunk for chunk, decodes in spread_chunks if decodes]
    assert beside_decodes and all(chunk <= MIN_PREFILL_TOKENS for chunk in beside_decodes), spread_chunks
    assert spread_outputs == plain_outputs


def _record(directory: Path, target_s: float) -> tuple[int, dict[str, list[int]]]:
    """A run written to a step trace as the engine writes it, each plan under the limit a lane's
    step timer would give for target_s (0: none), on a clock that COST moves on; returns the
    steps and the outputs. Two long prompts arrive once the short requests decode and the
    timer is ready."""
    config = SchedulerConfig(num_kv_blocks=256, block_size=4, max_model_len=1024, max_num_batched_tokens=512)
    scheduler = Scheduler(config)
    executor = SimulatedExecutor(256, 4)
    timer = StepTimer()
    now = [0.0]
    trace = StepTrace(directory, clock=lambda: now[0])
    trace.executor_up("ex", config, 1, target_s)
    arrivals = {0: [make_request(i, 8, 40) for i in range(4)], 12: [make_request(8, 400, 4), make_request(9, 300, 4)]}
    outputs: dict[str, list[int]] = {}
    step = 0
    while scheduler.has_unfinished() or step in arrivals:
        for request in arrivals.get(step, []):
            scheduler.add_request(request)
            trace.request_added("ex", request, scheduler)
        now[0] += 1e-4
        plan = scheduler.schedule(timer.step_token_limit(target_s))
        trace.plan_sent("ex", plan, scheduler.decoded_in(plan), now[0])
        output = executor.execute(plan)
        seconds = COST.seconds(*plan.prefill_and_decode_tokens())
        timer.observe(plan.num_scheduled_tokens, seconds)
        now[0] += seconds
        updates = scheduler.update(output)
        for update in updates:
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        trace.result_applied("ex", output, updates, scheduler)
        step += 1
    trace.close()
    return step, outputs


def test_a_trace_recorded_under_a_target_replays_step_for_step(tmp_path: Path) -> None:
    steps, outputs = _record(tmp_path, 0.02)
    [timeline] = read_trace(tmp_path)
    limits = [plan.step_token_limit for plan in timeline.plans]
    assert timeline.config["target_itl_s"] == 0.02 and any(limit is not None for limit in limits)
    replayed = replay_timeline(timeline, None, COST)
    assert replayed.matched_steps == len(timeline.plans) == steps
    assert replayed.outputs == {request_id: len(tokens) for request_id, tokens in outputs.items()}


def test_a_replay_under_a_target_shows_the_shorter_gaps_it_buys(tmp_path: Path) -> None:
    _record(tmp_path, 0.0)
    [timeline] = read_trace(tmp_path)
    assert all(plan.step_token_limit is None for plan in timeline.plans) and "target_itl_s" not in timeline.config
    as_recorded = summarize("as recorded", [replay_timeline(timeline, None, COST)])
    targeted = summarize("20 ms", [replay_timeline(timeline, None, COST, 0.02)])
    # Unlimited, a 400-token prompt beside the decodes makes one ~45 ms step; under the target
    # no gap between two tokens is much over 20 ms.
    assert as_recorded.itl_p99_s > 0.04
    assert targeted.itl_p99_s < 0.025
    assert targeted.requests == as_recorded.requests and targeted.output_tokens_per_s > 0


def test_the_replay_command_takes_targets_and_reports_inter_token_latency(tmp_path: Path) -> None:
    _record(tmp_path / "trace", 0.0)
    out = tmp_path / "replay.json"
    assert replay_main([str(tmp_path / "trace"), "--target-itl-ms", "0,20", "--json", str(out)]) == 0
    plain, targeted = json.loads(out.read_text())["configurations"]
    assert (plain["label"], targeted["label"]) == ("as recorded itl=0ms", "as recorded itl=20ms")
    assert targeted["itl_p99_s"] < plain["itl_p99_s"]
    assert replay_main([str(tmp_path / "trace"), "--target-itl-ms", "-1"]) == 2


def test_a_fleet_replay_plans_each_executor_under_the_target(tmp_path: Path) -> None:
    _record(tmp_path, 0.0)
    timelines = read_trace(tmp_path)
    (plain, _), (targeted, _) = replay_trace(timelines, [None], COST, executors=2, targets=[0.0, 0.02])
    assert plain.requests == targeted.requests == 6
    # Spread over two executors a long prompt still makes a ~35 ms step beside the decodes.
    assert plain.itl_p99_s > 0.03 and targeted.itl_p99_s < 0.025
