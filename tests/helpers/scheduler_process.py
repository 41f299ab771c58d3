"""Starts a real scheduler process (python -m scheduler_service) for tests and waits until ready.

    from tests.helpers.scheduler_process import start_scheduler
    with start_scheduler(executor_address, max_num_seqs=8) as address:
        client = Client(address)
    with start_scheduler([first, second]) as address:   # several executors

Flags are the CLI's, with underscores. The scheduler binds port 0; the address comes from its
ready log line, which it prints once it has reached an executor (or, with wait_for="listening",
as soon as it serves clients, executor or not).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.executor_token import token_file
from tests.helpers.service_process import REPO_ROOT, ServiceProcess, cli_flags

READY_PATTERN = re.compile(r"event=scheduler_ready address=(\S+):(\d+)")
LISTENING_PATTERN = re.compile(r"event=scheduler_listening address=(\S+):(\d+)")


# Front-ends every scheduler the tests start runs with unless a test says otherwise: unset (1,
# all in one process) in `make test`; `make test-frontends` runs the end-to-end tests again
# with 2, through the planner and front-end processes (process/all_in_one.py).
FRONTENDS_ENV = "SPLITSERVE_TEST_FRONTENDS"


def scheduler_command(executors: str | Sequence[str], **flags: object) -> list[str]:
    """With the process's executor token (executor_token.py), as the executors the tests start
    expect, unless flags name another (executor_token_file=None sends none)."""
    command = [sys.executable, "-m", "scheduler_service", "--port", "0"]
    for address in [executors] if isinstance(executors, str) else executors:
        command += ["--executor", address]
    defaults: dict[str, object] = {"executor_token_file": token_file(), "frontends": os.environ.get(FRONTENDS_ENV, "1")}
    return command + cli_flags({**defaults, **flags})


class SchedulerProcess(ServiceProcess):
    """tree: the source tree it runs (this repository by default)."""

    def __init__(
        self, executors: str | Sequence[str], wait_for: str = "ready", tree: Path = REPO_ROOT, **flags: object
    ) -> None:
        pattern = READY_PATTERN if wait_for == "ready" else LISTENING_PATTERN
        super().__init__(scheduler_command(executors, **flags), pattern, "scheduler", tree=tree)


@contextmanager
def start_scheduler(executors: str | Sequence[str], **flags: object) -> Iterator[str]:
    scheduler = SchedulerProcess(executors, **flags)
    try:
        yield scheduler.wait_ready(timeout_s=120.0)
    finally:
        scheduler.close()
