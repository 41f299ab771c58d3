"""`make run`: the whole system on this machine with the default model, asked one question.

    python -m scheduler_service.launch [--cache-dir DIR] [--port 50051] [--executor-port 50052]
        [--metrics-port 9400] [--threads N] [--host H] [--log-dir DIR] [--once] [--question TEXT]

Prepares SmolLM2-135M-Instruct once (python -m executor_service.prepare_model), starts one
executor and the scheduler as child processes, asks the question through the command-line client,
prints where everything listens, and serves until Ctrl-C or SIGTERM, when both children get
SIGTERM (then SIGKILL after a grace period) and the launcher exits 0. With --once it stops after
the answer and exits with the client's status. Port 0 picks a free port.

Terminal output for the user goes to stdout; the launcher's own log lines go to stderr; each
service logs to its own file, whose tail is shown if it dies.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger("scheduler_service.launch")

DEFAULT_QUESTION = "What is the capital of France?"
DEFAULT_PORT = 50051
DEFAULT_EXECUTOR_PORT = 50052
DEFAULT_METRICS_PORT = 9400
# Loading SmolLM2 takes seconds, but a cold disk or a busy machine can stretch it a lot.
READY_TIMEOUT_S = 300.0
# The executor drains in-flight calls for 5 s on SIGTERM; a little more before SIGKILL.
STOP_GRACE_S = 10.0
# A stuck system fails a question instead of hanging `--once` (and the tests) forever.
ASK_TIMEOUT_S = 120.0
POLL_S = 0.05
# linux/prctl.h
PR_SET_PDEATHSIG = 1
LOG_TAIL_LINES = 40
EXECUTOR_READY = re.compile(r"event=executor_ready address=\S+ port=(\d+)")
SCHEDULER_READY = re.compile(r"event=scheduler_ready address=\S+ port=(\d+)")
# Addresses a server binds to but a client cannot dial.
WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]", ""}


class Shutdown(Exception):
    """SIGINT or SIGTERM arrived."""


class PortTaken(Exception):
    """A fixed port is already listened on, most likely by an earlier launch still running."""


class ChildFailed(Exception):
    def __init__(self, child: Child, problem: str) -> None:
        super().__init__(f"{child.name} {problem}")
        self.child = child


@dataclass(slots=True, frozen=True)
class LaunchOptions:
    # None leaves the choice to prepare_model ($SPLITSERVE_CACHE or its default folder).
    cache_dir: Path | None
    host: str
    port: int
    executor_port: int
    metrics_port: int
    threads: int
    log_dir: Path
    once: bool
    question: str

    @property
    def connect_host(self) -> str:
        return "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host


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


@dataclass(slots=True)
class Launcher:
    options: LaunchOptions
    stop_requested: threading.Event = field(default_factory=threading.Event)
    children: list[Child] = field(default_factory=list)

    def run(self) -> int:
        self.check_ports()
        model_dir = self.prepare_model()
        _, executor_port = self.start_service(
            "executor", executor_command(self.options, model_dir), EXECUTOR_READY
        )
        executor_address = f"{self.options.connect_host}:{executor_port}"
        scheduler, port = self.start_service(
            "scheduler",
            scheduler_command(self.options, model_dir, executor_address),
            SCHEDULER_READY,
        )
        address = f"{self.options.connect_host}:{port}"
        self.wait_serving(scheduler, address)
        status = self.ask(address)
        if self.options.once:
            return status
        print_banner(self.options, address, executor_address, self.children)
        self.watch()
        return 0

    def check_ports(self) -> None:
        """gRPC binds with SO_REUSEPORT, so a second launch would silently share the ports of
        one still running (and its scheduler could reach the old executor); refuse instead."""
        options = self.options
        for flag, port in (
            ("--port", options.port),
            ("--executor-port", options.executor_port),
            ("--metrics-port", options.metrics_port),
        ):
            if port and port_taken(options.host, port):
                raise PortTaken(
                    f"{options.host}:{port} ({flag}) is already in use; stop what listens "
                    f"there or pass {flag} 0 for any free port"
                )

    def prepare_model(self) -> Path:
        """Runs prepare_model as a child so the launcher never holds torch's memory; its
        progress (stderr) shows on the terminal, and its last stdout line is the folder.
        Run by name, not imported: the scheduler side imports no executor code."""
        command = [sys.executable, "-m", "executor_service.prepare_model"]
        if self.options.cache_dir is not None:
            command += ["--cache-dir", str(self.options.cache_dir)]
        logger.info("event=model_preparing cache_dir=%s", self.options.cache_dir or "default")
        child = self.spawn("prepare-model", command, stdout=subprocess.PIPE)
        status = self.wait_exit(child)
        assert child.process.stdout is not None
        lines = child.process.stdout.read().decode(errors="replace").splitlines()
        if status != 0 or not lines:
            raise ChildFailed(child, f"exited with status {status}")
        model_dir = Path(lines[-1].strip())
        logger.info("event=model_prepared path=%s", model_dir)
        return model_dir

    def start_service(
        self, name: str, command: list[str], ready: re.Pattern[str]
    ) -> tuple[Child, int]:
        """Starts a service logging to its own file; returns it and the port of its ready
        line."""
        log_path = self.options.log_dir / f"{name}.log"
        with log_path.open("wb") as log:
            # Its own session: Ctrl-C reaches only the launcher, which then stops the services
            # in order instead of both dying mid-request with a KeyboardInterrupt.
            child = self.spawn(name, command, stdout=log, log_path=log_path, new_session=True)
        logger.info(
            "event=child_started name=%s pid=%d log=%s command=%s",
            name,
            child.process.pid,
            log_path,
            shlex.join(command),
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            self.check_stop()
            match = ready.search(log_path.read_text(errors="replace"))
            if match:
                port = int(match.group(1))
                logger.info("event=child_ready name=%s port=%d", name, port)
                return child, port
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
                self.check_stop()
                if child.process.poll() is not None:
                    raise ChildFailed(child, f"exited with status {child.process.returncode}")
                if time.monotonic() > deadline:
                    raise ChildFailed(child, f"not SERVING after {READY_TIMEOUT_S:.0f} s")
                time.sleep(0.2)
        logger.info("event=scheduler_serving address=%s", address)

    def ask(self, address: str) -> int:
        command = [
            sys.executable,
            "-m",
            "clients",
            "generate",
            "--server",
            address,
            "--chat",
            "--max-tokens",
            "64",
            "--temperature",
            "0",
            "--timeout",
            str(ASK_TIMEOUT_S),
            self.options.question,
        ]
        print(f"\n> {self.options.question}", flush=True)
        status = self.wait_exit(self.spawn("client", command))
        logger.info("event=question_answered status=%d", status)
        return status

    def watch(self) -> None:
        """Serves until a signal; a service dying on its own is an error."""
        while True:
            self.check_stop()
            for child in self.children:
                if child.log_path is not None and child.process.poll() is not None:
                    raise ChildFailed(child, f"exited with status {child.process.returncode}")
            self.stop_requested.wait(0.5)

    def spawn(
        self,
        name: str,
        command: list[str],
        *,
        stdout: IO[bytes] | int | None = None,
        log_path: Path | None = None,
        new_session: bool = False,
    ) -> Child:
        process = subprocess.Popen(
            command,
            stdout=stdout,
            stderr=subprocess.STDOUT if log_path is not None else None,
            env=child_environment(name, self.options),
            start_new_session=new_session,
            preexec_fn=die_with_parent_hook() if new_session else None,
        )
        child = Child(name, process, log_path)
        self.children.append(child)
        return child

    def wait_exit(self, child: Child) -> int:
        while (status := child.process.poll()) is None:
            self.check_stop()
            time.sleep(POLL_S)
        self.children.remove(child)
        return status

    def check_stop(self) -> None:
        if self.stop_requested.is_set():
            raise Shutdown

    def stop_all(self) -> None:
        """SIGTERM to every child at once, then SIGKILL to those still alive after the grace."""
        for child in self.children:
            if child.process.poll() is None:
                child.process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for child in reversed(self.children):
            try:
                status = child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("event=child_killed name=%s pid=%d", child.name, child.process.pid)
                child.process.kill()
                status = child.process.wait()
            logger.info("event=child_stopped name=%s status=%d", child.name, status)
        self.children.clear()


def die_with_parent_hook() -> Callable[[], None] | None:
    """On Linux, a child in its own session gets SIGTERM when the launcher dies, even by
    SIGKILL; otherwise a killed launcher would leave servers holding the default ports."""
    if not sys.platform.startswith("linux"):
        return None
    # Looked up before the fork: the hook runs between fork and exec and should do no more than
    # one system call.
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return hook


def is_serving(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
    except grpc.RpcError:
        return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def executor_command(options: LaunchOptions, model_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "executor_service",
        "--model",
        str(model_dir),
        "--host",
        options.host,
        "--port",
        str(options.executor_port),
        "--threads",
        str(options.threads),
    ]


def scheduler_command(options: LaunchOptions, model_dir: Path, executor_address: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "scheduler_service",
        "--host",
        options.host,
        "--port",
        str(options.port),
        "--executor",
        executor_address,
        "--tokenizer",
        str(model_dir),
        "--metrics-port",
        str(options.metrics_port),
    ]


def child_environment(name: str, options: LaunchOptions) -> dict[str, str]:
    # Unbuffered, so a ready line reaches the log file the moment it is written.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if name == "executor":
        # OpenMP pools beyond torch's own threads would fight them for the same cores.
        env["OMP_NUM_THREADS"] = str(options.threads)
    return env


def print_banner(
    options: LaunchOptions, address: str, executor_address: str, children: Sequence[Child]
) -> None:
    python = shlex.quote(sys.executable)
    logs = ", ".join(str(c.log_path) for c in children if c.log_path is not None)
    print(
        f"""
splitserve is running; Ctrl-C stops it.
  scheduler  {address}   (client API, grpc.health.v1, reflection)
  executor   {executor_address}   (executor API, grpc.health.v1, reflection)
  metrics    http://{options.connect_host}:{options.metrics_port}/metrics
  logs       {logs}

Try:
  {python} -m clients generate --server {address} --chat "Write a haiku about the sea"
  {python} -m clients status --server {address}
  grpcurl -plaintext {address} list
  grpcurl -plaintext {address} grpc.health.v1.Health/Check
  grpcurl -plaintext {executor_address} describe
""",
        flush=True,
    )


def port_taken(host: str, port: int) -> bool:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    try:
        # create_server sets SO_REUSEADDR, so only a live listener, not TIME_WAIT, counts.
        socket.create_server((host, port), family=family).close()
    except OSError:
        return True
    return False


def free_port(host: str) -> int:
    """A port free right now; the scheduler does not report its metrics port, so the launcher
    picks one to be able to print it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def default_threads() -> int:
    # One core is left to the scheduler and the client, which run beside the executor.
    return max(1, len(os.sched_getaffinity(0)) - 1)


def parse_args(argv: Sequence[str] | None) -> LaunchOptions:
    parser = argparse.ArgumentParser(
        prog="python -m scheduler_service.launch",
        description="Start an executor and the scheduler with the default model and ask it a "
        "question.",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="prepared model folder (default: $SPLITSERVE_CACHE or "
        "~/.cache/splitserve/models/SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address both services bind")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="scheduler; 0 = any")
    parser.add_argument("--executor-port", type=int, default=DEFAULT_EXECUTOR_PORT)
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT)
    parser.add_argument("--threads", type=int, default=None, help="executor torch threads")
    parser.add_argument("--log-dir", type=Path, default=None, help="default: a new temp dir")
    parser.add_argument("--once", action="store_true", help="stop after answering the question")
    parser.add_argument("--question", default=DEFAULT_QUESTION)
    args = parser.parse_args(argv)
    for flag in ("port", "executor_port", "metrics_port"):
        if not 0 <= getattr(args, flag) <= 65535:
            parser.error(f"--{flag.replace('_', '-')} must be within 0..65535")
    if args.threads is not None and args.threads <= 0:
        parser.error("--threads must be > 0")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="splitserve-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    return LaunchOptions(
        cache_dir=args.cache_dir,
        host=args.host,
        port=args.port,
        executor_port=args.executor_port,
        metrics_port=args.metrics_port or free_port(args.host),
        threads=args.threads or default_threads(),
        log_dir=log_dir,
        once=args.once,
        question=args.question,
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    launcher = Launcher(parse_args(argv))
    # Only a flag: the launcher acts on it at its next poll, never between two arbitrary lines.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda _signum, _frame: launcher.stop_requested.set())
    logger.info("event=launcher_starting log_dir=%s", launcher.options.log_dir)
    try:
        return launcher.run()
    except Shutdown:
        logger.info("event=shutdown_requested")
        return 0
    except PortTaken as taken:
        logger.error("event=port_taken problem=%r", str(taken))
        print(f"error: {taken}", file=sys.stderr)
        return 1
    except ChildFailed as failure:
        logger.error("event=child_failed problem=%r log=%s", str(failure), failure.child.log_path)
        tail = failure.child.tail()
        if tail:
            print(f"--- last lines of {failure.child.log_path} ---\n{tail}", file=sys.stderr)
        return 1
    finally:
        launcher.stop_all()
        logger.info("event=launcher_stopped")


if __name__ == "__main__":
    sys.exit(main())
