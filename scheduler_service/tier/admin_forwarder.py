"""Admin on a front-end: each call goes to the planner the front-end uses, which owns the
executors and the knobs; the front-end's own interceptor has checked the caller's admin key."""

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.tier.planner_client import PlannerClient

logger = logging.getLogger(__name__)

Reply = TypeVar("Reply", bound=Message)
ADMIN_TIMEOUT_S = 120.0


class AdminForwarder(admin_pb2_grpc.AdminServicer):
    def __init__(self, client: PlannerClient) -> None:
        self.client = client

    async def _forward(
        self, call: Callable[[admin_pb2_grpc.AdminStub], Callable[..., Awaitable[Reply]]], request: Message,
        context: grpc.aio.ServicerContext,
    ) -> Reply:
        link = self.client.current
        if link is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"no planner to ask: {self.client.why_no_executor()}")
        try:
            return await call(admin_pb2_grpc.AdminStub(link.channel))(
                request, metadata=link.metadata, timeout=ADMIN_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or error.code().name)

    async def DrainExecutor(self, request: admin_pb2.DrainExecutorRequest, context: grpc.aio.ServicerContext) -> pb.ExecutorStatus:
        return await self._forward(lambda stub: stub.DrainExecutor, request, context)

    async def ResumeExecutor(self, request: admin_pb2.ResumeExecutorRequest, context: grpc.aio.ServicerContext) -> pb.ExecutorStatus:
        return await self._forward(lambda stub: stub.ResumeExecutor, request, context)

    async def Audit(self, request: admin_pb2.AuditRequest, context: grpc.aio.ServicerContext) -> admin_pb2.AuditReport:
        return await self._forward(lambda stub: stub.Audit, request, context)

    async def GetSchedulingConfig(
        self, request: admin_pb2.GetSchedulingConfigRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SchedulingConfig:
        return await self._forward(lambda stub: stub.GetSchedulingConfig, request, context)

    async def ReloadTenants(
        self, request: admin_pb2.ReloadTenantsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.TenantsReport:
        return await self._forward(lambda stub: stub.ReloadTenants, request, context)

    async def GetTenants(self, request: admin_pb2.GetTenantsRequest, context: grpc.aio.ServicerContext) -> admin_pb2.TenantsReport:
        return await self._forward(lambda stub: stub.GetTenants, request, context)

    async def UpdateSchedulingConfig(
        self, request: admin_pb2.UpdateSchedulingConfigRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SchedulingConfig:
        return await self._forward(lambda stub: stub.UpdateSchedulingConfig, request, context)
