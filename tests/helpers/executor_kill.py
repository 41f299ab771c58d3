"""An executor SIGKILLed while streams run through a real scheduler, and a fresh one started on
its address: the fault the no-request-lost tests share."""

from __future__ import annotations

import asyncio
from pathlib import Path

from clients import AsyncClient, Client
from protos.splitserve.v1.generation_pb2 import ServerStatus
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.greedy_client import stream_all
from tests.helpers.scheduler_process import start_scheduler
from tests.helpers.service_process import free_port


def stream_through_executor_kill(
    model_dir: Path,
    jobs: list[tuple[list[int], int]],
    kill_after_steps: int = 10,
    scheduler_flags: dict[str, object] | None = None,
    **flags: object,
) -> tuple[list[list[int]], ServerStatus]:
    """Streams the jobs (prompt, max_tokens) greedily; once the scheduler (started with
    scheduler_flags) has run kill_after_steps steps the executor (started with flags) is killed
    and replaced. Returns each job's tokens and the scheduler's status at the end."""
    port = free_port()
    first = ExecutorProcess(model_dir, port=port, **flags)
    replacement: ExecutorProcess | None = None
    try:
        address = first.wait_ready()
        with start_scheduler(address, **(scheduler_flags or {})) as scheduler_address:

            async def scenario() -> list[list[int]]:
                streams = asyncio.create_task(stream_all(scheduler_address, jobs))
                async with AsyncClient(scheduler_address) as client:
                    while (await client.server_status()).num_steps < kill_after_steps:
                        await asyncio.sleep(0.02)
                first.process.kill()
                return await streams

            async def restart_when_down() -> None:
                nonlocal replacement
                while first.process.poll() is None:
                    await asyncio.sleep(0.05)
                replacement = ExecutorProcess(model_dir, port=port, **flags)

            async def both() -> list[list[int]]:
                outputs, _ = await asyncio.gather(scenario(), restart_when_down())
                return outputs

            outputs = asyncio.run(both())
            with Client(scheduler_address) as client:
                status = client.server_status()
    finally:
        first.close()
        if replacement is not None:
            replacement.close()
    return outputs, status
