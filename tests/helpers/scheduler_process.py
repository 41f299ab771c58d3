"""Starts a real scheduler process (python -m scheduler_service) for tests and waits until ready.

    from tests.helpers.scheduler_process import start_scheduler
    with start_scheduler(executor_address, max_num_seqs=8) as address:
        client = Client(address)

Flags are the CLI's, with underscores. The scheduler binds port 0; the address comes from its
ready log line, which it prints once it has reached its executor.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tests.helpers.service_process import ServiceProcess, cli_flags

READY_PATTERN = re.compile(r"event=scheduler_ready address=(\S+):(\d+)")


def scheduler_command(executor_address: str, **flags: object) -> list[str]:
    command = [sys.executable, "-m", "scheduler_service", "--port", "0", "--executor", executor_address]
    return command + cli_flags(flags)


class SchedulerProcess(ServiceProcess):
    def __init__(self, executor_address: str, **flags: object) -> None:
        super().__init__(scheduler_command(executor_address, **flags), READY_PATTERN, "scheduler")


@contextmanager
def start_scheduler(executor_address: str, **flags: object) -> Iterator[str]:
    scheduler = SchedulerProcess(executor_address, **flags)
    try:
        yield scheduler.wait_ready(timeout_s=120.0)
    finally:
        scheduler.close()
