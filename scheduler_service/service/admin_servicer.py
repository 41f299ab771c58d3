"""The Admin service: taking executors out of service and back (protos/splitserve/v1/admin.proto)."""

import logging

import grpc

from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import RequestRejected
from scheduler_service.service.engine import Engine
from scheduler_service.service.executor_status import executor_status
from scheduler_service.service.status_codes import STATUS_CODES

logger = logging.getLogger(__name__)


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def DrainExecutor(
        self, request: admin_pb2.DrainExecutorRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExecutorStatus:
        try:
            lane = self.engine.drain(request.address)
        except RequestRejected as rejected:
            await context.abort(STATUS_CODES[rejected.kind], str(rejected))
        logger.info("event=executor_drain_requested address=%r peer=%s", request.address, context.peer())
        return executor_status(lane)

    async def ResumeExecutor(
        self, request: admin_pb2.ResumeExecutorRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExecutorStatus:
        try:
            lane = self.engine.resume(request.address)
        except RequestRejected as rejected:
            await context.abort(STATUS_CODES[rejected.kind], str(rejected))
        logger.info("event=executor_resume_requested address=%r peer=%s", request.address, context.peer())
        return executor_status(lane)
