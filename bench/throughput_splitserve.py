"""splitserve end to end: executor processes (config.executors, sharing config.threads), one
scheduler process, every request sent at once through clients.AsyncClient; timed from the first
send to the last token, with the arrival time of every streamed delta."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.throughput_workload import (
    CLIENT_ROLE,
    EXECUTOR_ROLE,
    SCHEDULER_ROLE,
    BenchConfig,
    SystemResult,
)
from bench.tier_cpu import cpu_seconds
from clients import AsyncClient, Client
from protos.splitserve.v1.generation_pb2 import EXECUTOR_STATE_UP
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.scheduler_process import SchedulerProcess
from tests.helpers.service_process import REPO_ROOT

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0


@dataclass(slots=True)
class StreamTiming:
    tokens: list[int] = field(default_factory=list)
    # perf_counter() at which each token arrived; tokens of one delta share its arrival time.
    token_times: list[float] = field(default_factory=list)
    done_at: float | None = None
    # Prompt tokens the scheduler served from its prefix cache (the final delta's usage).
    cached_prompt_tokens: int = 0

    @property
    def first_token_at(self) -> float | None:
        return self.token_times[0] if self.token_times else None


@dataclass(slots=True, frozen=True)
class Services:
    address: str
    executor_pids: list[int]
    scheduler_pid: int

    @property
    def pids(self) -> list[int]:
        """The executors' and the scheduler's, for whoever measures them (memory, profilers)."""
        return [*self.executor_pids, self.scheduler_pid]

    @property
    def cpu_roles(self) -> dict[str, list[int]]:
        """Each role's processes, as drive() counts their CPU."""
        return {EXECUTOR_ROLE: self.executor_pids, SCHEDULER_ROLE: [self.scheduler_pid]}


@contextmanager
def running_services(
    model_dir: Path,
    config: BenchConfig,
    executor_flags: dict[str, object] | None = None,
    scheduler_flags: dict[str, object] | None = None,
    tree: Path = REPO_ROOT,
) -> Iterator[Services]:
    """Yields the scheduler's address and the pids; both processes get SIGTERM, then SIGKILL, on
    any exit. executor_flags, scheduler_flags: more options, as the process helpers take them;
    tree: the source tree both run (another revision's checkout, to compare with it)."""
    with ExitStack() as stack:
        threads = max(1, config.threads // config.executors)
        executors = [
            ExecutorProcess(
                model_dir,
                threads=threads,
                num_kv_blocks=config.num_kv_blocks,
                block_size=config.block_size,
                tree=tree,
                **{"dtype": "float32", **(executor_flags or {})},
            )
            for _ in range(config.executors)
        ]
        for executor in executors:
            stack.callback(executor.close)
        addresses = [executor.wait_ready(START_TIMEOUT_S) for executor in executors]
        for executor, executor_address in zip(executors, addresses, strict=True):
            # The pid is what a profiler (py-spy dump/record --pid) needs while the benchmark runs.
            logger.info("event=executor_up pid=%d address=%s", executor.process.pid, executor_address)
        scheduler = SchedulerProcess(
            addresses,
            max_num_seqs=config.requests,
            max_num_batched_tokens=config.max_num_batched_tokens,
            tree=tree,
            **(scheduler_flags or {}),
        )
        stack.callback(scheduler.close)
        address = scheduler.wait_ready(START_TIMEOUT_S)
        logger.info("event=scheduler_up pid=%d address=%s", scheduler.process.pid, address)
        wait_all_up(address, config.executors)
        yield Services(address, [executor.process.pid for executor in executors], scheduler.process.pid)


def wait_all_up(address: str, count: int) -> None:
    """Every executor serving, so the measurement does not start on a part of them."""
    deadline = time.monotonic() + START_TIMEOUT_S
    with Client(address) as client:
        while sum(e.state == EXECUTOR_STATE_UP for e in client.server_status().executors) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count} executors not up after {START_TIMEOUT_S} s")
            time.sleep(0.1)


async def stream_one(
    client: AsyncClient, prompt: list[int], new_tokens: int, timing: StreamTiming, cache_salt: str | None = None
) -> None:
    async for delta in client.stream(
        prompt_token_ids=prompt, max_tokens=new_tokens, temperature=0, ignore_eos=True, cache_salt=cache_salt
    ):
        arrived = time.perf_counter()
        timing.tokens.extend(delta.token_ids)
        timing.token_times.extend([arrived] * len(delta.token_ids))
        if delta.usage is not None:
            timing.cached_prompt_tokens = delta.usage.cached_prompt_tokens
    timing.done_at = time.perf_counter()


async def drive(
    address: str,
    prompts: list[list[int]],
    new_tokens: list[int],
    label: str,
    share_prefixes: bool = True,
    warm_up: tuple[list[list[int]], list[int]] | None = None,
    cpu_roles: Mapping[str, Sequence[int]] | None = None,
) -> SystemResult:
    """Streams every prompt at once, prompts[i] for new_tokens[i] tokens. share_prefixes=False
    gives each request a cache salt of its own, so no request reuses another's cached blocks
    (the scheduler has no switch for prefix caching). warm_up: prompts and token counts streamed
    the same way first, untimed (bench.compare's warm-up of the workload's shapes); without it,
    one short request. cpu_roles: role -> pids (Services.cpu_roles) whose CPU seconds over the
    timed streams the result reports, with this process's own as the client's."""
    async with AsyncClient(address) as client:

        async def stream_all(prompts: list[list[int]], tokens: list[int], tag: str) -> list[StreamTiming]:
            timings = [StreamTiming() for _ in prompts]
            salts = [None if share_prefixes else f"{tag}-{index}" for index in range(len(prompts))]
            await asyncio.gather(
                *(stream_one(client, p, n, t, s) for p, n, t, s in zip(prompts, tokens, timings, salts, strict=True))
            )
            return timings

        if warm_up is None:
            # Channel set-up and the executor's first-step costs. Under one block long, so it
            # leaves nothing in the prefix cache for the measured prompts.
            await stream_one(client, prompts[0][:4], 2, StreamTiming())
        else:
            await stream_all(*warm_up, "warm-up")
        cpu_before = _cpu_by_role(cpu_roles or {})
        start = time.perf_counter()
        timings = await stream_all(prompts, new_tokens, "request")
        cpu_after = _cpu_by_role(cpu_roles or {})
    end = max(t.done_at or start for t in timings)
    logger.info("event=splitserve_done wall_s=%.2f", end - start)
    return SystemResult(
        system=label,
        wall_s=end - start,
        output_tokens=sum(len(t.tokens) for t in timings),
        ttft_s=[(t.first_token_at or end) - start for t in timings],
        outputs=[t.tokens for t in timings],
        token_times_s=[[at - start for at in t.token_times] for t in timings],
        cached_prompt_tokens=sum(t.cached_prompt_tokens for t in timings),
        cpu_s={role: cpu_after[role] - cpu_before[role] for role in cpu_before} if cpu_roles else {},
    )


def _cpu_by_role(roles: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """CPU seconds so far of each role's processes (a process gone counts nothing), and of this
    process as the client: its streams, and the few samples bench.process_memory's thread takes."""
    used = {role: sum(cpu_seconds(pid) or 0.0 for pid in pids) for role, pids in roles.items()}
    used[CLIENT_ROLE] = time.process_time()
    return used


def splitserve_label(config: BenchConfig) -> str:
    threads = max(1, config.threads // config.executors)
    return f"splitserve ({config.executors} executor(s) x {threads} thread(s) + scheduler, gRPC)"


def run_splitserve(
    model_dir: Path,
    prompts: list[list[int]],
    config: BenchConfig,
    scheduler_flags: dict[str, object] | None = None,
) -> SystemResult:
    with running_services(model_dir, config, scheduler_flags=scheduler_flags) as services:
        new_tokens = [config.new_tokens] * len(prompts)
        return asyncio.run(drive(services.address, prompts, new_tokens, splitserve_label(config)))
