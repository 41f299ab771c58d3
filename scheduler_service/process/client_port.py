"""The client port, as an all-in-one scheduler and a front-end both serve it: Generation and
Admin behind the API-key and message-size interceptors, health and reflection, over TLS when
configured."""

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.limits import MAX_MESSAGE_BYTES
from protos.splitserve.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)
from scheduler_service.frontend.api_keys import ApiKeyInterceptor
from scheduler_service.frontend.backend import Backend
from scheduler_service.frontend.message_parsing import MessageParsingInterceptor
from scheduler_service.frontend.request_intake import PARSED_BY_INTAKE, Intake
from scheduler_service.frontend.servicer import GenerationServicer
from scheduler_service.frontend.tenant_of import TenantOf
from scheduler_service.process.server_settings import ServerSettings

logger = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


class HealthReporter:
    """grpc.health.v1 of the client port: NOT_SERVING until told otherwise. Updates run as
    tasks (the engine reports from synchronous code), held here until they have run."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self._updates: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        for name in ("", SERVICE_NAME):
            await self.servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def report(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            task = asyncio.get_running_loop().create_task(self.servicer.set(name, status))
            self._updates.add(task)
            task.add_done_callback(self._updates.discard)


# How long a call may wait in grpc's queue before the server takes it (a day: no limit of
# grpc's own, see client_server).
UNTAKEN_CALL_LIMIT_S = 24 * 3600


def client_server(
    settings: ServerSettings,
    backend: Backend,
    intake: Intake,
    admin: admin_pb2_grpc.AdminServicer,
    health_reporter: HealthReporter,
    reuse_port: bool = False,
) -> grpc.aio.Server:
    """The server, its services added; bind_client_port() then binds it. reuse_port: one of
    several front-ends sharing the port (SO_REUSEPORT), whose owner checked it was free."""
    interceptors: list[grpc.aio.ServerInterceptor] = [
        MessageParsingInterceptor(settings.limits.receive_limit_bytes(), PARSED_BY_INTAKE)
    ]
    if settings.api_keys is not None or settings.admin_keys is not None:
        # First in the chain: an unauthenticated call is refused before its request is parsed.
        client_keys = tuple(settings.api_keys) if settings.api_keys is not None else None
        interceptors.insert(0, ApiKeyInterceptor(client_keys, settings.admin_keys))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # A ceiling on what is buffered at all; between the caps' receive limit and this,
            # a request is refused unparsed by MessageParsingInterceptor, naming its field.
            ("grpc.max_receive_message_length", settings.limits.transport_limit_bytes()),
            # Alone on its port, a second copy on a taken port must fail to bind, not silently
            # share it.
            ("grpc.so_reuseport", 1 if reuse_port else 0),
            # Calls that arrived while the event loop was busy wait in grpc's backlog until the
            # server takes them; past 1,000 grpc drops some at random with a bare CANCELLED. A
            # burst of streams must queue instead, up to --max-waiting, past which the client
            # gets RESOURCE_EXHAUSTED saying so.
            ("grpc.server.max_pending_requests", settings.options.max_waiting),
            ("grpc.server.max_pending_requests_hard_limit", 2 * settings.options.max_waiting),
            # grpc cancels a call the server has not taken within 30 s, with a bare CANCELLED
            # that reads as the client's own doing: 2,757 of 4,096 streams opened at once
            # against two busy front-ends (bench.scale, 16 x 256) ended so. A queued call waits
            # instead, bounded by the limits above and the client's deadline.
            ("grpc.server_max_unrequested_time_in_server", UNTAKEN_CALL_LIMIT_S),
        ],
    )
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(backend, intake, TenantOf(settings.api_keys)), server)
    admin_pb2_grpc.add_AdminServicer_to_server(admin, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_reporter.servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            ADMIN_SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    return server


def bind_client_port(server: grpc.aio.Server, settings: ServerSettings) -> int:
    address = f"{settings.host}:{settings.port}"
    if settings.tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, settings.tls.credentials())
