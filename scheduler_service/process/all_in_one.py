"""`python -m scheduler_service --frontends N` (N >= 2): one planner in this process and N
front-end processes sharing the client port (SO_REUSEPORT), so the cost of delivering tokens to
clients spreads over cores while one planner sees every request. The planner's API stays on
loopback behind a token made for this run; the front-ends get SIGTERM when this process ends
(even by SIGKILL), and one that dies is started again. Logs scheduler_listening and
scheduler_ready for the client port as the one-process scheduler does."""

import asyncio
import logging
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from protos.executor_access import write_token_file
from scheduler_service.process.planner_server import (
    PlannerHooks,
    PlannerOptions,
    serve_planner,
)
from scheduler_service.process.server_settings import ServerSettings
from scheduler_service.tier.planner_servicer import PlannerServicer
from service_support.parent_death import child_environment

logger = logging.getLogger("scheduler_service")

# linux/prctl.h
WATCH_S = 0.2
FRONTEND_STOP_S = 35.0


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (not listening) to host:port with SO_REUSEPORT: it holds the port (0:
    picks one) for the front-ends, which bind it with the same option."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    holder = socket.socket(family, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind((host, port))
    return holder


class Frontends:
    """The front-end processes: started once the planner listens, restarted if one dies,
    stopped (SIGTERM, then SIGKILL) when the planner has stopped."""

    def __init__(self, count: int, command: list[str]) -> None:
        self.count = count
        self.command = command
        self.processes: list[subprocess.Popen[bytes]] = []
        self.stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="frontend-watch", daemon=True)

    def start(self) -> None:
        self.processes = [self._spawn(index) for index in range(self.count)]
        self._watcher.start()

    def signal_all(self, signum: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signum)

    def stop(self) -> None:
        self.stopping.set()
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + FRONTEND_STOP_S
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _spawn(self, index: int) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(self.command, env=child_environment())
        logger.info("event=frontend_started index=%d pid=%d", index, process.pid)
        return process

    def _watch(self) -> None:
        while not self.stopping.wait(WATCH_S):
            for index, process in enumerate(self.processes):
                if process.poll() is not None and not self.stopping.is_set():
                    logger.warning("event=frontend_died index=%d pid=%d status=%d", index, process.pid, process.returncode)
                    self.processes[index] = self._spawn(index)


def run_all_in_one(
    settings: ServerSettings, count: int, argv: Sequence[str], run: Callable[[Coroutine[Any, Any, int]], int]
) -> int:
    """run: what runs the planner's coroutine (asyncio.run or uvloop.run: process/event_loop.py)."""
    holder = reserve_port(settings.host, settings.port)
    client_port = holder.getsockname()[1]
    secrets = Path(tempfile.mkdtemp(prefix="splitserve-planner-"))
    token_file = secrets / "planner-token"
    token = write_token_file(token_file)
    frontends: Frontends | None = None
    executors = ",".join(settings.executors)
    state = {"listening": False, "ready": False}
    metrics_port: int | None = None

    def on_listening(planner_port: int, planner_metrics_port: int | None) -> None:
        nonlocal frontends, metrics_port
        metrics_port = planner_metrics_port
        command = [
            sys.executable, "-m", "scheduler_service", *argv,
            "--role", "frontend", "--planner", f"127.0.0.1:{planner_port}",
            "--planner-token-file", str(token_file), "--port", str(client_port), "--reuse-port",
        ]
        frontends = Frontends(count, command)
        frontends.start()

    def on_servicer(servicer: PlannerServicer) -> None:
        async def announce() -> None:
            # The client port answers once every front-end listens (they connect to the planner
            # right after), and serves once the planner does too.
            while True:
                connected = len(servicer.links) >= count
                if connected and not state["listening"]:
                    state["listening"] = True
                    logger.info(
                        "event=scheduler_listening address=%s:%d port=%d executors=%s scheduler_id=%s frontends=%d",
                        settings.host, client_port, client_port, executors, servicer.engine.scheduler_id, count,
                    )
                if connected and servicer.engine.serving and not state["ready"]:
                    state["ready"] = True
                    logger.info(
                        "event=scheduler_ready address=%s:%d port=%d executors=%s metrics_port=%s frontends=%d",
                        settings.host, client_port, client_port, executors, metrics_port, count,
                    )
                    return
                await asyncio.sleep(0.05)

        asyncio.get_running_loop().create_task(announce())

    planner_settings = replace(settings, port=0)
    try:
        return run(
            serve_planner(
                planner_settings,
                PlannerOptions(token=token, api_host="127.0.0.1", drain_on_stop=True),
                PlannerHooks(on_listening=on_listening, on_servicer=on_servicer),
            )
        )
    finally:
        if frontends is not None:
            frontends.stop()
        holder.close()
        shutil.rmtree(secrets, ignore_errors=True)
