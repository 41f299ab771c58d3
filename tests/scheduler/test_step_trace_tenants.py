"""A step trace keeps each request's tenant and targets, so a recorded day replays under the fair
policy and deadline admission with the tenants it had; a request without them reads as before."""

from __future__ import annotations

from pathlib import Path

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.tenants import DEFAULT_TENANT
from scheduler_service.planner.step_trace import StepTrace
from scheduler_service.replay.trace_reader import read_trace


def test_the_trace_records_tenant_and_targets_and_replay_reads_them(tmp_path: Path) -> None:
    config = SchedulerConfig(num_kv_blocks=16, block_size=4, max_model_len=64)
    scheduler = Scheduler(config)
    trace = StepTrace(tmp_path)
    trace.executor_up("ex", config, 2)
    tenanted = Request("r1", [1, 2, 3], SamplingParams(max_tokens=4), tenant="acme", ttft_deadline_s=0.25, tpot_target_s=0.05)
    plain = Request("r2", [4, 5, 6], SamplingParams(max_tokens=4))
    for request in (tenanted, plain):
        scheduler.add_request(request)
        trace.request_added("ex", request, scheduler)
    trace.close()
    [timeline] = read_trace(tmp_path)
    first, second = timeline.requests["r1"], timeline.requests["r2"]
    assert (first.tenant, first.ttft_deadline_s, first.tpot_target_s) == ("acme", 0.25, 0.05)
    assert (second.tenant, second.ttft_deadline_s, second.tpot_target_s) == (DEFAULT_TENANT, 0.0, 0.0)
    # Nothing is written for a request that has none of them.
    assert '"tenant"' not in next(line for line in (tmp_path / "steps.jsonl").read_text().splitlines() if '"r2"' in line)
