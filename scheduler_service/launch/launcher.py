"""The launch in order: check ports, prepare the model, start the executor and the scheduler,
wait until they serve, ask the question, then serve until a signal."""

from __future__ import annotations

import logging
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.executor_access import write_token_file
from scheduler_service.launch.banner import print_banner, print_question
from scheduler_service.launch.children import POLL_S, Child, ChildFailed, Children
from scheduler_service.launch.commands import (
    child_environment,
    client_command,
    executor_command,
    gateway_command,
    prepare_model_command,
    scheduler_command,
)
from scheduler_service.launch.options import LaunchOptions
from service_support.port_check import check_listen_ports

# One logger for the whole launcher: its lines read logger=scheduler_service.launch whichever
# module wrote them.
logger = logging.getLogger("scheduler_service.launch")

# Loading SmolLM2 takes seconds, but a cold disk or a busy machine can stretch it a lot.
READY_TIMEOUT_S = 300.0
EXECUTOR_READY = re.compile(r"event=executor_ready address=\S+ port=(\d+)")
# Its metrics port too: with --metrics-port 0 the scheduler binds one and says which.
SCHEDULER_READY = re.compile(r"event=scheduler_ready address=\S+ port=(\d+) .*\bmetrics_port=(\d+)")
GATEWAY_READY = re.compile(r"event=gateway_ready address=\S+:(\d+)")


@dataclass(slots=True)
class Launcher:
    options: LaunchOptions
    children: Children = field(default_factory=Children)
    # A private folder for the executor token both services read; removed by close().
    secrets: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="splitserve-secrets-")))

    def run(self) -> int:
        self.check_ports()
        model_dir = self.options.model or self.prepare_model()
        # Executors are closed by default: this launch's own token, known to its two services
        # only, so nothing else that reaches the executor's port can drive it.
        token_file = self.secrets / "executor-token"
        write_token_file(token_file)
        _, executor_ready = self.start_service(
            "executor", executor_command(self.options, model_dir, token_file), EXECUTOR_READY
        )
        executor_address = f"{self.options.connect_host}:{executor_ready.group(1)}"
        scheduler, scheduler_ready = self.start_service(
            "scheduler",
            scheduler_command(self.options, model_dir, executor_address, token_file),
            SCHEDULER_READY,
        )
        address = f"{self.options.connect_host}:{scheduler_ready.group(1)}"
        metrics = f"http://{self.options.connect_host}:{scheduler_ready.group(2)}/metrics"
        self.wait_serving(scheduler, address)
        _, gateway_ready = self.start_service(
            "gateway", gateway_command(self.options, model_dir, address), GATEWAY_READY
        )
        status = self.ask(address) if self.options.question is not None else 0
        if self.options.once:
            return status
        gateway = f"http://{self.options.connect_host}:{gateway_ready.group(1)}"
        print_banner(address, executor_address, gateway, metrics, model_dir.name, self.children.running)
        self.children.watch()
        return 0

    def close(self) -> None:
        shutil.rmtree(self.secrets, ignore_errors=True)

    def check_ports(self) -> None:
        """Refuses taken ports (PortUnavailable) before the minute spent preparing and loading
        the model: the services would only fail to bind them afterwards."""
        options = self.options
        check_listen_ports(
            options.host,
            {
                "--port": options.port,
                "--executor-port": options.executor_port,
                "--metrics-port": options.metrics_port,
                "--gateway-port": options.gateway_port,
            },
        )

    def prepare_model(self) -> Path:
        """Runs prepare_model as a child so the launcher never holds torch's memory; its
        progress (stderr) shows on the terminal, and its last stdout line is the folder."""
        logger.info("event=model_preparing cache_dir=%s", self.options.cache_dir or "default")
        child = self.children.spawn(
            "prepare-model",
            prepare_model_command(self.options),
            env=child_environment("prepare-model", self.options),
            stdout=subprocess.PIPE,
        )
        status = self.children.wait_exit(child)
        assert child.process.stdout is not None
        lines = child.process.stdout.read().decode(errors="replace").splitlines()
        if status != 0 or not lines:
            raise ChildFailed(child, f"exited with status {status}")
        model_dir = Path(lines[-1].strip())
        logger.info("event=model_prepared path=%s", model_dir)
        return model_dir

    def start_service(
        self, name: str, command: list[str], ready: re.Pattern[str]
    ) -> tuple[Child, re.Match[str]]:
        """Starts a service logging to its own file; returns it and its ready line's match
        (the port it bound first)."""
        log_path = self.options.log_dir / f"{name}.log"
        with log_path.open("wb") as log:
            # Its own session: Ctrl-C reaches only the launcher, which then stops the services
            # in order instead of both dying mid-request with a KeyboardInterrupt.
            child = self.children.spawn(
                name,
                command,
                env=child_environment(name, self.options),
                stdout=log,
                log_path=log_path,
                new_session=True,
            )
        logger.info(
            "event=child_started name=%s pid=%d log=%s command=%s",
            name,
            child.process.pid,
            log_path,
            shlex.join(command),
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            self.children.check_stop()
            match = ready.search(log_path.read_text(errors="replace"))
            if match:
                logger.info("event=child_ready name=%s port=%s", name, match.group(1))
                return child, match
            if child.process.poll() is not None:
                raise ChildFailed(child, f"exited with status {child.process.returncode}")
            if time.monotonic() > deadline:
                raise ChildFailed(child, f"not ready after {READY_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)

    def wait_serving(self, child: Child, address: str) -> None:
        """The scheduler logs ready before it has reached its executor; its overall health
        turns SERVING when it has, and only then can it answer."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not is_serving(stub):
                self.children.check_stop()
                if child.process.poll() is not None:
                    raise ChildFailed(child, f"exited with status {child.process.returncode}")
                if time.monotonic() > deadline:
                    raise ChildFailed(child, f"not SERVING after {READY_TIMEOUT_S:.0f} s")
                time.sleep(0.2)
        logger.info("event=scheduler_serving address=%s", address)

    def ask(self, address: str) -> int:
        assert self.options.question is not None
        print_question(self.options.question)
        child = self.children.spawn(
            "client",
            client_command(self.options.question, address),
            env=child_environment("client", self.options),
        )
        status = self.children.wait_exit(child)
        logger.info("event=question_answered status=%d", status)
        return status


def is_serving(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
    except grpc.RpcError:
        return False
    return response.status == health_pb2.HealthCheckResponse.SERVING
