"""The front-end role (`--role frontend --planner HOST:PORT ...`): the client port exactly as the
all-in-one scheduler serves it (Generation and Admin, keys, TLS, limits, health, reflection),
with tokenizing, chat templates, detokenizing, stop strings and streaming here, and planning
done by a planner (tier/planner_client.py). Several front-ends may share one port (--reuse-port)."""

import asyncio
import logging
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass

from scheduler_service.frontend.request_intake import Intake
from scheduler_service.process.client_port import (
    HealthReporter,
    bind_client_port,
    client_server,
)
from scheduler_service.process.heap_tuning import fix_mmap_threshold
from scheduler_service.process.server import DRAIN_POLL_S, SHUTDOWN_GRACE_S
from scheduler_service.process.server_settings import ServerSettings
from scheduler_service.tier.admin_forwarder import AdminForwarder
from scheduler_service.tier.planner_client import PlannerClient
from service_support.health_port import start_health_port
from service_support.transport_security import ClientTls

logger = logging.getLogger("scheduler_service.frontend")


@dataclass(slots=True, frozen=True)
class FrontendOptions:
    planners: tuple[str, ...]
    # The planners' shared token; None for an insecure planner.
    token: str | None
    # Share the client port with other front-ends (SO_REUSEPORT); its owner checked it.
    reuse_port: bool = False
    # How it verifies planners that serve TLS; None: plaintext.
    planner_tls: ClientTls | None = None


def frontend_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


async def serve_frontend(settings: ServerSettings, options: FrontendOptions) -> int:
    """Serves until SIGTERM/SIGINT, then drains: health NOT_SERVING, new streams refused, those
    in flight finish within --drain-timeout; exit status 0."""
    fix_mmap_threshold()
    health_reporter = HealthReporter()
    ready = asyncio.Event()

    def report_serving(up: bool) -> None:
        health_reporter.report(up)
        if up:
            ready.set()

    options_ = settings.options
    client = PlannerClient(
        options.planners,
        options.token,
        settings.text,
        frontend_id(),
        options_.stream_interval,
        options_.stream_backlog,
        options_.no_executor_timeout_s,
        report_serving,
        options.planner_tls,
    )
    intake = Intake(settings.text, settings.limits, settings.sampling_defaults)
    server = client_server(settings, client, intake, AdminForwarder(client), health_reporter, options.reuse_port)
    await health_reporter.start()
    port = bind_client_port(server, settings)
    await server.start()
    health_server = None
    # A front-end sharing its port with others leaves the health port to their owner.
    if settings.health_port is not None and not options.reuse_port:
        health_server, health_port = await start_health_port(health_reporter.servicer, settings.host, settings.health_port)
        logger.info("event=health_port_listening address=%s:%d", settings.host, health_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    logger.info(
        "event=frontend_listening address=%s:%d port=%d frontend=%s planners=%s tls=%s planner_tls=%s",
        settings.host, port, port, client.frontend_id, ",".join(options.planners), "on" if settings.tls else "off",
        ("mutual" if options.planner_tls.mutual else "on") if options.planner_tls else "off",
    )
    runner = asyncio.create_task(client.run())

    async def log_ready() -> None:
        await ready.wait()
        logger.info("event=frontend_ready address=%s:%d port=%d frontend=%s", settings.host, port, port, client.frontend_id)

    ready_logger = asyncio.create_task(log_ready())
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({runner, waiter}, return_when=asyncio.FIRST_COMPLETED)
    client.draining = True
    deadline = time.monotonic() + settings.drain_timeout_s
    logger.info("event=frontend_draining in_flight=%d timeout_s=%.1f", client.num_in_flight, settings.drain_timeout_s)
    while client.num_in_flight and time.monotonic() < deadline and not runner.done():
        await asyncio.sleep(DRAIN_POLL_S)
    logger.info("event=frontend_drained left=%d", client.num_in_flight)
    client.abort_all()
    await server.stop(SHUTDOWN_GRACE_S)
    if health_server is not None:
        await health_server.stop(None)
    runner.cancel()
    waiter.cancel()
    ready_logger.cancel()
    intake.close()
    await client.close()
    logger.info("event=frontend_stopped")
    return 0
