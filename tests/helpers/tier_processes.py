"""The scheduler tier as separate processes: planners holding executors, and a front-end naming
them in order (the first it reaches serves; the next stands by)."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from tests.helpers.executor_token import token_file
from tests.helpers.service_process import ServiceProcess

PLANNER_LISTENING = re.compile(r"event=planner_listening address=(\S+):(\d+)")
FRONTEND_READY = re.compile(r"event=frontend_ready address=(\S+):(\d+)")


def planner(executors: list[str], token: Path, *flags: str) -> ServiceProcess:
    command = [sys.executable, "-m", "scheduler_service", "--role", "planner", "--port", "0",
               "--executor-token-file", str(token_file()), "--planner-token-file", str(token), *flags]
    for address in executors:
        command += ["--executor", address]
    return ServiceProcess(command, PLANNER_LISTENING, "planner")


def frontend(planners: list[str], token: Path, *flags: str) -> ServiceProcess:
    command = [sys.executable, "-m", "scheduler_service", "--role", "frontend", "--port", "0",
               "--planner-token-file", str(token), *flags]
    for address in planners:
        command += ["--planner", address]
    return ServiceProcess(command, FRONTEND_READY, "frontend")


def planners_and_frontend(
    stack: ExitStack, executors: list[str], token: Path, *flags: str
) -> tuple[ServiceProcess, ServiceProcess]:
    """Planner A holding every executor, a standby planner B, and a front-end naming A then B,
    each closed by stack and each given flags; (A, the front-end)."""
    first = planner(executors, token, *flags)
    stack.callback(first.close)
    first_address = first.wait_ready()
    wait_for(
        lambda: first.log_text().count("state=up") >= len(executors),
        what="the first planner holding every executor",
    )
    standby = planner(executors, token, *flags)
    stack.callback(standby.close)
    front = frontend([first_address, standby.wait_ready()], token, *flags)
    stack.callback(front.close)
    return first, front


def wait_for(predicate: Callable[[], bool], timeout_s: float = 90.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
