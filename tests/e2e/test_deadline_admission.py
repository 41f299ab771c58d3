"""Admission by deadline through real processes: a scheduler over the simulated executor (a
fixed step time, so the step-cost model has something true to learn) under more requests with a
TTFT deadline than it can start in time. The requests it admits meet their deadline as their
client measures it, the others are refused at arrival with RESOURCE_EXHAUSTED giving the
predicted time to first token; a per-token target no executor can meet is refused likewise."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import grpc
import pytest

from tests.helpers.generate_calls import GenerateCall, Outcome, generate, token_request
from tests.helpers.scheduler_process import start_scheduler
from tests.helpers.sim_executor_process import start_sim_executor

STEP_MS = 50
SEATS = 4
OUTPUT_TOKENS = 20
# A request holds a seat OUTPUT_TOKENS x STEP_MS = 1 s, so 4 start a second; 20 arrive a second.
ARRIVALS = 60
ARRIVAL_GAP_S = 0.05
# Tight and loose deadlines in turn: under the priority and fair policies a tight one is served
# before loose ones queued earlier (earliest deadline first), which must not make them late.
DEADLINES_MS = (700, 2500, 1500)
TENANTS = ("t0", "t1", "t2")
# Steps the step-cost model must see before it judges (core/step_timer.MIN_STEPS), and more.
WARMUP_TOKENS = 12
PREDICTED = re.compile(r"predicted time to first token (\d+) ms")


@pytest.fixture
def executor() -> Iterator[str]:
    with start_sim_executor(STEP_MS) as address:
        yield address


async def _warm_up(channel: grpc.aio.Channel) -> None:
    warm = await generate(channel, token_request(WARMUP_TOKENS))
    assert warm.code == grpc.StatusCode.OK and len(warm.token_ids) == WARMUP_TOKENS, warm


async def _overload(channel: grpc.aio.Channel) -> list[tuple[int, Outcome]]:
    calls: list[tuple[int, GenerateCall]] = []
    for index in range(ARRIVALS):
        deadline_ms = DEADLINES_MS[index % len(DEADLINES_MS)]
        request = token_request(OUTPUT_TOKENS, prompt=(100 + index, 7, 8, 9), ttft_deadline_ms=deadline_ms)
        calls.append((deadline_ms, GenerateCall(channel, request, tenant=TENANTS[index % len(TENANTS)])))
        await asyncio.sleep(ARRIVAL_GAP_S)
    return [(deadline_ms, await call.outcome()) for deadline_ms, call in calls]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_admitted_requests_meet_their_deadlines_and_the_rest_are_refused_at_arrival(executor: str, policy: str) -> None:
    async def scenario(address: str) -> list[tuple[int, Outcome]]:
        async with grpc.aio.insecure_channel(address) as channel:
            await _warm_up(channel)
            return await _overload(channel)

    with start_scheduler(executor, max_num_seqs=SEATS, policy=policy) as address:
        outcomes = asyncio.run(scenario(address))

    admitted = [(deadline_ms, o) for deadline_ms, o in outcomes if o.code == grpc.StatusCode.OK]
    refused = [(deadline_ms, o) for deadline_ms, o in outcomes if o.code != grpc.StatusCode.OK]
    late = [(deadline_ms, round(o.ttft_s or 0.0, 3)) for deadline_ms, o in admitted if (o.ttft_s or 0.0) > deadline_ms / 1000]
    summary = f"{len(admitted)} admitted, {len(late)} late (deadline ms, ttft s): {late}; {len(refused)} refused"
    # The load is past what the executor can start in time, and admission still takes what fits.
    assert len(refused) >= ARRIVALS // 3, summary
    assert len(admitted) >= 2 * SEATS, summary
    assert len(late) <= 0.05 * len(admitted), summary
    for _, outcome in admitted:
        assert len(outcome.token_ids) == OUTPUT_TOKENS
    for deadline_ms, outcome in refused:
        assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, outcome
        assert not outcome.token_ids
        assert f"deadline of {deadline_ms} ms" in outcome.details, outcome.details
        predicted = PREDICTED.search(outcome.details)
        assert predicted is not None, outcome.details
        assert outcome.retry_after is not None and int(outcome.retry_after) >= 1, outcome


def test_a_per_token_target_no_executor_meets_is_refused(executor: str) -> None:
    async def scenario(address: str) -> tuple[Outcome, Outcome]:
        async with grpc.aio.insecure_channel(address) as channel:
            await _warm_up(channel)
            # A step takes STEP_MS: a token every 50 ms at best.
            too_fast = await generate(channel, token_request(OUTPUT_TOKENS, tpot_target_ms=STEP_MS // 5))
            reachable = await generate(channel, token_request(OUTPUT_TOKENS, tpot_target_ms=STEP_MS * 4))
        return too_fast, reachable

    with start_scheduler(executor, max_num_seqs=SEATS) as address:
        too_fast, reachable = asyncio.run(scenario(address))
    assert too_fast.code == grpc.StatusCode.RESOURCE_EXHAUSTED, too_fast
    assert f"exceeds the target of {STEP_MS // 5} ms" in too_fast.details, too_fast.details
    assert too_fast.retry_after is not None and int(too_fast.retry_after) >= 1
    assert reachable.code == grpc.StatusCode.OK and len(reachable.token_ids) == OUTPUT_TOKENS, reachable
