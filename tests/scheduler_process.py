"""Starts a real scheduler process (python -m scheduler_service) for tests and waits until ready.

    from tests.scheduler_process import start_scheduler
    with start_scheduler(executor_address, max_num_seqs=8) as address:
        client = Client(address)

Flags are the CLI's, with underscores. The scheduler binds port 0; the address comes from its
ready log line, which it prints once it has reached its executor.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_PATTERN = re.compile(r"event=scheduler_ready address=(\S+):(\d+)")


def scheduler_command(executor_address: str, **flags: object) -> list[str]:
    command = [sys.executable, "-m", "scheduler_service", "--port", "0", "--executor", executor_address]
    for name, value in flags.items():
        if value is not None:
            command += [f"--{name.replace('_', '-')}", str(value)]
    return command


class SchedulerProcess:
    def __init__(self, executor_address: str, **flags: object) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="scheduler-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        self.process = subprocess.Popen(
            scheduler_command(executor_address, **flags),
            cwd=REPO_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = READY_PATTERN.search(self.log_text())
            if match:
                return f"{match.group(1)}:{match.group(2)}"
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"scheduler did not become ready; log tail:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, grace_s: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


@contextmanager
def start_scheduler(executor_address: str, **flags: object) -> Iterator[str]:
    scheduler = SchedulerProcess(executor_address, **flags)
    try:
        yield scheduler.wait_ready()
    finally:
        scheduler.stop()
