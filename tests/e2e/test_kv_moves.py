"""K/V that moves between executors, through real processes: a drain moves the running requests
with their K/V instead of waiting for them, a prefill executor hands each request to a decode
executor after its first token, and either side of a move killed mid-way loses no request and
no token (the request is recomputed from the tokens it has). Greedy outputs equal transformers'
throughout."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
import torch

from clients import AsyncClient
from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.replay.trace_reader import read_trace
from tests.helpers.block_audit import assert_books_agree
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.greedy_client import stream_all
from tests.helpers.greedy_reference import Reference
from tests.helpers.kv_moves_checks import (
    distinct_prompts,
    executor_state,
    server_status,
    stream_with_fault,
    wait_all_up,
    wait_for,
)
from tests.helpers.metrics_scrape import scrape, total
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import SchedulerProcess
from tests.helpers.service_process import free_port

torch.set_num_threads(1)
BLOCK_SIZE = 16
EXECUTOR_FLAGS = {"num_kv_blocks": 640, "block_size": BLOCK_SIZE}
PROMPT_TOKENS = 300
MAX_TOKENS = 48
NUM_STREAMS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("moves") / "llama", seed=17)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


def _jobs(seed: int) -> list[tuple[list[int], int]]:
    return distinct_prompts(NUM_STREAMS, PROMPT_TOKENS, MAX_TOKENS, seed)


@pytest.fixture
def two_executors(model_dir: Path) -> Iterator[list[ExecutorProcess]]:
    with ExitStack() as stack:
        started = [ExecutorProcess(model_dir, port=free_port(), **EXECUTOR_FLAGS) for _ in range(2)]
        for executor in started:
            stack.callback(executor.close)
        for executor in started:
            executor.wait_ready()
        yield started


def _scheduler(executors: list[str], metrics_port: int) -> SchedulerProcess:
    return SchedulerProcess(executors, max_num_batched_tokens=1024, metrics_port=metrics_port)


def test_a_drain_moves_running_requests_with_their_kv(
    two_executors: list[ExecutorProcess], reference: Reference, tmp_path: Path
) -> None:
    """Admin/DrainExecutor mid-generation: every stream exact, blocks moved, nothing recomputed,
    and the drained executor is let go while the moved requests still run elsewhere; the step
    trace records each move, and replay's reader takes it as the request leaving."""
    addresses = [executor.wait_ready() for executor in two_executors]
    drained = addresses[0]
    metrics_port = free_port()
    trace_dir = tmp_path / "trace"
    scheduler = SchedulerProcess(addresses, max_num_batched_tokens=1024, metrics_port=metrics_port, trace_dir=trace_dir)
    seen_drained_while_running: list[bool] = []
    watchers: list[asyncio.Task[None]] = []
    try:
        address = scheduler.wait_ready()
        wait_all_up(address, 2)
        with grpc.insecure_channel(address) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)

            def drain() -> None:
                admin.DrainExecutor(admin_pb2.DrainExecutorRequest(address=drained))

                async def watch() -> None:
                    async with AsyncClient(address) as client:
                        while True:
                            status = await client.server_status()
                            states = {e.address: e.state for e in status.executors}
                            if states[drained] == pb.EXECUTOR_STATE_DRAINED:
                                seen_drained_while_running.append(status.num_running > 0)
                                return
                            await asyncio.sleep(0.01)

                watchers.append(asyncio.get_running_loop().create_task(watch()))

            jobs = _jobs(seed=1)
            outputs = asyncio.run(stream_with_fault(address, jobs, drain))
        assert executor_state(address, drained) == pb.EXECUTOR_STATE_DRAINED
        assert_books_agree(address)
        samples, _ = scrape(metrics_port)
    finally:
        scheduler.close()
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    assert samples["splitserve:kv_blocks_migrated_total"] > 0
    assert samples['splitserve:kv_moves_total{outcome="ok"}'] > 0
    assert total(samples, "splitserve:recomputed_tokens_total") == 0, samples
    # Let go as soon as its requests had moved, while they still ran on the other executor.
    assert seen_drained_while_running == [True]
    events = [json.loads(line) for line in (trace_dir / "steps.jsonl").read_text().splitlines()]
    moved = {e["id"] for e in events if e["e"] == "move"}
    assert len(moved) == samples['splitserve:kv_moves_total{outcome="ok"}']
    arrived = {e["id"] for e in events if e["e"] == "add" and e.get("computed")}
    assert arrived == moved
    assert any("moves" in e for e in events if e["e"] == "plan")
    timelines = {timeline.address: timeline for timeline in read_trace(trace_dir)}
    assert {r.request_id for r in timelines[drained].requests.values() if r.finish == "left"} >= moved


def test_prefill_and_decode_executors_split_each_request(model_dir: Path, reference: Reference) -> None:
    """One --role prefill and one --role decode executor: the prefill executor computes every
    prompt and samples the first token, the decode executor computes every token after it and
    no prompt token; outputs exact."""
    ports = [free_port(), free_port()]
    with ExitStack() as stack:
        prefill = ExecutorProcess(model_dir, port=free_port(), role="prefill", metrics_port=ports[0], **EXECUTOR_FLAGS)
        stack.callback(prefill.close)
        decode = ExecutorProcess(model_dir, port=free_port(), role="decode", metrics_port=ports[1], **EXECUTOR_FLAGS)
        stack.callback(decode.close)
        metrics_port = free_port()
        scheduler = _scheduler([prefill.wait_ready(), decode.wait_ready()], metrics_port)
        stack.callback(scheduler.close)
        address = scheduler.wait_ready()
        wait_all_up(address, 2)
        jobs = _jobs(seed=2)
        outputs = asyncio.run(stream_all(address, jobs))
        assert_books_agree(address)
        status = server_status(address)
        prefill_samples, _ = scrape(ports[0])
        decode_samples, _ = scrape(ports[1])
        samples, _ = scrape(metrics_port)
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    computed = 'splitserve:executor_computed_tokens_total{kind="%s"}'
    assert prefill_samples[computed % "prompt"] == NUM_STREAMS * PROMPT_TOKENS
    assert prefill_samples.get(computed % "decode", 0) == 0
    assert decode_samples.get(computed % "prompt", 0) == 0
    # Every output token but the last is computed, all of them on the decode executor.
    assert decode_samples[computed % "decode"] == NUM_STREAMS * (MAX_TOKENS - 1)
    assert samples['splitserve:kv_moves_total{outcome="ok"}'] == NUM_STREAMS == status.num_kv_moves
    assert total(samples, "splitserve:recomputed_tokens_total") == 0 == status.num_recomputed_tokens
    assert sorted(e.role for e in status.executors) == ["decode", "prefill"]
    assert all(e.supports_kv_transfer for e in status.executors)


@pytest.mark.parametrize("killed", ["source", "destination"])
def test_a_side_killed_mid_move_loses_no_token(model_dir: Path, reference: Reference, killed: str) -> None:
    """A drain starts moving every running request; right then the source (the drained
    executor) or the destination is SIGKILLed (a destination is restarted on its address). Every
    stream finishes exact, recomputed where its K/V was lost, and the survivors' books agree."""
    ports = [free_port(), free_port()]
    executors = [ExecutorProcess(model_dir, port=port, **EXECUTOR_FLAGS) for port in ports]
    replacement: ExecutorProcess | None = None
    metrics_port = free_port()
    scheduler: SchedulerProcess | None = None
    try:
        addresses = [executor.wait_ready() for executor in executors]
        source, destination = executors
        victim = source if killed == "source" else destination
        scheduler = _scheduler(addresses, metrics_port)
        address = scheduler.wait_ready()
        wait_all_up(address, 2)
        with grpc.insecure_channel(address) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)

            def drain_then_kill() -> None:
                admin.DrainExecutor(admin_pb2.DrainExecutorRequest(address=addresses[0]))
                victim.process.kill()

            async def scenario() -> list[list[int]]:
                nonlocal replacement
                streams = asyncio.create_task(stream_with_fault(address, _jobs(seed=3), drain_then_kill))
                if killed == "destination":
                    while victim.process.poll() is None:
                        await asyncio.sleep(0.02)
                    replacement = ExecutorProcess(model_dir, port=ports[1], **EXECUTOR_FLAGS)
                return await streams

            outputs = asyncio.run(scenario())
        assert_books_agree(address)
        samples, _ = scrape(metrics_port)
    finally:
        if scheduler is not None:
            scheduler.close()
        for executor in [*executors, replacement]:
            if executor is not None:
                executor.close()
    for (prompt, max_tokens), output in zip(_jobs(seed=3), outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    assert total(samples, "splitserve:recomputed_tokens_total") > 0


def test_an_idle_executor_takes_running_requests_with_their_kv(
    two_executors: list[ExecutorProcess], reference: Reference
) -> None:
    """Every stream runs on one executor (the other drained) when the other is resumed: the idle
    one takes half of the running requests with their K/V (--rebalance-min-tokens-left),
    nothing is recomputed, and every stream is exact."""
    addresses = [executor.wait_ready() for executor in two_executors]
    idle = addresses[1]
    metrics_port = free_port()
    scheduler = SchedulerProcess(
        addresses, max_num_batched_tokens=1024, metrics_port=metrics_port, rebalance_min_tokens_left=16
    )
    try:
        address = scheduler.wait_ready()
        wait_all_up(address, 2)
        jobs = [(prompt, 96) for prompt, _ in _jobs(seed=4)[:8]]
        with grpc.insecure_channel(address) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            admin.DrainExecutor(admin_pb2.DrainExecutorRequest(address=idle))
            wait_for(lambda: executor_state(address, idle) == pb.EXECUTOR_STATE_DRAINED, "the drain")
            outputs = asyncio.run(
                stream_with_fault(address, jobs, lambda: admin.ResumeExecutor(admin_pb2.ResumeExecutorRequest(address=idle)))
            )
        assert_books_agree(address, audited_at_least=2)
        status = server_status(address)
        samples, _ = scrape(metrics_port)
    finally:
        scheduler.close()
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    assert samples['splitserve:kv_moves_total{outcome="ok"}'] >= 1
    assert total(samples, "splitserve:recomputed_tokens_total") == 0
    assert all(e.num_steps > 0 for e in status.executors), status.executors


def test_a_host_tier_swaps_preempted_requests_instead_of_recomputing(
    model_dir: Path, reference: Reference, tmp_path: Path
) -> None:
    """24 streams on a 48-block device pool with a host tier (--kv-host-gib): many preemptions,
    every one swapped out and back, no token recomputed, every stream exact; the step trace
    counts the blocks the executor swapped."""
    executor_metrics = free_port()
    with ExitStack() as stack:
        executor = ExecutorProcess(
            model_dir, port=free_port(), num_kv_blocks=48, block_size=BLOCK_SIZE, kv_host_gib=0.05,
            metrics_port=executor_metrics,
        )
        stack.callback(executor.close)
        metrics_port = free_port()
        trace_dir = tmp_path / "trace"
        scheduler = SchedulerProcess(
            executor.wait_ready(), max_num_batched_tokens=256, metrics_port=metrics_port, trace_dir=trace_dir
        )
        stack.callback(scheduler.close)
        address = scheduler.wait_ready()
        generator = torch.Generator().manual_seed(5)
        jobs = [
            (torch.randint(3, 250, (int(length),), generator=generator).tolist(), 40)
            for length in torch.randint(24, 90, (24,), generator=generator)
        ]
        outputs = asyncio.run(stream_all(address, jobs))
        assert_books_agree(address)
        status = server_status(address)
        samples, _ = scrape(metrics_port)
        executor_samples, _ = scrape(executor_metrics)
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    assert status.num_preemptions > 0
    assert total(samples, "splitserve:recomputed_tokens_total") == 0 == status.num_recomputed_tokens, samples
    assert status.executors[0].kv_host_blocks_total > 0
    assert status.executors[0].kv_host_blocks_free == status.executors[0].kv_host_blocks_total
    assert executor_samples['splitserve:executor_kv_swapped_blocks_total{direction="out"}'] > 0
    assert executor_samples['splitserve:executor_kv_swapped_blocks_total{direction="in"}'] > 0
    plans = [e for e in map(json.loads, (trace_dir / "steps.jsonl").read_text().splitlines()) if e["e"] == "plan"]
    traced_out = sum(e["swaps"][0] for e in plans if "swaps" in e)
    traced_in = sum(e["swaps"][1] for e in plans if "swaps" in e)
    assert traced_out == executor_samples['splitserve:executor_kv_swapped_blocks_total{direction="out"}']
    assert traced_in == executor_samples['splitserve:executor_kv_swapped_blocks_total{direction="in"}']


def test_a_prefix_workload_larger_than_the_device_pool_hits_in_the_host_tier(model_dir: Path, reference: Reference) -> None:
    """Six 12-block prefixes (72 blocks) cycled twice through a 48-block device pool: each has
    left the device before it comes round again, and its blocks come back from the host tier."""
    executor_metrics = free_port()
    generator = torch.Generator().manual_seed(6)
    prefixes = torch.randint(3, 250, (6, 12 * BLOCK_SIZE), generator=generator).tolist()
    rounds = [[(prefix + [7 + r, 11 + p], 4) for p, prefix in enumerate(prefixes)] for r in range(2)]
    with ExitStack() as stack:
        executor = ExecutorProcess(
            model_dir, port=free_port(), num_kv_blocks=48, block_size=BLOCK_SIZE, kv_host_gib=0.05,
            metrics_port=executor_metrics,
        )
        stack.callback(executor.close)
        scheduler = SchedulerProcess(executor.wait_ready(), max_num_batched_tokens=256)
        stack.callback(scheduler.close)
        address = scheduler.wait_ready()
        outputs = []
        for jobs in rounds:
            for job in jobs:
                outputs += asyncio.run(stream_all(address, [job]))
        status = server_status(address)
        assert_books_agree(address)
        executor_samples, _ = scrape(executor_metrics)
    for (prompt, max_tokens), output in zip([job for jobs in rounds for job in jobs], outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    # Every prefix block of the second round came back from the tier (none was on the device),
    # so half of all looked-up prompt tokens (the second round's prefixes) were hits.
    assert executor_samples['splitserve:executor_kv_swapped_blocks_total{direction="in"}'] == 6 * 12
    assert status.prefix_cache_hit_rate > 0.4
