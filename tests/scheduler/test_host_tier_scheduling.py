"""Preemption and prefix caching with a host tier below the device's blocks (kv_manager/host_tier.py),
planned by the scheduler against a simulated executor whose host slots the plans' swaps copy to
and from, plans pipelined two deep. The simulated executor checks that every slot a request
attends over holds that request's token, so a block swapped back wrong fails the run."""

import random
from collections import deque

import pytest

from kv_manager.audit import pool_mismatches
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor
from tests.helpers.sched_harness import make_request

BLOCK_SIZE = 4


def run(requests: list[Request], num_blocks: int, num_host_blocks: int, budget: int = 64) -> tuple[dict[str, list[int]], Scheduler]:
    """Every request's output tokens, and the scheduler after the run."""
    config = SchedulerConfig(
        num_kv_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=512,
        max_num_batched_tokens=budget, num_host_blocks=num_host_blocks,
    )
    scheduler = Scheduler(config)
    sim = SimulatedExecutor(num_blocks, BLOCK_SIZE)
    for request in requests:
        scheduler.add_request(request)
    in_flight: deque = deque()
    tokens: dict[str, list[int]] = {}
    steps = 0
    while scheduler.has_unfinished() or in_flight:
        steps += 1
        assert steps < 20_000
        while len(in_flight) < 2:
            plan = scheduler.schedule()
            if not (plan.has_work or plan.dropped_request_ids or plan.has_moves):
                break
            in_flight.append(sim.execute(plan))
        if not in_flight:
            in_flight.append(sim.execute(scheduler.schedule()))
        for update in scheduler.update(in_flight.popleft()):
            if update.finished:
                tokens[update.request_id] = list(update.request.output_token_ids)
        assert pool_mismatches(scheduler.kv) == []
    return tokens, scheduler


def streams(count: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [make_request(i, rng.randint(8, 40), rng.randint(16, 48)) for i in range(count)]


@pytest.mark.parametrize("seed", range(6))
def test_preemption_swaps_to_the_host_tier_and_recomputes_nothing(seed: int) -> None:
    """24 streams on a 48-block device pool: many preemptions, every one a swap, no token
    computed twice, every output as with room to spare."""
    expected, _ = run(streams(24, seed), num_blocks=1024, num_host_blocks=0)
    tokens, scheduler = run(streams(24, seed), num_blocks=48, num_host_blocks=1024)
    assert tokens == expected
    assert scheduler.num_swapped_out > 0
    assert scheduler.num_preemptions == scheduler.num_swapped_out
    assert not scheduler.recomputed_tokens
    assert scheduler.kv.host is not None and scheduler.kv.host.pool.num_free == 1024


def test_without_room_in_the_tier_preemption_recomputes() -> None:
    expected, _ = run(streams(24, 7), num_blocks=1024, num_host_blocks=0)
    tokens, scheduler = run(streams(24, 7), num_blocks=48, num_host_blocks=2)
    assert tokens == expected
    assert scheduler.recomputed_tokens["preempted"] > 0


def test_a_prefix_workload_larger_than_the_device_pool_hits_in_the_tier() -> None:
    """Eight 64-token prefixes (128 blocks) cycled through a 40-block device pool: each prefix
    leaves the device before it comes round again, and comes back from the tier."""
    prefixes = [[1000 * p + i for i in range(64)] for p in range(8)]

    def jobs() -> list[Request]:
        requests = []
        for round_ in range(3):
            for p, prefix in enumerate(prefixes):
                request = make_request(100 + round_ * 8 + p, 1, 2)
                request.prompt_token_ids = request.token_ids = [*prefix, 7 + round_, 9 + p]
                requests.append(request)
        return requests

    def one_at_a_time(num_host_blocks: int) -> tuple[dict[str, list[int]], Scheduler]:
        tokens: dict[str, list[int]] = {}
        config_blocks = 40
        scheduler = None
        sim = SimulatedExecutor(config_blocks, BLOCK_SIZE)
        config = SchedulerConfig(
            num_kv_blocks=config_blocks, block_size=BLOCK_SIZE, max_model_len=512,
            max_num_batched_tokens=128, num_host_blocks=num_host_blocks,
        )
        scheduler = Scheduler(config)
        for request in jobs():
            scheduler.add_request(request)
            while scheduler.has_unfinished():
                for update in scheduler.update(sim.execute(scheduler.schedule())):
                    if update.finished:
                        tokens[update.request_id] = list(update.request.output_token_ids)
        return tokens, scheduler

    without, cold = one_at_a_time(0)
    tokens, warm = one_at_a_time(256)
    assert tokens == without
    assert cold.kv.stats().hit_tokens == 0
    stats = warm.kv.stats()
    # Rounds 2 and 3 find every prefix block (the last partial one aside) in the tier.
    assert stats.host_hit_tokens == 2 * 8 * 64
    assert pool_mismatches(warm.kv) == []
