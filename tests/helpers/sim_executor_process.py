"""Starts the simulated executor (python -m bench.sim_executor) as a real process for tests: the
real Executor gRPC service with a fixed time per step and made-up tokens, so a scheduling test
controls its step time without a model.

    from tests.helpers.sim_executor_process import start_sim_executor
    with start_sim_executor(step_ms=20) as address:
        with start_scheduler(address, max_num_seqs=16) as scheduler:
            ...

Its tokens are a function of the request id and the position (bench.sim_executor._token), so a
request that is preempted and recomputed gets the same output as one that never was.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tests.helpers.executor_process import READY_PATTERN
from tests.helpers.executor_token import token_file
from tests.helpers.service_process import ServiceProcess, cli_flags


def sim_executor_command(step_ms: float, **flags: object) -> list[str]:
    """Flags are bench.sim_executor's, with underscores (num_kv_blocks=..., block_size=...)."""
    command = [sys.executable, "-m", "bench.sim_executor", "--port", "0"]
    return command + cli_flags({"step_ms": step_ms, "executor_token_file": token_file(), **flags})


@contextmanager
def start_sim_executor(step_ms: float, **flags: object) -> Iterator[str]:
    """Yields the executor's address once it serves; it is stopped on exit."""
    executor = ServiceProcess(sim_executor_command(step_ms, **flags), READY_PATTERN, "sim-executor")
    try:
        yield executor.wait_ready(timeout_s=60.0)
    finally:
        executor.close()
