"""Compose services run as plain local processes, for tests on machines without a Docker engine.

`LocalStandIns` maps what a container has onto this machine (the volume, service hostnames, fixed
ports, `python` and `splitserve`, and the executor's threads: a container has its cores, while
here two test workers share two, and OpenMP threads waiting for a busy core made the compose
tests' answers ten times slower); `bring_up` starts the services in dependency order, runs the one-shots to
their end, and waits for each server's own healthcheck to pass; `RunningServices` stops them as
`docker compose down` does. tests/e2e/test_compose.py says what is substituted and why.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers.service_process import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
# Names that reach a service from another container, and the wildcard a server binds.
CONTAINER_HOSTS = {"executor", "planner", "frontend", "127.0.0.1", "localhost", "0.0.0.0"}
HOST_PORT = re.compile(r"([\w.-]+):(\d+)")
URL = re.compile(r"(https?://)([\w.-]+:\d+)(/.*)?")
# The executor's --threads and OMP_NUM_THREADS when run here.
LOCAL_THREADS = "1"


def seconds(duration: str) -> float:
    """Compose durations as used in the file: '5s', '2m', '500ms'."""
    match = re.fullmatch(r"(\d+)(ms|s|m)", duration)
    assert match, f"unsupported duration {duration!r}"
    return int(match.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[match.group(2)]


def startup_order(services: dict[str, Any]) -> list[str]:
    """Services in an order where each comes after everything it depends on."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"dependency cycle through {name}"
        if name not in order:
            for dependency in services[name].get("depends_on", {}):
                visit(dependency, (*path, name))
            order.append(name)

    for name in sorted(services):
        visit(name, ())
    return order


def dependency_condition(services: dict[str, Any], service: str) -> set[str]:
    """The conditions other services wait on before starting after `service`."""
    return {
        spec["depends_on"][service]["condition"]
        for spec in services.values()
        if service in spec.get("depends_on", {})
    }


@dataclass(slots=True, frozen=True)
class LocalStandIns:
    """Maps container paths, hosts and ports onto this machine (see the module docstring)."""

    volume: Path
    ports: dict[int, int]

    def arg(self, text: str) -> str:
        if text.startswith("/models"):
            return str(self.volume) + text.removeprefix("/models")
        if text == "0.0.0.0":
            return "127.0.0.1"
        if match := URL.fullmatch(text):
            return f"{match.group(1)}{self.arg(match.group(2))}{match.group(3) or ''}"
        if match := HOST_PORT.fullmatch(text):
            host, port = match.group(1), int(match.group(2))
            if host in CONTAINER_HOSTS and port in self.ports:
                return f"127.0.0.1:{self.ports[port]}"
        if text.isdigit() and int(text) in self.ports:
            return str(self.ports[int(text)])
        return text

    def command(self, command: list[str]) -> list[str]:
        args = [self.arg(text) for text in command[1:]]
        for index, text in enumerate(args[:-1]):
            if text == "--threads":
                args[index + 1] = LOCAL_THREADS
        return [*self.program(command[0]), *args]

    @staticmethod
    def program(name: str) -> list[str]:
        # The image installs the project: its `python` and `splitserve` are this virtualenv's.
        if name == "python":
            return [sys.executable]
        if name == "splitserve":
            return [str(Path(sys.executable).parent / "splitserve")]
        return [name]

    def environment(self, spec: dict[str, Any]) -> dict[str, str]:
        # The image's ENV lines hold nothing a local process needs beyond the service's own.
        environment = {**os.environ, **{key: self.arg(str(value)) for key, value in spec.items()}}
        if "OMP_NUM_THREADS" in spec:
            environment["OMP_NUM_THREADS"] = LOCAL_THREADS
        return environment


@dataclass(slots=True)
class RunningServices:
    log_dir: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, command: list[str], env: dict[str, str]) -> None:
        with (self.log_dir / f"{name}.log").open("wb") as log:
            self.processes[name] = subprocess.Popen(
                command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-4000:]

    def stop(self) -> dict[str, int]:
        """SIGTERM in reverse start order, as `docker compose down` does."""
        statuses = {}
        for name, process in reversed(self.processes.items()):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                statuses[name] = process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                statuses[name] = process.wait()
        self.processes.clear()
        return statuses


def free_ports(count: int) -> list[int]:
    return [free_port() for _ in range(count)]


def wait_healthy(
    services: RunningServices, name: str, healthcheck: dict[str, Any], probe: list[str]
) -> None:
    """Runs the healthcheck command until it exits 0, within the time compose would allow."""
    interval = seconds(healthcheck.get("start_interval", healthcheck["interval"]))
    allowed = seconds(healthcheck["start_period"]) + healthcheck["retries"] * seconds(
        healthcheck["interval"]
    )
    deadline = time.monotonic() + allowed
    while True:
        result = subprocess.run(
            probe,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=seconds(healthcheck["timeout"]) + 10,
        )
        if result.returncode == 0:
            return
        process = services.processes[name]
        assert process.poll() is None, f"{name} exited {process.returncode}:\n{services.log(name)}"
        assert time.monotonic() < deadline, f"{name} unhealthy: {result.stdout}{services.log(name)}"
        time.sleep(interval)


def own_services(services: dict[str, Any]) -> dict[str, Any]:
    """The services built from this repository's image (the rest, such as Prometheus and
    Grafana, run images of their own that have no local stand-in)."""
    return {name: spec for name, spec in services.items() if spec.get("build") == "."}


def bring_up(
    services: dict[str, Any], stand_ins: LocalStandIns, running: RunningServices
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Starts every service in dependency order, as the engine would: a one-shot its dependents
    wait on to complete runs to its end and must succeed; every other service starts and its
    healthcheck runs until it passes. Returns the one-shots' results."""
    one_shots = {}
    for name in startup_order(services):
        spec = services[name]
        command = stand_ins.command(spec["command"])
        env = stand_ins.environment(spec.get("environment", {}))
        if dependency_condition(services, name) == {"service_completed_successfully"}:
            result = subprocess.run(
                command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
            )
            assert result.returncode == 0, (name, result.stderr[-4000:])
            one_shots[name] = result
            continue
        running.start(name, command, env)
        probe = stand_ins.command(spec["healthcheck"]["test"][1:])
        wait_healthy(running, name, spec["healthcheck"], probe)
    return one_shots
