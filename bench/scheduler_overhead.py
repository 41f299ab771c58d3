"""Scheduler overhead per step: plan (schedule) and update time with N running decodes and
10,000 requests waiting, per step and per running request, and the serialised plan size per
running request.

    python -m bench.scheduler_overhead [--steps 200] [--running 16 64 256 1024]
        [--policy fcfs priority fair] [--tenants 4]

Under fair, the requests belong to --tenants tenants in turn (the fair policy charges each
step's tokens to their tenants).

The executor is the simulated one and is not timed: this measures only the CPU the scheduler
spends per step, the time an accelerator would otherwise wait on it.
"""

import argparse
import statistics
import time
from dataclasses import dataclass

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.policy import Policy
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor
from scheduler_service.planner.plan_codec import plan_to_proto
from scheduler_service.process.gc_tuning import tune_gc

PROMPT_LEN = 64
BLOCK_SIZE = 16
WAITING = 10_000


@dataclass(slots=True)
class Row:
    policy: str
    running: int
    plan_median_us: float
    plan_p99_us: float
    update_median_us: float
    update_p99_us: float
    bytes_per_request: float

    @property
    def per_request_us(self) -> float:
        """Plan and update medians together, per running request."""
        return (self.plan_median_us + self.update_median_us) / self.running


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(num_running: int, steps: int, policy: Policy = Policy.FCFS, tenants: int = 1) -> Row:
    blocks_per_request = (PROMPT_LEN + BLOCK_SIZE + steps) // BLOCK_SIZE + 2
    config = SchedulerConfig(
        num_kv_blocks=blocks_per_request * num_running + 64,
        block_size=BLOCK_SIZE,
        max_model_len=4096,
        max_num_seqs=num_running,
        # Room to prefill every running request in one step: the warm-up then takes one step and
        # no request outgrows its blocks before measuring starts. Once the running set is full,
        # admission stops, so measured steps are pure decodes of num_running requests.
        max_num_batched_tokens=num_running * PROMPT_LEN,
        policy=policy,
    )
    scheduler = Scheduler(config)
    executor = SimulatedExecutor(config.num_kv_blocks, BLOCK_SIZE, verify_kv=False)
    sampling = SamplingParams(max_tokens=100_000, ignore_eos=True)
    for i in range(num_running + WAITING):
        # Prompts of PROMPT_LEN to PROMPT_LEN + BLOCK_SIZE - 1 tokens: as in a server whose
        # requests started at different times, a sixteenth of the running requests fill a block
        # at each step (and enter it into the prefix cache), not all of them every sixteenth step.
        prompt = [(i * 7 + j) % 30_000 + 1 for j in range(PROMPT_LEN + i % BLOCK_SIZE)]
        scheduler.add_request(Request(f"req-{i}", prompt, sampling, tenant=f"t{i % tenants}"))
    while len(scheduler.running) < num_running or any(r.in_prefill for r in scheduler.running):
        scheduler.update(executor.execute(scheduler.schedule()))
    plan_us, update_us, sizes = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        plan = scheduler.schedule()
        planned = time.perf_counter()
        output = executor.execute(plan)
        before_update = time.perf_counter()
        scheduler.update(output)
        done = time.perf_counter()
        plan_us.append((planned - start) * 1e6)
        update_us.append((done - before_update) * 1e6)
        decoding = len(plan.continuing_requests) + len(plan.decode_handles)
        assert decoding == num_running and not plan.new_requests
        sizes.append(plan_to_proto(plan).ByteSize() / num_running)
    assert len(scheduler.waiting) == WAITING
    return Row(
        policy.value,
        num_running,
        statistics.median(plan_us),
        percentile(plan_us, 0.99),
        statistics.median(update_us),
        percentile(update_us, 0.99),
        statistics.mean(sizes),
    )


def format_table(rows: list[Row]) -> str:
    header = (
        "| policy | running | plan median µs | plan p99 µs | update median µs | update p99 µs "
        "| plan + update µs / request | plan bytes / request |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r.policy} | {r.running} | {r.plan_median_us:.0f} | {r.plan_p99_us:.0f} | {r.update_median_us:.0f} "
            f"| {r.update_p99_us:.0f} | {r.per_request_us:.2f} | {r.bytes_per_request:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--running", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--policy", nargs="+", choices=[p.value for p in Policy], default=["fcfs"])
    parser.add_argument("--tenants", type=int, default=4, help="tenants the requests belong to in turn")
    args = parser.parse_args()
    # The collector settings the scheduler service runs with.
    tune_gc()
    rows = [measure(n, args.steps, Policy(policy), args.tenants) for policy in args.policy for n in args.running]
    print(
        f"{WAITING} waiting, prompts of {PROMPT_LEN}-{PROMPT_LEN + BLOCK_SIZE - 1} tokens, block size {BLOCK_SIZE}, "
        f"{args.steps} decode steps each"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
