"""Asserts through the Admin API that a running scheduler's block accounting agrees with every
executor it drives (Admin/Audit)."""

from __future__ import annotations

import grpc

from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc


def assert_books_agree(address: str, audited_at_least: int = 1) -> admin_pb2.AuditReport:
    with grpc.insecure_channel(address) as channel:
        report = admin_pb2_grpc.AdminStub(channel).Audit(admin_pb2.AuditRequest(), timeout=60)
    assert report.num_mismatches == 0, [list(e.mismatches) for e in report.executors]
    audited = [e for e in report.executors if e.audited]
    assert len(audited) >= audited_at_least, report
    return report


async def audit_now(address: str) -> admin_pb2.AuditReport:
    """Admin/Audit from async code (while the test's streams run)."""
    async with grpc.aio.insecure_channel(address) as channel:
        return await admin_pb2_grpc.AdminStub(channel).Audit(admin_pb2.AuditRequest(), timeout=60)
