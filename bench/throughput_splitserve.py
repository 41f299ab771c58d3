"""splitserve end to end: one executor process, one scheduler process, every request sent at once
through clients.AsyncClient; timed from the first send to the last token."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.throughput_workload import BenchConfig, SystemResult
from clients import AsyncClient
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.scheduler_process import SchedulerProcess

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0


@dataclass(slots=True)
class StreamTiming:
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    done_at: float | None = None


@contextmanager
def running_services(model_dir: Path, config: BenchConfig) -> Iterator[str]:
    """Yields the scheduler's address; both processes get SIGTERM, then SIGKILL, on any exit."""
    with ExitStack() as stack:
        executor = ExecutorProcess(
            model_dir, threads=config.threads, num_kv_blocks=config.num_kv_blocks, block_size=config.block_size
        )
        stack.callback(executor.close)
        executor_address = executor.wait_ready(START_TIMEOUT_S)
        # The pid is what a profiler (py-spy dump/record --pid) needs while the benchmark runs.
        logger.info("event=executor_up pid=%d address=%s", executor.process.pid, executor_address)
        scheduler = SchedulerProcess(
            executor_address,
            max_num_seqs=config.requests,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        stack.callback(scheduler.close)
        address = scheduler.wait_ready(START_TIMEOUT_S)
        logger.info("event=scheduler_up pid=%d address=%s", scheduler.process.pid, address)
        yield address


async def stream_one(client: AsyncClient, prompt: list[int], new_tokens: int, timing: StreamTiming) -> None:
    async for delta in client.stream(
        prompt_token_ids=prompt, max_tokens=new_tokens, temperature=0, ignore_eos=True
    ):
        if delta.token_ids and timing.first_token_at is None:
            timing.first_token_at = time.perf_counter()
        timing.tokens.extend(delta.token_ids)
    timing.done_at = time.perf_counter()


async def drive(address: str, prompts: list[list[int]], new_tokens: int) -> SystemResult:
    async with AsyncClient(address) as client:
        # Warm-up outside the timing: channel set-up and the executor's first-step costs. Under
        # one block long, so it leaves nothing in the prefix cache for the measured prompts.
        await stream_one(client, prompts[0][:4], 2, StreamTiming())
        timings = [StreamTiming() for _ in prompts]
        start = time.perf_counter()
        await asyncio.gather(*(stream_one(client, p, new_tokens, t) for p, t in zip(prompts, timings)))
    end = max(t.done_at or start for t in timings)
    logger.info("event=splitserve_done wall_s=%.2f", end - start)
    return SystemResult(
        system="splitserve (executor + scheduler, gRPC)",
        wall_s=end - start,
        output_tokens=sum(len(t.tokens) for t in timings),
        ttft_s=[(t.first_token_at or end) - start for t in timings],
        outputs=[t.tokens for t in timings],
    )


def run_splitserve(model_dir: Path, prompts: list[list[int]], config: BenchConfig) -> SystemResult:
    with running_services(model_dir, config) as address:
        return asyncio.run(drive(address, prompts, config.new_tokens))
