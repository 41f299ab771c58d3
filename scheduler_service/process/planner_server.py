"""The planner role (`--role planner`): the engine and its executors, served to front-ends over
the Planner API, with Admin, health, reflection and the metrics on the same host.

Every metric the all-in-one scheduler has is the planner's here (queues, KV, executors, and the
requests' latencies, measured from when their front-end received them), so one scrape of the
planner covers the tier.
"""

import asyncio
import functools
import ipaddress
import logging
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.limits import MAX_MESSAGE_BYTES
from protos.splitserve.planner.v1 import planner_pb2, planner_pb2_grpc
from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc
from scheduler_service.planner.admin_servicer import AdminServicer
from scheduler_service.planner.engine import Engine
from scheduler_service.planner.executor_link import KEEPALIVE_OPTIONS, ExecutorLink
from scheduler_service.planner.metrics import SchedulerMetrics
from scheduler_service.planner.step_trace import StepTrace
from scheduler_service.process.heap_tuning import fix_mmap_threshold
from scheduler_service.process.server import SHUTDOWN_GRACE_S, connect_then_run, drain
from scheduler_service.process.server_settings import ServerSettings
from scheduler_service.tier.planner_access import PlannerTokenInterceptor
from scheduler_service.tier.planner_servicer import PlannerServicer
from service_support.health_port import start_health_port
from service_support.metrics_port import serve_metrics
from service_support.transport_security import ServerTls

logger = logging.getLogger("scheduler_service.planner")

PLANNER_SERVICE_NAME = planner_pb2.DESCRIPTOR.services_by_name["Planner"].full_name
ADMIN_SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


@dataclass(slots=True, frozen=True)
class PlannerOptions:
    # The planners' shared token front-ends send; None with insecure (anyone may call).
    token: str | None
    insecure: bool = False
    # Where the Planner API listens, when not on the settings' host (all_in_one.py keeps it on
    # loopback while health and metrics listen where the client port does).
    api_host: str | None = None
    # On SIGTERM, let the requests in flight finish here (--drain-timeout) before stopping, as
    # the all-in-one scheduler does; otherwise hand over at once: the front-ends' streams and
    # the executors' are closed, so a standby planner takes the executors and the front-ends
    # re-submit their requests to it (or to this planner restarted) with the tokens they have.
    drain_on_stop: bool = False
    # TLS of the Planner API (--tls-cert/--tls-key of --role planner); None: plaintext, as the
    # all-in-one scheduler's loopback planner is.
    tls: ServerTls | None = None


@dataclass(slots=True)
class PlannerHooks:
    """For a process that runs the planner beside front-ends of its own (all_in_one.py)."""

    # Called with the bound ports once the Planner API listens: its own, and the metrics
    # endpoint's (None without one).
    on_listening: Callable[[int, int | None], None] = lambda port, metrics_port: None
    # Called with the servicer once built (to watch its front-ends).
    on_servicer: Callable[[PlannerServicer], None] = lambda servicer: None


async def serve_planner(settings: ServerSettings, options: PlannerOptions, hooks: PlannerHooks | None = None) -> int:
    """Serves until SIGTERM/SIGINT (exit status 0) or until the engine fails (1)."""
    hooks = hooks or PlannerHooks()
    fix_mmap_threshold()
    metrics = SchedulerMetrics()
    health_servicer = health.aio.HealthServicer()
    updates: set[asyncio.Task[None]] = set()
    servicer: PlannerServicer | None = None

    def report_serving(up: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if up and not engine.draining else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", PLANNER_SERVICE_NAME):
            task = asyncio.get_running_loop().create_task(health_servicer.set(name, status))
            updates.add(task)
            task.add_done_callback(updates.discard)
        if servicer is not None:
            servicer.status_changed()

    link_factory = functools.partial(ExecutorLink, tls=settings.executor_tls, token=settings.executor_token)
    step_trace = StepTrace(settings.trace_dir) if settings.trace_dir is not None else None
    engine = Engine(
        "", settings.text, settings.options, metrics, report_serving, link_factory, settings.tracing, step_trace,
        tenants=settings.tenants,
    )
    engine.queue_before_first_executor = True
    servicer = PlannerServicer(engine)
    hooks.on_servicer(servicer)
    interceptors = [] if options.insecure else [PlannerTokenInterceptor(options.token or "")]
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            # A frozen front-end's stream ends within 10-20 s, and its requests with it.
            *KEEPALIVE_OPTIONS,
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    planner_pb2_grpc.add_PlannerServicer_to_server(servicer, server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(engine), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (PLANNER_SERVICE_NAME, ADMIN_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    for name in ("", PLANNER_SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    api_host = options.api_host or settings.host
    address = f"{api_host}:{settings.port}"
    port = server.add_secure_port(address, options.tls.credentials()) if options.tls else server.add_insecure_port(address)
    await server.start()
    health_server = None
    if settings.health_port is not None:
        health_server, health_port = await start_health_port(health_servicer, settings.host, settings.health_port)
        logger.info("event=health_port_listening address=%s:%d", settings.host, health_port)
    metrics_port = serve_metrics(settings.metrics_port, settings.host, metrics.registry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    engine.scheduler_id = settings.scheduler_id or f"{socket.gethostname()}:{port}"
    executors = ",".join(settings.executors)
    logger.info(
        "event=planner_listening address=%s:%d port=%d executors=%s scheduler_id=%s access=%s tls=%s",
        api_host, port, port, executors, engine.scheduler_id, "insecure" if options.insecure else "token",
        ("mutual" if options.tls.mutual else "on") if options.tls else "off",
    )
    if options.tls is None and not options.insecure and not _is_loopback(api_host):
        logger.warning(
            "event=planner_token_in_clear address=%s:%d advice='front-ends send the planner token in "
            "plaintext, readable by anyone on the network between them: give the planner --tls-cert "
            "and --tls-key, and its front-ends --planner-tls-ca'",
            api_host, port,
        )
    if options.insecure:
        logger.warning(
            "event=planner_insecure advice='anyone who reaches this port can submit requests, read "
            "their tokens and drain executors: use --planner-token-file'"
        )
    hooks.on_listening(port, metrics_port)

    def ready() -> None:
        logger.info(
            "event=planner_ready address=%s:%d port=%d executors=%s metrics_port=%s",
            api_host, port, port, executors, metrics_port,
        )

    runner = asyncio.create_task(connect_then_run(engine, settings, ready))
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({runner, waiter}, return_when=asyncio.FIRST_COMPLETED)
    failed = runner.done() and runner.exception() is not None
    if failed:
        logger.error("event=engine_failed error=%r", runner.exception())
    elif options.drain_on_stop:
        await drain(engine, runner, report_serving, settings.drain_timeout_s)
    logger.info(
        "event=planner_stopping handing_over=%d", 0 if options.drain_on_stop else engine.num_waiting + engine.num_running
    )
    # Front-ends first: told nothing ended, they take what runs here to the next planner.
    for link in list(servicer.links.values()):
        link.close()
    engine.abort_all()
    await server.stop(SHUTDOWN_GRACE_S)
    if health_server is not None:
        await health_server.stop(None)
    runner.cancel()
    waiter.cancel()
    await engine.close()
    settings.tracing.shutdown()
    if step_trace is not None:
        step_trace.close()
    logger.info("event=planner_stopped")
    return 1 if failed else 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
