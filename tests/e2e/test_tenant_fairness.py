"""Tenants and priorities through real processes (issue 40): a tenant that floods the scheduler
cannot make another wait for the whole flood under --policy fair, and under --policy priority a
priority-0 request preempts a batch of priority-5 ones at once, which still finish whole.

The executors are simulated (bench.sim_executor, tests/helpers/sim_executor_process.py): the real
Executor gRPC service, spending a fixed STEP_MS on each step with made-up tokens, so the step time
is the test's and no model competes for the two cores. Nothing is asserted on wall-clock speed:
TTFTs are compared as a ratio of two runs of this test, and steps are counted in the scheduler's
step trace (--trace-dir).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients import AsyncClient
from tests.helpers.scheduler_process import SchedulerProcess, start_scheduler
from tests.helpers.sim_executor_process import start_sim_executor

STEP_MS = 20
TENANT_METADATA = "x-splitserve-tenant"
# Streams send their first token and their end at once whatever this is: fewer messages for the
# client in this process to read, TTFTs unchanged.
STREAM_INTERVAL = 16

# The flood (item 1). Tenant a sends FLOOD requests at once into SEATS seats; they run in
# FLOOD / SEATS = 6 "waves" of FLOOD_TOKENS steps, W = 64 x 20 ms = 1.28 s each, or longer when
# steps run late on a busy machine (the executor never makes one shorter than STEP_MS). Tenant b
# sends LATE requests LATE_AFTER_S = 2 s later, in a's second wave.
#   fcfs: b queues behind all 96 of a's and starts when a's sixth wave ends: TTFT ~ 6 W - 2 s
#         = 5.7 s (measured: 6.2 s, steps of ~21 ms).
#   fair: b's counter starts at a's, and a's grows by 16 tokens a step while b waits, so every
#         seat that frees goes to b first: TTFT <= the rest of the running wave <= W = 1.28 s,
#         ~2 W - 2 s = 0.56 s while the waves stay aligned (measured: 0.76 s).
#   Ratio at worst W / (6 W - 2 s): 0.22 for W = 1.28 s, and smaller as W grows; it passes 1/3
#   only for W < 0.67 s, which steps of 20 ms cannot give. Each run takes ~11 s.
SEATS = 16
FLOOD = 96
FLOOD_TOKENS = 64
LATE = 8
LATE_TOKENS = 8
LATE_AFTER_S = 2.0

# The smaller check with API keys: 32 of a's into 8 seats (4 waves of W), 4 of b's one second
# in. Under fair b takes the first 4 seats that free at the end of a's first wave, so at least
# 32 - 8 (first wave) - 4 (a's that may start in the same step as b's last) = 20 of a's start
# after every b has its first token (measured: 24); under fcfs, or were a and b one tenant, none
# do (b starts after all 32 of a's; measured: 0).
KEYED_SEATS = 8
KEYED_FLOOD = 32
KEYED_LATE = 4
KEYED_LATE_AFTER_S = 1.0

# Priority that preempts (item 2): a full batch of priority-5 requests with long outputs, then
# one priority-0 request.
BATCH = 4
LONG_TOKENS = 150
URGENT_TOKENS = 8
# Prompts (in tokens) that share a prefix of 16 blocks: the router's affinity for the executor
# computing it (256 cached tokens) outweighs BATCH queued requests there (4 x 32 tokens).
SHARED_PREFIX = 256


@dataclass(slots=True)
class Timed:
    """One request as its client saw it."""

    sent: float
    first_token: float | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def ttft(self) -> float:
        assert self.first_token is not None, "no token came"
        return self.first_token - self.sent


async def timed_stream(client: AsyncClient, prompt: Sequence[int], max_tokens: int, **options: Any) -> Timed:
    return await timed_into(Timed(time.monotonic()), client, prompt, max_tokens, **options)


async def timed_into(
    record: Timed, client: AsyncClient, prompt: Sequence[int], max_tokens: int, **options: Any
) -> Timed:
    """Fills a record (which the caller may watch while it runs) from one request's stream."""
    stream = client.stream(prompt_token_ids=list(prompt), max_tokens=max_tokens, ignore_eos=True, **options)
    async for delta in stream:
        if delta.token_ids and record.first_token is None:
            record.first_token = time.monotonic()
        record.tokens += delta.token_ids
        record.finish_reason = delta.finish_reason or record.finish_reason
    return record


def prompt_of(index: int, length: int = 8) -> list[int]:
    return [3 + (index * 31 + i) % 997 for i in range(length)]


@dataclass(slots=True, frozen=True)
class Flood:
    flood_size: int
    late_size: int
    late_after_s: float


async def flood_then_late(
    address: str, flood: Flood, a: dict[str, Any], b: dict[str, Any]
) -> tuple[list[Timed], list[Timed]]:
    """Tenant a's flood at once, tenant b's requests late_after_s later; a and b: each tenant's
    client arguments (its metadata or API key)."""
    async with AsyncClient(address, **a) as a_client, AsyncClient(address, **b) as b_client:
        flooding = [
            asyncio.create_task(timed_stream(a_client, prompt_of(i), FLOOD_TOKENS)) for i in range(flood.flood_size)
        ]
        await asyncio.sleep(flood.late_after_s)
        late = [
            asyncio.create_task(timed_stream(b_client, prompt_of(1000 + i), LATE_TOKENS))
            for i in range(flood.late_size)
        ]
        return list(await asyncio.gather(*flooding)), list(await asyncio.gather(*late))


def run_flood(
    policy: str, seats: int, flood: Flood, a: dict[str, Any], b: dict[str, Any], **flags: object
) -> tuple[list[Timed], list[Timed]]:
    """One scheduler over a fresh simulated executor, under `policy`."""
    with start_sim_executor(STEP_MS) as executor:
        options = {"policy": policy, "max_num_seqs": seats, "stream_interval": STREAM_INTERVAL, **flags}
        with start_scheduler(executor, **options) as address:
            return asyncio.run(flood_then_late(address, flood, a, b))


def assert_all_finished(requests: list[Timed], max_tokens: int, who: str) -> None:
    unfinished = [r for r in requests if r.finish_reason != "length" or len(r.tokens) != max_tokens]
    assert not unfinished, f"{len(unfinished)} of {who}'s {len(requests)} requests did not finish whole"


def test_a_flooding_tenant_does_not_hold_up_a_late_one_under_the_fair_policy() -> None:
    flood = Flood(FLOOD, LATE, LATE_AFTER_S)
    a = {"metadata": ((TENANT_METADATA, "a"),)}
    b = {"metadata": ((TENANT_METADATA, "b"),)}
    ttfts: dict[str, float] = {}
    for policy in ("fcfs", "fair"):
        flooded, late = run_flood(policy, SEATS, flood, a, b)
        assert_all_finished(flooded, FLOOD_TOKENS, f"a ({policy})")
        assert_all_finished(late, LATE_TOKENS, f"b ({policy})")
        ttfts[policy] = statistics.median(r.ttft for r in late)
    assert ttfts["fair"] <= ttfts["fcfs"] / 3, f"b's median TTFT: {ttfts}"


def test_tenants_by_api_key_are_queued_fairly_and_cannot_be_renamed_by_metadata(tmp_path: Path) -> None:
    a_key, b_key = "a-key-0123456789abcdef", "b-key-0123456789abcdef"
    keys = tmp_path / "keys"
    keys.write_text(f"{a_key} a\n{b_key} b\n")
    keys.chmod(0o600)
    # a's key names its tenant, so the metadata claiming b's is ignored: were it honoured, a's
    # flood and b's requests would be one tenant's, served in arrival order, b after the flood.
    a = {"api_key": a_key, "metadata": ((TENANT_METADATA, "b"),)}
    b = {"api_key": b_key}
    flood = Flood(KEYED_FLOOD, KEYED_LATE, KEYED_LATE_AFTER_S)
    flooded, late = run_flood("fair", KEYED_SEATS, flood, a, b, api_key_file=keys)
    assert_all_finished(flooded, FLOOD_TOKENS, "a")
    assert_all_finished(late, LATE_TOKENS, "b")
    b_started = max(r.first_token or 0.0 for r in late)
    after_b = sum(1 for r in flooded if r.first_token is not None and r.first_token > b_started)
    assert after_b >= KEYED_FLOOD // 2, f"only {after_b} of a's {KEYED_FLOOD} requests started after b's last"


# Priority that preempts, counted in the step trace.


def trace_events(trace_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (trace_dir / "steps.jsonl").read_text().splitlines()]


def steps_to_start(events: list[dict[str, Any]], request_id: str) -> tuple[str, int]:
    """Where a request started and in how many steps: the executor whose plan first computed it,
    and that plan's place (1: the first) among the plans that executor was sent after the
    request arrived (its first "add", on whichever executor)."""
    arrived = next(e["t"] for e in events if e["e"] == "add" and e["id"] == request_id)
    admitted = next(e for e in events if e["e"] == "plan" and request_id in e["new"])
    plans = [
        e for e in events
        if e["e"] == "plan" and e["x"] == admitted["x"] and e["t"] >= arrived and e["step"] <= admitted["step"]
        and (e["new"] or e["cont"] or e["dec"])
    ]
    return admitted["x"], len(plans)


def placed_on(events: list[dict[str, Any]], request_id: str) -> str:
    return next(e["x"] for e in events if e["e"] == "add" and e["id"] == request_id)


async def until_decoding(streams: list[asyncio.Task[Timed]], records: list[Timed]) -> None:
    """Returns once every stream has tokens (all are running and decoding)."""
    while not all(r.tokens for r in records):
        assert not any(s.done() for s in streams), "a long request ended before the batch was full"
        await asyncio.sleep(0.01)


# Long requests by priority: (priority, prompts), sent in this order.
Batches = list[tuple[int, list[list[int]]]]


def ids_of(priority: int, prompts: list[list[int]]) -> list[str]:
    return [f"p{priority}-{i}" for i in range(len(prompts))]


async def batch_then_urgent(
    address: str, batches: Batches, urgent: list[int]
) -> tuple[dict[str, Timed], Timed]:
    """Each batch (priority, prompts) of long requests sent and decoding, one after the other,
    then the priority-0 request `urgent`; every record by request id."""
    async with AsyncClient(address) as client:
        records: dict[str, Timed] = {}
        streams: list[asyncio.Task[Timed]] = []
        for priority, prompts in batches:
            batch = {request_id: Timed(time.monotonic()) for request_id in ids_of(priority, prompts)}
            for (request_id, record), prompt in zip(batch.items(), prompts, strict=True):
                streams.append(asyncio.create_task(timed_into(
                    record, client, prompt, LONG_TOKENS, priority=priority, request_id=request_id
                )))
            records |= batch
            await until_decoding(streams, list(records.values()))
        result = await timed_stream(client, urgent, URGENT_TOKENS, priority=0, request_id="urgent")
        await asyncio.gather(*streams)
        return records, result


async def each_alone(address: str, batches: Batches) -> dict[str, list[int]]:
    """Every long request again, with its id and prompt, with no urgent request to preempt any:
    the outputs they have when never preempted (the simulated tokens follow id and position)."""
    async with AsyncClient(address) as client:
        jobs = {
            request_id: timed_stream(client, prompt, LONG_TOKENS, priority=priority, request_id=request_id)
            for priority, prompts in batches
            for request_id, prompt in zip(ids_of(priority, prompts), prompts, strict=True)
        }
        done = await asyncio.gather(*jobs.values())
    return {request_id: record.tokens for request_id, record in zip(jobs, done, strict=True)}


@dataclass(slots=True)
class Traced:
    long: dict[str, Timed]
    urgent: Timed
    events: list[dict[str, Any]]
    # Each long request's output when it runs without the urgent one.
    reference: dict[str, list[int]]

    def preempted(self) -> list[str]:
        """Long requests started more than once in the scenario (before each was sent again)."""
        return [request_id for request_id in self.long if self._starts_in_scenario(request_id) > 1]

    def _starts_in_scenario(self, request_id: str) -> int:
        starts, adds = 0, 0
        for event in self.events:
            if event["e"] == "add" and event["id"] == request_id:
                adds += 1
            elif event["e"] == "plan" and request_id in event["new"] and adds == 1:
                starts += 1
        return starts


def run_traced(executors: list[str], trace_dir: Path, batches: Batches, urgent: list[int]) -> Traced:
    """The scenario under --policy priority, recorded with a step trace, then the long requests
    again without the urgent one."""
    scheduler = SchedulerProcess(
        executors, policy="priority", max_num_seqs=BATCH, trace_dir=trace_dir, stream_interval=1
    )
    try:
        address = scheduler.wait_ready(timeout_s=120.0)
        long, urgent_record = asyncio.run(batch_then_urgent(address, batches, urgent))
        reference = asyncio.run(each_alone(address, batches))
        # The trace is whole once the scheduler has stopped.
        assert scheduler.stop() == 0
    finally:
        scheduler.close()
    return Traced(long, urgent_record, trace_events(trace_dir), reference)


def assert_preempted_requests_lost_nothing(traced: Traced) -> None:
    preempted = traced.preempted()
    assert preempted, "no long request was preempted: the priority-0 request never took a seat"
    assert_all_finished(list(traced.long.values()), LONG_TOKENS, "the long requests")
    for request_id in preempted:
        assert traced.long[request_id].tokens == traced.reference[request_id], f"{request_id}'s output changed"


def test_a_priority_0_request_preempts_a_full_batch_of_priority_5_within_two_steps(tmp_path: Path) -> None:
    low = [prompt_of(i, 24) for i in range(BATCH)]
    with start_sim_executor(STEP_MS) as executor:
        traced = run_traced([executor], tmp_path / "trace", [(5, low)], prompt_of(99, 24))
    _, steps = steps_to_start(traced.events, "urgent")
    assert steps <= 2, f"the priority-0 request started in step {steps} after it arrived"
    assert traced.urgent.finish_reason == "length" and len(traced.urgent.tokens) == URGENT_TOKENS
    assert_preempted_requests_lost_nothing(traced)


def test_a_priority_0_request_preempts_within_two_steps_when_the_router_prefers_an_executor_it_cannot_preempt_on(
    tmp_path: Path,
) -> None:
    prefix = prompt_of(500, SHARED_PREFIX)
    # Executor one: a full batch of priority-0 requests sharing the prefix; executor two: a full
    # batch of priority-5 requests. The urgent request shares the prefix, so by its scores alone
    # (256 cached tokens less 4 queued x 32, against none less 4 x 32) the router picks executor
    # one, where it preempts nobody: it waited there ~140 steps for a seat before the router put
    # an executor where it starts at once first (core/router.py _starts_at_once).
    high = [prefix + prompt_of(i, 8) for i in range(BATCH)]
    low = [prompt_of(100 + i, 24) for i in range(BATCH)]
    with start_sim_executor(STEP_MS) as first, start_sim_executor(STEP_MS) as second:
        traced = run_traced([first, second], tmp_path / "trace", [(0, high), (5, low)], prefix + prompt_of(99, 8))
    events = traced.events
    assert {placed_on(events, i) for i in ids_of(0, high)} == {first}, "the setup: priority 0 on executor one"
    assert {placed_on(events, i) for i in ids_of(5, low)} == {second}, "the setup: priority 5 on executor two"
    assert traced.urgent.finish_reason == "length" and len(traced.urgent.tokens) == URGENT_TOKENS
    started_on, steps = steps_to_start(events, "urgent")
    assert steps <= 2, (
        f"the priority-0 request, placed on {placed_on(events, 'urgent')}, started on {started_on} "
        f"in step {steps} after it arrived"
    )
    assert_preempted_requests_lost_nothing(traced)
