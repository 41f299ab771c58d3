"""The seed document's three scenarios, built in: each runs the real scheduler core against the
simulated executor in lockstep (a plan, its result, the next plan), as the seed drew them.

  prefill-first  five requests, three seats; three more arrive at step 15 and start at once,
                 pausing the running decodes
  preemption     three requests in 3 blocks of 10 tokens: decoding past them preempts the tail
  decode-first   five requests, three seats: new ones start only when none is running
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.policy import StepMode
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor
from scheduler_service.replay.simulate import Replayed, planned_step, record_result


@dataclass(slots=True, frozen=True)
class Scenario:
    name: str
    config: SchedulerConfig
    # Step (1-based) -> requests added before it is planned: (index, prompt tokens, max tokens).
    arrivals: dict[int, tuple[tuple[int, int, int], ...]]


def _seed_config(num_kv_blocks: int, mode: StepMode) -> SchedulerConfig:
    return SchedulerConfig(num_kv_blocks=num_kv_blocks, block_size=10, max_model_len=1000, max_num_seqs=3, mode=mode)


SCENARIOS: dict[str, Scenario] = {
    "prefill-first": Scenario(
        "prefill-first",
        _seed_config(100, StepMode.PREFILL_FIRST),
        {1: tuple((i, 4, m) for i, m in enumerate([3, 3, 30, 10, 8])), 15: tuple((i, 4, 5) for i in (5, 6, 7))},
    ),
    "preemption": Scenario(
        "preemption", _seed_config(3, StepMode.PREFILL_FIRST), {1: tuple((i, 5, 8) for i in range(3))}
    ),
    "decode-first": Scenario(
        "decode-first",
        _seed_config(100, StepMode.DECODE_FIRST),
        {1: tuple((i, p, m) for i, (p, m) in enumerate([(4, 3), (6, 5), (5, 4), (4, 2), (3, 3)]))},
    ),
}


def scenario_request(index: int, prompt_tokens: int, max_tokens: int) -> Request:
    """Request r{index}; prompts of different indices share no block."""
    prompt = list(range(100 * index + 1, 100 * index + prompt_tokens + 1))
    return Request(f"r{index}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_scenario(scenario: Scenario, max_steps: int = 500) -> Replayed:
    """Steps in lockstep until every request finished; step n is planned at time n."""
    config = scenario.config
    step = 0
    # Time is the step count, for the scheduler's token gaps as for everything else here.
    scheduler = Scheduler(config, clock=lambda: float(step))
    executor = SimulatedExecutor(config.num_kv_blocks, config.block_size, num_state_slots=config.num_state_slots)
    replayed = Replayed(scenario.name, config)
    while scheduler.has_unfinished() or any(s > step for s in scenario.arrivals):
        step += 1
        if step > max_steps:
            raise RuntimeError(f"scenario {scenario.name} did not finish in {max_steps} steps")
        for index, prompt_tokens, max_tokens in scenario.arrivals.get(step, ()):
            request = scenario_request(index, prompt_tokens, max_tokens)
            scheduler.add_request(request)
            replayed.arrival_s[request.request_id] = float(step)
        plan = scheduler.schedule()
        step_record = planned_step(scheduler, plan, float(step), float(step))
        record_result(replayed, scheduler, scheduler.update(executor.execute(plan)), step_record, float(step))
    return replayed
