"""The audit of one executor's block accounting, end to end: the scheduler's pool is
consistent in itself (kv_manager/audit.py), and the executor holds exactly the requests the
scheduler placed there, with the same block tables, computed tokens and recurrent-state slots
(a hybrid model's running requests each holding one, and none holding a slot the scheduler keeps
a checkpoint in).

Run only when no plan is on the wire (the lane waits for that), so both sides have seen the
same plans.
"""

from collections.abc import Mapping

from kv_manager.audit import pool_mismatches
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.step_plan import HeldState


def audit_executor(scheduler: Scheduler, held: Mapping[str, HeldState]) -> list[str]:
    """Mismatches, one line each; empty when the books agree."""
    found = pool_mismatches(scheduler.kv)
    slots = scheduler.kv.state_slots
    if slots.num_slots:
        for request in scheduler.running:
            if not slots.slot_of(request.request_id):
                found.append(f"request {request.request_id}: running without a state slot")
    placed = scheduler.on_executor
    for request_id in sorted(placed):
        state = held.get(request_id)
        if state is None:
            found.append(f"request {request_id}: placed on the executor, which does not hold it")
            continue
        blocks = scheduler.kv.block_ids(request_id)
        if list(state.block_ids) != blocks:
            found.append(
                f"request {request_id}: block table {list(state.block_ids)} on the executor, "
                f"{blocks} in the scheduler"
            )
        slot = slots.slot_of(request_id)
        if state.state_slot != slot:
            found.append(f"request {request_id}: state slot {state.state_slot} on the executor, {slot} in the scheduler")
        request = scheduler.requests.get(request_id)
        computed = request.num_computed_tokens if request is not None else None
        if state.num_computed_tokens != computed:
            found.append(
                f"request {request_id}: {state.num_computed_tokens} tokens computed on the "
                f"executor, {computed} in the scheduler"
            )
    # A request the scheduler is about to drop may be held or not: its blocks are free already.
    for request_id in sorted(held.keys() - placed - scheduler.pending_drops):
        found.append(f"request {request_id}: held by the executor, which the scheduler never placed there")
    lent = slots.lent_slots()
    for request_id, state in sorted(held.items()):
        if state.state_slot in lent:
            found.append(f"request {request_id}: holds state slot {state.state_slot}, which keeps a checkpoint")
    return found
