"""Audits asked of one executor's lane: the lane stops pipelining, sends one plan that asks the
executor for what it holds, and answers every audit waiting with the comparison
(core/audit.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ExecutorAudit:
    address: str
    # False when the executor could not be audited (not up, or lost before it answered).
    audited: bool
    # Why it was not audited; "" when it was.
    skipped_reason: str
    mismatches: tuple[str, ...]


class AuditAbandoned(Exception):
    """The executor went away (lost, drained) before the audit plan was answered."""


class PendingAudits:
    def __init__(self) -> None:
        self._waiting: list[asyncio.Future[list[str]]] = []
        self._step_id: int | None = None

    @property
    def wanted(self) -> bool:
        """An audit waits and its plan is not sent yet: the lane sends no other plan."""
        return bool(self._waiting) and self._step_id is None

    def ask(self) -> asyncio.Future[list[str]]:
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        return future

    def sent(self, step_id: int) -> None:
        self._step_id = step_id

    def answers(self, step_id: int) -> bool:
        return self._step_id == step_id

    def answer(self, mismatches: list[str]) -> None:
        for future in self._waiting:
            if not future.done():
                future.set_result(mismatches)
        self._waiting, self._step_id = [], None

    def abandon(self, reason: str) -> None:
        for future in self._waiting:
            if not future.done():
                future.set_exception(AuditAbandoned(reason))
        self._waiting, self._step_id = [], None
