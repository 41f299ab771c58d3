"""Process supervision: starting children, waiting on them, and stopping them all."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from service_support.parent_death import child_environment

# One logger for the whole launcher: its lines read logger=scheduler_service.launch whichever
# module wrote them.
logger = logging.getLogger("scheduler_service.launch")

# Both services drain on SIGTERM for up to their --drain-timeout (25 s): the scheduler lets its
# running streams finish, the executor waits for the scheduler's stream to end. A little more
# before SIGKILL.
STOP_GRACE_S = 30.0
POLL_S = 0.05
LOG_TAIL_LINES = 40


class Shutdown(Exception):
    """SIGINT or SIGTERM arrived."""


class ChildFailed(Exception):
    def __init__(self, child: Child, problem: str) -> None:
        super().__init__(f"{child.name} {problem}")
        self.child = child


@dataclass(slots=True)
class Child:
    """A process the launcher started; services log to log_path, short-lived tools do not."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path | None = None

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def last_error(self) -> str:
        """The last line the service logged at ERROR (its one-line refusal), else its last
        line; empty without a log."""
        lines = [line for line in self.tail().splitlines() if line.strip()]
        errors = [line for line in lines if "level=ERROR" in line or '"level": "ERROR"' in line]
        return (errors or lines or [""])[-1]


@dataclass(slots=True)
class Children:
    """The children running now. A signal handler only sets stop_requested; every wait here
    checks it at its next poll and raises Shutdown."""

    stop_requested: threading.Event = field(default_factory=threading.Event)
    running: list[Child] = field(default_factory=list)

    def spawn(
        self,
        name: str,
        command: list[str],
        *,
        env: dict[str, str],
        stdout: IO[bytes] | int | None = None,
        log_path: Path | None = None,
        new_session: bool = False,
    ) -> Child:
        process = subprocess.Popen(
            command,
            stdout=stdout,
            stderr=subprocess.STDOUT if log_path is not None else None,
            # A service in its own session ends with the launcher (service_support/parent_death.py): a
            # killed launcher would otherwise leave servers holding the default ports.
            env=child_environment(env) if new_session else env,
            start_new_session=new_session,
        )
        child = Child(name, process, log_path)
        self.running.append(child)
        return child

    def wait_exit(self, child: Child) -> int:
        while (status := child.process.poll()) is None:
            self.check_stop()
            time.sleep(POLL_S)
        self.running.remove(child)
        return status

    def check_stop(self) -> None:
        if self.stop_requested.is_set():
            raise Shutdown

    def watch(self) -> None:
        """Serves until a signal; a service dying on its own is an error."""
        while True:
            self.check_stop()
            for child in self.running:
                if child.log_path is not None and child.process.poll() is not None:
                    raise ChildFailed(child, f"exited with status {child.process.returncode}")
            self.stop_requested.wait(0.5)

    def stop_all(self) -> None:
        """SIGTERM to every child at once, then SIGKILL to those still alive after the grace."""
        for child in self.running:
            if child.process.poll() is None:
                child.process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for child in reversed(self.running):
            try:
                status = child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("event=child_killed name=%s pid=%d", child.name, child.process.pid)
                child.process.kill()
                status = child.process.wait()
            logger.info("event=child_stopped name=%s status=%d", child.name, status)
        self.running.clear()
