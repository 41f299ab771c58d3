"""A service started as a real process for tests: its log goes to a file, and it is ready once
its ready line appears there (the line carries the bound address, so tests can bind port 0)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class ServiceStartError(RuntimeError):
    pass


def cli_flags(flags: dict[str, object]) -> list[str]:
    """Keyword flags as command-line options: block_size=16 -> --block-size 16, trust_remote_code=True
    -> --trust-remote-code (None and False: left out)."""
    options: list[str] = []
    for name, value in flags.items():
        flag = f"--{name.replace('_', '-')}"
        if value is True:
            options.append(flag)
        elif value is not None and value is not False:
            options += [flag, str(value)]
    return options


def is_running(pid: int) -> bool:
    """Alive and not a zombie: an orphan's exit is reaped by init, not by the test."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# The ports free_port gives lie below the kernel's ephemeral range (32768 and up), from which
# every bind to port 0 and every outgoing connection draws: a port picked there could be taken by
# any of them before the service given it binds it (seen as "--metrics-port ... is already in
# use"). Each pytest-xdist worker draws from a block of its own, and gives each port once.
_PORT_BASE = 20_000
_PORT_BLOCK = 2_000
_PORT_BLOCKS = 6


def _worker_ports() -> Iterator[int]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    start = _PORT_BASE + (int(worker) if worker.isdigit() else 0) % _PORT_BLOCKS * _PORT_BLOCK
    return iter(range(start, start + _PORT_BLOCK))


# This process's draw, shared by every caller in it.
_PORTS = _worker_ports()


def free_port() -> int:
    """A port free right now on 127.0.0.1 and not given before in this process (for services
    that need a fixed one)."""
    for port in _PORTS:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"every port of this process's block of {_PORT_BLOCK} was given")


def child_environment(changes: Mapping[str, str | None]) -> dict[str, str]:
    """This process's environment with `changes` made (None: the variable is removed)."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name, value in changes.items():
        if value is None:
            environment.pop(name, None)
        else:
            environment[name] = value
    return environment


class ServiceProcess:
    """Starts command in the background; wait_ready() returns HOST:PORT from the ready line.
    env: changes to the environment it inherits (None removes a variable); tree: the source tree
    it runs in (python -m imports the packages found there), this repository by default."""

    def __init__(
        self,
        command: list[str],
        ready_pattern: re.Pattern[str],
        name: str,
        env: Mapping[str, str | None] | None = None,
        tree: Path = REPO_ROOT,
    ) -> None:
        self.name = name
        self._ready_pattern = ready_pattern
        self._log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        self.address: str | None = None
        self.process = subprocess.Popen(
            command,
            cwd=tree,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=child_environment(env or {}),
        )

    def wait_ready(self, timeout_s: float = 180.0) -> str:
        deadline = time.monotonic() + timeout_s
        while self.address is None:
            text = self.log_text()
            match = self._ready_pattern.search(text)
            if match:
                self.address = f"{match.group(1)}:{match.group(2)}"
            elif self.process.poll() is not None:
                raise ServiceStartError(f"{self.name} exited with {self.process.returncode}:\n{text[-4000:]}")
            elif time.monotonic() > deadline:
                raise ServiceStartError(f"{self.name} not ready after {timeout_s}s:\n{text[-4000:]}")
            else:
                time.sleep(0.05)
        return self.address

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, grace_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after grace_s; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def close(self) -> None:
        self.stop()
        self._log.close()
        self.log_path.unlink(missing_ok=True)
