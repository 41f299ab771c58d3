"""Runs the scheduler service: the Generation API, health, reflection, metrics, the engine."""

import asyncio
import functools
import logging
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from protos.health_port import start_health_port
from protos.limits import MAX_MESSAGE_BYTES
from protos.splitserve.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)
from protos.transport_security import ClientTls, ServerTls
from scheduler_service.core.sampling_params import SamplingDefaults
from scheduler_service.service.admin_servicer import AdminServicer
from scheduler_service.service.api_keys import ApiKeyInterceptor
from scheduler_service.service.discovery import DEFAULT_RESOLVE_INTERVAL_S, discover
from scheduler_service.service.engine import Engine, EngineOptions
from scheduler_service.service.executor_link import ExecutorLink
from scheduler_service.service.gc_tuning import tune_gc
from scheduler_service.service.heap_tuning import fix_mmap_threshold
from scheduler_service.service.intake_limits import IntakeLimits
from scheduler_service.service.message_parsing import MessageParsingInterceptor
from scheduler_service.service.metrics import SchedulerMetrics
from scheduler_service.service.request_intake import Intake
from scheduler_service.service.servicer import GenerationServicer
from scheduler_service.service.step_trace import StepTrace
from scheduler_service.service.tracing import NO_TRACING, Tracing
from scheduler_service.text.tokenizer import TextProcessor

logger = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
SHUTDOWN_GRACE_S = 5.0
# Under Kubernetes' default 30 s termination grace, with room to stop after the drain.
DEFAULT_DRAIN_TIMEOUT_S = 25.0
DRAIN_POLL_S = 0.05


@dataclass(slots=True, frozen=True)
class ServerSettings:
    host: str
    port: int
    # HOST:PORT or dns:///NAME:PORT, one or more.
    executors: tuple[str, ...]
    options: EngineOptions
    text: TextProcessor | None = None
    metrics_port: int | None = None
    # Presented to executors on Execute; default HOSTNAME:PORT (the bound port).
    scheduler_id: str | None = None
    resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S
    limits: IntakeLimits = field(default_factory=IntakeLimits)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # TLS on the client API.
    tls: ServerTls | None = None
    # Bearer tokens a client must present (None: no token needed).
    api_keys: tuple[bytes, ...] | None = None
    # Bearer tokens the Admin service takes instead (None: Admin is closed if api_keys are set).
    admin_keys: tuple[bytes, ...] | None = None
    # TLS to the executors (mutual when it holds a certificate).
    executor_tls: ClientTls | None = None
    # The executors' shared token (--executor-token-file), sent on every Executor API call.
    executor_token: str | None = None
    # Plaintext grpc.health.v1-only port for probes.
    health_port: int | None = None
    # On SIGTERM, seconds the requests in flight get to finish before they are aborted.
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # Where spans go (service/tracing.py); NO_TRACING keeps tracing off and free.
    tracing: Tracing = NO_TRACING
    # Where the step trace goes (service/step_trace.py); None keeps it off.
    trace_dir: Path | None = None


async def serve(settings: ServerSettings) -> int:
    """Serves until SIGTERM/SIGINT (exit status 0) or until the engine fails (1)."""
    fix_mmap_threshold()
    metrics = SchedulerMetrics()
    health_servicer = health.aio.HealthServicer()

    # Health updates run as tasks (the engine reports from synchronous code); held here so
    # they are not garbage-collected before they run.
    health_updates: set[asyncio.Task[None]] = set()

    def report_serving(up: bool) -> None:
        serving = up and not engine.draining
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            task = asyncio.get_running_loop().create_task(health_servicer.set(name, status))
            health_updates.add(task)
            task.add_done_callback(health_updates.discard)

    link_factory = functools.partial(ExecutorLink, tls=settings.executor_tls, token=settings.executor_token)
    step_trace = StepTrace(settings.trace_dir) if settings.trace_dir is not None else None
    engine = Engine(
        "", settings.text, settings.options, metrics, report_serving, link_factory, settings.tracing,
        step_trace,
    )
    intake = Intake(settings.text, settings.limits, settings.sampling_defaults)
    receive_limit = settings.limits.receive_limit_bytes()
    interceptors: list[grpc.aio.ServerInterceptor] = [MessageParsingInterceptor(receive_limit)]
    if settings.api_keys is not None or settings.admin_keys is not None:
        # First in the chain: an unauthenticated call is refused before its request is parsed.
        interceptors.insert(0, ApiKeyInterceptor(settings.api_keys, settings.admin_keys))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # A ceiling on what is buffered at all; between the caps' receive limit and this,
            # a request is refused unparsed by MessageParsingInterceptor, naming its field.
            ("grpc.max_receive_message_length", settings.limits.transport_limit_bytes()),
            # A second copy on a taken port must fail to bind, not silently share it.
            ("grpc.so_reuseport", 0),
            # Calls that arrived while the event loop was busy wait in grpc's backlog until the
            # server takes them; past 1,000 grpc drops some at random with a bare CANCELLED. A
            # burst of streams must queue instead, up to --max-waiting, past which the client
            # gets RESOURCE_EXHAUSTED saying so.
            ("grpc.server.max_pending_requests", settings.options.max_waiting),
            ("grpc.server.max_pending_requests_hard_limit", 2 * settings.options.max_waiting),
        ]
    )
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(engine, intake), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(engine), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            ADMIN_SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{settings.host}:{settings.port}"
    if settings.tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, settings.tls.credentials())
    await server.start()
    health_server = None
    if settings.health_port is not None:
        health_server, health_port = await start_health_port(health_servicer, settings.host, settings.health_port)
        logger.info("event=health_port_listening address=%s:%d", settings.host, health_port)
    if settings.metrics_port is not None:
        start_http_server(settings.metrics_port, addr=settings.host, registry=metrics.registry)

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

    async def connect_then_run() -> None:
        discovery = asyncio.create_task(discover(engine, settings.executors, settings.resolve_interval_s))
        running = asyncio.create_task(engine.run())
        serving = asyncio.create_task(engine.wait_until_serving())
        try:
            # A lane that fails before any executor is up must not leave us waiting forever.
            await asyncio.wait({running, serving}, return_when=asyncio.FIRST_COMPLETED)
            if serving.done():
                tune_gc()
                logger.info(
                    "event=scheduler_ready address=%s:%d port=%d executors=%s metrics_port=%s",
                    settings.host, port, port, executors, settings.metrics_port,
                )
            await running
        finally:
            discovery.cancel()
            serving.cancel()
            running.cancel()

    runner = asyncio.create_task(connect_then_run())
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
