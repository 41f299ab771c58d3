"""Runs the scheduler service: the Generation API, health, reflection, metrics, the engine."""

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from protos.limits import MAX_MESSAGE_BYTES
from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc
from scheduler_service.service.engine import Engine, EngineOptions
from scheduler_service.service.executor_link import ExecutorLink
from scheduler_service.service.gc_tuning import tune_gc
from scheduler_service.service.metrics import SchedulerMetrics
from scheduler_service.service.servicer import GenerationServicer
from scheduler_service.text.tokenizer import TextProcessor

logger = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
SHUTDOWN_GRACE_S = 5.0


@dataclass(slots=True, frozen=True)
class ServerSettings:
    host: str
    port: int
    executor_address: str
    options: EngineOptions
    text: TextProcessor | None = None
    metrics_port: int | None = None


async def serve(settings: ServerSettings) -> int:
    """Serves until SIGTERM/SIGINT (exit status 0) or until the engine fails (1)."""
    metrics = SchedulerMetrics()
    health_servicer = health.aio.HealthServicer()

    # Health updates run as tasks (the engine reports from synchronous code); held here so
    # they are not garbage-collected before they run.
    health_updates: set[asyncio.Task[None]] = set()

    def report_executor(up: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            task = asyncio.get_running_loop().create_task(health_servicer.set(name, status))
            health_updates.add(task)
            task.add_done_callback(health_updates.discard)

    engine = Engine(ExecutorLink(settings.executor_address), settings.text, settings.options, metrics, report_executor)
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # A second copy on a taken port must fail to bind, not silently share it.
            ("grpc.so_reuseport", 0),
        ]
    )
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(engine), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    await server.start()
    if settings.metrics_port is not None:
        start_http_server(settings.metrics_port, addr=settings.host, registry=metrics.registry)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    logger.info("event=scheduler_listening port=%d executor=%s", port, settings.executor_address)

    async def connect_then_run() -> None:
        await engine.connect()
        tune_gc()
        logger.info(
            "event=scheduler_ready address=%s:%d port=%d executor=%s metrics_port=%s",
            settings.host, port, port, settings.executor_address, settings.metrics_port,
        )
        await engine.run()

    runner = asyncio.create_task(connect_then_run())
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({runner, waiter}, return_when=asyncio.FIRST_COMPLETED)
    failed = runner.done() and runner.exception() is not None
    if failed:
        logger.error("event=engine_failed error=%r", runner.exception())
    logger.info("event=scheduler_stopping")
    engine.abort_all()
    await server.stop(SHUTDOWN_GRACE_S)
    runner.cancel()
    waiter.cancel()
    await engine.link.close()
    logger.info("event=scheduler_stopped")
    return 1 if failed else 0
