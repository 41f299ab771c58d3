"""The Admin service: taking executors out of service and back, and the scheduling knobs
(protos/splitserve/v1/admin.proto)."""

import logging
from dataclasses import replace

import grpc

from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.config import SchedulingKnobs
from scheduler_service.core.errors import RequestRejected
from scheduler_service.core.policy import Policy, StepMode
from scheduler_service.frontend.status_codes import STATUS_CODES
from scheduler_service.planner.engine import Engine
from scheduler_service.planner.executor_status import executor_status

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

    async def Audit(
        self, request: admin_pb2.AuditRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.AuditReport:
        report = admin_pb2.AuditReport()
        for audit in await self.engine.audit():
            report.executors.add(
                address=audit.address,
                audited=audit.audited,
                skipped_reason=audit.skipped_reason,
                mismatches=audit.mismatches,
            )
            report.num_mismatches += len(audit.mismatches)
            if audit.mismatches:
                logger.error(
                    "event=audit_mismatch address=%s count=%d first=%r",
                    audit.address, len(audit.mismatches), audit.mismatches[0],
                )
        logger.info("event=audit_done executors=%d mismatches=%d", len(report.executors), report.num_mismatches)
        return report

    async def GetSchedulingConfig(
        self, request: admin_pb2.GetSchedulingConfigRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SchedulingConfig:
        return _to_proto(self.engine.knobs())

    async def UpdateSchedulingConfig(
        self, request: admin_pb2.UpdateSchedulingConfigRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SchedulingConfig:
        try:
            knobs = _updated(self.engine.knobs(), request)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        self.engine.reconfigure(knobs)
        logger.info("event=scheduling_update_requested peer=%s", context.peer())
        return _to_proto(knobs)


    async def ReloadTenants(
        self, request: admin_pb2.ReloadTenantsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.TenantsReport:
        try:
            self.engine.reload_tenants()
        except LookupError as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except ValueError as error:
            logger.warning("event=tenants_reload_refused reason=%r", str(error))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{error}; the tenants in force stay")
        logger.info("event=tenants_reload_requested peer=%s", context.peer())
        return tenants_report(self.engine)

    async def GetTenants(
        self, request: admin_pb2.GetTenantsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.TenantsReport:
        return tenants_report(self.engine)


def tenants_report(engine: Engine) -> admin_pb2.TenantsReport:
    """Configured tenants first, then the others seen, each with its limits and usage now."""
    quotas = engine.quotas
    table = quotas.table
    now = quotas.clock()
    names = [*sorted(table.tenants), *sorted(set(quotas.books) - set(table.tenants))]
    report = admin_pb2.TenantsReport(source=str(table.source) if table.source else "")
    for name in names:
        limits = table.limits(name)
        status = report.tenants.add(
            name=name,
            weight=limits.weight,
            max_running=limits.max_running or 0,
            tokens_per_minute=limits.tokens_per_minute or 0,
            served_tokens_per_weight=engine.share.counter(name),
            configured=name in table.tenants,
        )
        if limits.max_waiting is not None:
            status.max_waiting = limits.max_waiting
        books = quotas.books.get(name)
        if books is not None:
            books.expire(now)
            status.num_running, status.num_waiting = len(books.placed), len(books.held)
            status.tokens_last_minute = books.asked_tokens
    return report


def _to_proto(knobs: SchedulingKnobs) -> admin_pb2.SchedulingConfig:
    return admin_pb2.SchedulingConfig(
        policy=knobs.policy.value,
        mode=knobs.mode.value,
        max_num_batched_tokens=knobs.max_num_batched_tokens,
        max_num_seqs=knobs.max_num_seqs,
    )


def _updated(knobs: SchedulingKnobs, request: admin_pb2.UpdateSchedulingConfigRequest) -> SchedulingKnobs:
    """The knobs with the request's fields applied; ValueError saying what is wrong."""
    changes: dict[str, object] = {}
    if request.HasField("policy"):
        changes["policy"] = _choice(Policy, "policy", request.policy)
    if request.HasField("mode"):
        changes["mode"] = _choice(StepMode, "mode", request.mode)
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        if request.HasField(name):
            changes[name] = getattr(request, name)
    return replace(knobs, **changes)


def _choice(kind: type[Policy] | type[StepMode], name: str, value: str) -> Policy | StepMode:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(member.value for member in kind)
        raise ValueError(f"{name} {value!r} is not one of {allowed}") from None
