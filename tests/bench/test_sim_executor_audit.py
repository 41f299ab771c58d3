"""The scale benchmark's simulated executor keeps block tables as the plans build them, so the
scheduler's audit of it is clean, through preemption and steady decodes."""

from bench.sim_executor import TimedRunner
from scheduler_service.core.audit import audit_executor
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.planner.plan_codec import output_from_proto, plan_to_proto


def test_every_step_audits_clean() -> None:
    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=12, block_size=4, max_model_len=128))
    runner = TimedRunner(step_s=0.0, stats_file=None)
    for index in range(6):
        prompt = [1, 2, 3, 4, 5] + list(range(100 * index, 100 * index + 3 + index))
        scheduler.add_request(Request(f"r{index}", prompt, SamplingParams(max_tokens=9, ignore_eos=True)))
    steps = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        plan.want_held_requests = True
        output = output_from_proto(runner.execute(plan_to_proto(plan)))
        scheduler.update(output)
        assert audit_executor(scheduler, output.held_requests or {}) == []
        steps += 1
        assert steps < 500
    assert scheduler.num_preemptions > 0, "the pool was meant to be too small"
