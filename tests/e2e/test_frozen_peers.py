"""HTTP/2 keepalive between scheduler and executors, through real processes: a frozen (SIGSTOPped)
executor is found by its unanswered pings in about 20 s, well before the 30 s step deadline, and
its requests finish elsewhere with the same tokens; a live executor whose step takes longer than a
keepalive round is not lost; a frozen scheduler's stream ends at the executor before its lease
would lapse, so another scheduler may take the executor."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest

from clients import AsyncClient, Client
from protos.splitserve.executor.v1 import executor_pb2, executor_pb2_grpc
from tests.helpers.executor_process import READY_PATTERN, ExecutorProcess
from tests.helpers.executor_token import token_channel, token_file
from tests.helpers.greedy_client import stream_all, workload
from tests.helpers.greedy_reference import Reference
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import SchedulerProcess
from tests.helpers.service_process import ServiceProcess

# A keepalive round: a ping 10 s after the last data, unanswered for 10 s. The bounds leave room
# for a loaded machine and stay under what else would end the wait: the scheduler's 30 s step
# deadline (its default floor), the executor's 30 s lease.
FROZEN_FOUND_WITHIN_S = 25.0
# Longer than a whole keepalive round, so pings that waited for the step would lose the executor.
SLOW_STEP_S = 23.0


def _continue(process: ServiceProcess) -> None:
    if process.process.poll() is None:
        process.process.send_signal(signal.SIGCONT)


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as processes:
        yield processes


def _started(stack: ExitStack, service: ServiceProcess) -> str:
    stack.callback(service.close)
    # A test may leave it stopped; it must be able to exit.
    stack.callback(_continue, service)
    return service.wait_ready()


def _lost_lines(scheduler: SchedulerProcess, address: str) -> list[str]:
    marker = f"event=executor_lost address={address} "
    return [line for line in scheduler.log_text().splitlines() if marker in line]


def test_a_frozen_executor_is_lost_by_keepalive_and_its_requests_finish_elsewhere(
    stack: ExitStack, tmp_path: Path
) -> None:
    model_dir = build_model("llama", tmp_path / "llama", seed=13)
    reference = Reference(model_dir)
    executors = [ExecutorProcess(model_dir, num_kv_blocks=256, block_size=16) for _ in range(2)]
    addresses = [_started(stack, executor) for executor in executors]
    # The default step deadline (30 s floor): only keepalive can find the executor sooner.
    scheduler = SchedulerProcess(addresses, max_num_batched_tokens=512)
    address = _started(stack, scheduler)
    victim, victim_address = executors[0], addresses[0]
    # Long enough that both executors are mid-generation when the status shows them stepping
    # (16 x 32 tokens took ~0.2 s in all, and a poll could see the 5th step after the last).
    jobs = [(prompt, 128) for prompt, _ in workload(16, seed=32)]

    async def freeze_mid_generation() -> tuple[list[list[int]], float]:
        streams = asyncio.create_task(stream_all(address, jobs))
        async with AsyncClient(address) as client:
            while not all(e.num_steps >= 5 for e in (await client.server_status()).executors):
                assert not streams.done(), "the streams ended before both executors had work"
                await asyncio.sleep(0.02)
        victim.process.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        while not _lost_lines(scheduler, victim_address):
            assert not streams.done(), "the streams ended before the frozen executor was lost"
            await asyncio.sleep(0.05)
        return await streams, time.monotonic() - stopped

    outputs, found_s = asyncio.run(freeze_mid_generation())
    [lost] = _lost_lines(scheduler, victim_address)
    assert found_s < FROZEN_FOUND_WITHIN_S, f"found after {found_s:.1f} s: {lost}"
    assert "requeued=0" not in lost, lost
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)


@pytest.mark.slow
def test_keepalive_waits_out_a_slow_step_but_not_a_frozen_scheduler(stack: ExitStack) -> None:
    simulated = ServiceProcess(
        [
            *(sys.executable, "-m", "bench.sim_executor", "--port", "0"),
            *("--step-ms", str(SLOW_STEP_S * 1000), "--executor-token-file", str(token_file())),
        ],
        READY_PATTERN,
        "sim-executor",
    )
    executor_address = _started(stack, simulated)
    scheduler = SchedulerProcess(executor_address)
    address = _started(stack, scheduler)

    started = time.monotonic()
    with Client(address) as client:
        result = client.generate(prompt_token_ids=[5, 6, 7], max_tokens=1, ignore_eos=True)
    # The step really outlasted a keepalive round (the simulated executor sleeps through it).
    assert time.monotonic() - started >= SLOW_STEP_S
    assert len(result.token_ids) == 1
    assert not _lost_lines(scheduler, executor_address), scheduler.log_text()[-3000:]

    # Now the scheduler freezes while it holds the executor (its idle heartbeats stop).
    scheduler.process.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    with token_channel(executor_address) as channel:
        while True:
            plans = iter([executor_pb2.StepPlan(step_id=0)])
            call = executor_pb2_grpc.ExecutorStub(channel).Execute(
                plans, metadata=(("x-splitserve-scheduler-id", "another-scheduler"),)
            )
            try:
                list(call)
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
            time.sleep(0.2)
    released_s = time.monotonic() - stopped
    assert released_s < FROZEN_FOUND_WITHIN_S, f"the frozen scheduler held the executor {released_s:.1f} s"
