"""Runs the all-in-one scheduler service in one process: the client port (client_port.py), the
engine and its executors, metrics; the tier's roles run in planner_server.py and
frontend_server.py."""

import asyncio
import functools
import logging
import signal
import socket
import time
from collections.abc import Callable

from scheduler_service.frontend.request_intake import Intake
from scheduler_service.planner.admin_servicer import AdminServicer
from scheduler_service.planner.discovery import discover
from scheduler_service.planner.engine import Engine
from scheduler_service.planner.executor_link import ExecutorLink
from scheduler_service.planner.metrics import SchedulerMetrics
from scheduler_service.planner.step_trace import StepTrace
from scheduler_service.process.client_port import (
    HealthReporter,
    bind_client_port,
    client_server,
)
from scheduler_service.process.gc_tuning import tune_gc
from scheduler_service.process.heap_tuning import fix_mmap_threshold
from scheduler_service.process.server_settings import (
    DEFAULT_DRAIN_TIMEOUT_S,
    ServerSettings,
)
from scheduler_service.structured.grammars import Grammars
from service_support.health_port import start_health_port
from service_support.metrics_port import serve_metrics

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0
DRAIN_POLL_S = 0.05
__all__ = ["DEFAULT_DRAIN_TIMEOUT_S", "SHUTDOWN_GRACE_S", "ServerSettings", "drain", "serve"]


async def serve(settings: ServerSettings) -> int:
    """Serves until SIGTERM/SIGINT (exit status 0) or until the engine fails (1)."""
    fix_mmap_threshold()
    metrics = SchedulerMetrics()
    health_reporter = HealthReporter()

    def report_serving(up: bool) -> None:
        health_reporter.report(up and not engine.draining)

    link_factory = functools.partial(ExecutorLink, tls=settings.executor_tls, token=settings.executor_token)
    step_trace = StepTrace(settings.trace_dir) if settings.trace_dir is not None else None
    # One cache of compiled grammars for the intake (which compiles) and the engine (which uses).
    grammars = Grammars(settings.text)
    engine = Engine(
        "", settings.text, settings.options, metrics, report_serving, link_factory, settings.tracing,
        step_trace, grammars, settings.tenants,
    )
    intake = Intake(settings.text, settings.limits, settings.sampling_defaults, grammars)
    receive_limit = settings.limits.receive_limit_bytes()
    server = client_server(settings, engine, intake, AdminServicer(engine), health_reporter)
    await health_reporter.start()
    port = bind_client_port(server, settings)
    await server.start()
    health_server = None
    if settings.health_port is not None:
        health_server, health_port = await start_health_port(health_reporter.servicer, settings.host, settings.health_port)
        logger.info("event=health_port_listening address=%s:%d", settings.host, health_port)
    metrics_port = serve_metrics(settings.metrics_port, settings.host, metrics.registry)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    engine.scheduler_id = settings.scheduler_id or f"{socket.gethostname()}:{port}"
    executors = ",".join(settings.executors)
    logger.info(
        "event=scheduler_listening address=%s:%d port=%d executors=%s scheduler_id=%s tls=%s "
        "api_keys=%s admin_keys=%s executor_tls=%s executor_token=%s receive_limit_bytes=%d "
        "max_message_bytes=%d",
        settings.host, port, port, executors, engine.scheduler_id,
        "on" if settings.tls else "off",
        len(settings.api_keys) if settings.api_keys else "off",
        len(settings.admin_keys) if settings.admin_keys else "off",
        "off" if settings.executor_tls is None else "mutual" if settings.executor_tls.mutual else "server",
        "on" if settings.executor_token else "off",
        receive_limit,
        settings.limits.transport_limit_bytes(),
    )

    def ready() -> None:
        logger.info(
            "event=scheduler_ready address=%s:%d port=%d executors=%s metrics_port=%s",
            settings.host, port, port, executors, metrics_port,
        )

    runner = asyncio.create_task(connect_then_run(engine, settings, ready))
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({runner, waiter}, return_when=asyncio.FIRST_COMPLETED)
    failed = runner.done() and runner.exception() is not None
    if failed:
        logger.error("event=engine_failed error=%r", runner.exception())
    else:
        await drain(engine, runner, report_serving, settings.drain_timeout_s)
    logger.info("event=scheduler_stopping")
    engine.abort_all()
    await server.stop(SHUTDOWN_GRACE_S)
    if health_server is not None:
        await health_server.stop(None)
    runner.cancel()
    waiter.cancel()
    intake.close()
    await engine.close()
    # Flushes the spans still batched for export.
    settings.tracing.shutdown()
    if step_trace is not None:
        step_trace.close()
    logger.info("event=scheduler_stopped")
    return 1 if failed else 0


async def connect_then_run(engine: Engine, settings: ServerSettings, on_ready: Callable[[], None]) -> None:
    """Finds the executors and runs the engine until it ends; once the first executor serves,
    the collector is tuned and on_ready says so."""
    discovery = asyncio.create_task(discover(engine, settings.executors, settings.resolve_interval_s))
    running = asyncio.create_task(engine.run())
    serving = asyncio.create_task(engine.wait_until_serving())
    try:
        # A lane that fails before any executor is up must not leave us waiting forever.
        await asyncio.wait({running, serving}, return_when=asyncio.FIRST_COMPLETED)
        if serving.done():
            tune_gc()
            on_ready()
        await running
    finally:
        discovery.cancel()
        serving.cancel()
        running.cancel()


async def drain(
    engine: Engine, runner: asyncio.Task[None], report_serving: Callable[[bool], None], timeout_s: float
) -> None:
    """What a supervisor's SIGTERM asks for: health NOT_SERVING (load balancers stop sending),
    new requests refused with UNAVAILABLE, those in flight run to their end for up to
    timeout_s. Whatever is left is aborted by the caller."""
    engine.draining = True
    report_serving(False)
    deadline = time.monotonic() + timeout_s
    in_flight = engine.num_waiting + engine.num_running
    logger.info("event=scheduler_draining in_flight=%d timeout_s=%.1f", in_flight, timeout_s)
    while in_flight and time.monotonic() < deadline and not runner.done():
        await asyncio.sleep(DRAIN_POLL_S)
        in_flight = engine.num_waiting + engine.num_running
    logger.info("event=scheduler_drained left=%d", in_flight)
