"""One executor's side of the K/V moves the engine plans (planner/kv_moves.py): requests about
to leave with their K/V, blocks offered to other executors, and blocks being fetched into.

The scheduler owns these books next to its block pool; the plan it builds carries what changed
(offers made and ended, imports started and abandoned), and the results it takes say when an
offer is served and when an import is written.
"""

import secrets
from dataclasses import dataclass, field

from scheduler_service.core.request import Request
from scheduler_service.core.step_plan import KvExport, KvImport


def new_transfer_id() -> str:
    """128 random bits: the id is also what lets the destination read the source's blocks."""
    return secrets.token_hex(16)


def export_owner(transfer_id: str) -> str:
    """The name an offered request's blocks are held under in the block pool until the move
    ends (the request itself may meanwhile be placed elsewhere, even back here)."""
    return f"\x00export:{transfer_id}"


@dataclass(slots=True, frozen=True)
class Departure:
    """A request that left an executor's books with its K/V: its first num_computed_tokens
    tokens are in block_ids, offered there under transfer_id."""

    request: Request
    transfer_id: str
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class MoveBooks:
    # Running requests planned no more here, waiting for their tokens in flight to leave.
    moving: dict[Request, None] = field(default_factory=dict)
    # Offers open on the executor (or about to be): their blocks stay held.
    exports: set[str] = field(default_factory=set)
    # Offers for the next plan, and the step of the plan that made each offer (served from the
    # moment that plan's result is in).
    offers: list[KvExport] = field(default_factory=list)
    offer_steps: dict[str, int] = field(default_factory=dict)
    # Offers to end in the next plan.
    ended: list[str] = field(default_factory=list)
    # Requests whose blocks are being fetched, by transfer id, and the imports for the next plan.
    importing: dict[str, Request] = field(default_factory=dict)
    imports: list[KvImport] = field(default_factory=list)
    # Imports to abandon in the next plan.
    cancelled: list[str] = field(default_factory=list)

    def import_of(self, request: Request) -> str | None:
        return next((tid for tid, held in self.importing.items() if held is request), None)

    def served(self, step_id: int) -> list[str]:
        """Offers whose plan has run by the result of step_id."""
        ready = [tid for tid, step in self.offer_steps.items() if step <= step_id]
        for tid in ready:
            del self.offer_steps[tid]
        return ready
