"""The scheduler's side of K/V that leaves or reaches its executor without being recomputed:
requests moving to and from other executors (planner/kv_moves.py plans the moves between them),
and preempted requests swapped to the executor's host tier and back.

A mixin of Scheduler (core/scheduler.py), kept apart so the planner's main loop stays readable;
it works on the scheduler's own books (block pool, queues, decode set) and changes only what a
move or a swap changes.
"""

from collections.abc import Callable

import numpy as np

from kv_manager import KVCacheManager, PrefixHit
from scheduler_service.core.checkpoint_policy import CheckpointPolicy
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.decode_set import BulkStep, DecodeSet
from scheduler_service.core.move_books import (
    Departure,
    MoveBooks,
    export_owner,
    new_transfer_id,
)
from scheduler_service.core.prefix_tracker import PrefixTracker
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.request_queue import WaitingQueue
from scheduler_service.core.step_plan import KvExport, KvImport, StepPlan
from scheduler_service.core.step_results import InFlight


class RequestMoves:
    """What it uses of the Scheduler it is mixed into."""

    config: SchedulerConfig
    kv: KVCacheManager
    waiting: WaitingQueue
    running: list[Request]
    decodes: DecodeSet
    num_preemptions: int
    num_swapped_out: int
    _moves: MoveBooks
    _checkpoints: CheckpointPolicy
    _prefixes: PrefixTracker
    _retrying: dict[Request, None]
    _planning_bulk: BulkStep | None
    _in_flight_bulk: dict[int, BulkStep]
    _kept_bulk: dict[int, list[tuple[int, Request, int]]]
    _place: Callable[[Request], None]
    _unplace: Callable[[Request], None]
    _forget_on_executor: Callable[[str], None]
    prefix_hashes: Callable[[Request], list[bytes]]
    # Waiting requests in admission order (a property of the Scheduler).
    queued: list[Request]
    _in_flight: dict[int, dict[str, InFlight]]

    def begin_move(self, request: Request) -> None:
        """Plans no more work for a running request, which is to leave with its K/V once the
        tokens of its steps in flight are in (ready_to_move)."""
        # A request retried alone after a failed step finishes where it is: its isolation is
        # this executor's.
        if request.status is not RequestStatus.RUNNING or request.moving or request.retry_alone:
            return
        request.moving = True
        self._moves.moving[request] = None
        if request in self.decodes:
            self.decodes.pause(request)

    def ready_to_move(self) -> list[Request]:
        """Moving requests with no step in flight: their tokens and K/V are final here (a prompt
        chunk in flight samples nothing, yet its step may still fail)."""
        if not self._moves.moving:
            # The common case, after every step: nothing to look up.
            return []
        in_flight = {request_id for entries in self._in_flight.values() for request_id in entries}
        return [
            request
            for request in self._moves.moving
            if request.num_pending_outputs == 0 and request.request_id not in in_flight
        ]

    def stay(self, request: Request) -> None:
        """A moving request goes on here after all (nowhere could take it)."""
        self._stop_moving(request)
        if request in self.decodes:
            self.decodes.pause(request, paused=False)

    def depart(self, request: Request) -> Departure:
        """Takes a request that is ready to move off these books. Its blocks holding computed
        tokens stay held under the move's name and are offered to other executors in the next
        plan (offers_ready says when that plan has run); end_export lets them go."""
        self._stop_moving(request)
        if request in self.decodes:
            self.decodes.leave(request)
        self.running.remove(request)
        self._forget_on_executor(request.request_id)
        self._retrying.pop(request, None)
        computed = request.num_computed_tokens
        transfer_id = new_transfer_id()
        block_ids = self.kv.block_ids(request.request_id)[: -(-computed // self.config.block_size)]
        owner = export_owner(transfer_id)
        self.kv.rename(request.request_id, owner)
        self._unplace(request)
        request.status = RequestStatus.WAITING
        self._moves.exports.add(transfer_id)
        self._moves.offers.append(KvExport(transfer_id, block_ids, self.kv.state_slots.slot_of(owner)))
        return Departure(request, transfer_id, block_ids, computed)

    def end_export(self, transfer_id: str) -> None:
        """The move is over (or given up): the offered blocks are freed. Idempotent."""
        moves = self._moves
        if transfer_id not in moves.exports:
            return
        moves.exports.discard(transfer_id)
        self.kv.free(export_owner(transfer_id))
        unsent = [offer for offer in moves.offers if offer.transfer_id != transfer_id]
        if len(unsent) < len(moves.offers):
            moves.offers = unsent
        else:
            moves.offer_steps.pop(transfer_id, None)
            moves.ended.append(transfer_id)

    @property
    def num_exports(self) -> int:
        """Offers whose blocks are still held here."""
        return len(self._moves.exports)

    @property
    def num_importing(self) -> int:
        """Requests whose K/V is being fetched into this executor."""
        return len(self._moves.importing)

    def import_request(
        self, request: Request, departure: Departure, source_address: str
    ) -> bool | None:
        """Places a request that left another executor with its K/V: blocks for its computed
        tokens are allocated here (those this cache already holds are kept, not fetched) and the
        next plan fetches the rest from the source. Returns True while they are fetched (the
        request runs once import_done says they are written), False when nothing needs fetching
        (it is queued at once), None, changing nothing, when its blocks do not fit."""
        computed = departure.num_computed_tokens
        hybrid = self.config.num_state_slots > 0
        if request.num_tokens >= self.config.max_seq_len or (hybrid and not self._checkpoints.may_admit()):
            return None
        self._place(request)
        hashes = self.prefix_hashes(request)
        hit = self.kv.find_cached_prefix(request.token_ids, request.cache_salt, hashes)
        usable = min(len(hit.blocks), computed // self.config.block_size)
        if hybrid:
            # Its recurrent state comes from the source whatever is cached here: at least one
            # block travels with it.
            usable = min(usable, len(departure.block_ids) - 1)
        hit = PrefixHit(hit.blocks[:usable], usable * self.config.block_size)
        allocated = self.kv.allocate_slots(
            request.request_id, request.token_ids, hit.num_tokens, computed - hit.num_tokens, hit, request.cache_salt,
            count_lookup=False,
        )
        if allocated is None:
            self._unplace(request)
            return None
        state_slot = self._checkpoints.take_slot(request.request_id) if hybrid else 0
        request.num_computed_tokens = computed
        block_ids = self.kv.block_ids(request.request_id)
        if usable >= len(departure.block_ids):
            self.waiting.insert(request)
            return False
        self._moves.importing[departure.transfer_id] = request
        self._moves.imports.append(
            KvImport(departure.transfer_id, source_address, usable, block_ids[usable : len(departure.block_ids)], state_slot)
        )
        return True

    def may_import(self, request: Request) -> bool:
        """Whether import_request would find room for the request as things stand: blocks for
        its computed tokens and, for a hybrid model, a state slot."""
        needed = -(-request.num_computed_tokens // self.config.block_size)
        return (
            request.num_tokens < self.config.max_seq_len
            and self.kv.num_free_blocks >= needed
            and (not self.config.num_state_slots or self._checkpoints.may_admit())
        )

    def abandon_import(self, transfer_id: str) -> Request | None:
        """Gives up an import whose source is gone: the executor stops fetching, and the request
        is queued here to be recomputed. Returns it (None if no such import)."""
        request = self._moves.importing.get(transfer_id)
        if request is None:
            return None
        self._cancel_import(request)
        self.kv.free(request.request_id)
        request.lose_kv("transfer_failed")
        self.waiting.insert(request)
        return request

    def _import_done(self, transfer_id: str, ok: bool) -> Request | None:
        """An import ended: its request is queued, to compute on from its K/V, or (failed) to
        recompute it. Returns the request, or None when it was cancelled meanwhile."""
        request = self._moves.importing.pop(transfer_id, None)
        if request is None:
            return None
        if ok:
            self.kv.cache_computed(request.request_id, request.token_ids, request.num_computed_tokens)
        else:
            self.kv.free(request.request_id)
            request.lose_kv("transfer_failed")
        self.waiting.insert(request)
        return request

    def _cancel_import(self, request: Request) -> None:
        transfer_id = self._moves.import_of(request)
        if transfer_id is None:
            return
        del self._moves.importing[transfer_id]
        unsent = [entry for entry in self._moves.imports if entry.transfer_id != transfer_id]
        if len(unsent) == len(self._moves.imports):
            self._moves.cancelled.append(transfer_id)
        self._moves.imports = unsent

    def _stop_moving(self, request: Request) -> None:
        if request.moving:
            request.moving = False
            del self._moves.moving[request]

    def _moves_into(self, plan: StepPlan) -> None:
        """The plan carries the moves' changes since the last one."""
        moves = self._moves
        if moves.offers:
            plan.kv_exports, moves.offers = moves.offers, []
            for offer in plan.kv_exports:
                moves.offer_steps[offer.transfer_id] = plan.step_id
        if moves.ended:
            plan.ended_exports, moves.ended = moves.ended, []
        if moves.imports:
            plan.kv_imports, moves.imports = moves.imports, []
        if moves.cancelled:
            plan.cancelled_imports, moves.cancelled = moves.cancelled, []

    def _release_held(self) -> bool:
        """Waiting requests other than the head of the queue that hold blocks or a state slot
        (they arrived with their K/V, or were swapped back in) give them up: to the host tier
        when it has room, else to be recomputed. Returns whether any did."""
        head = self.waiting.peek()
        released = False
        for waiting in self.queued:
            held = self.kv.holds(waiting.request_id) or self.kv.state_slots.slot_of(waiting.request_id)
            if waiting is head or not held:
                continue
            if not self.kv.swap_out(waiting.request_id, waiting.num_computed_tokens):
                self.kv.free(waiting.request_id)
                waiting.lose_kv("released")
            released = True
        return released

    def _swap_out(self, request: Request) -> bool:
        """Swaps a running request's K/V out to the host tier (False, changing nothing, when
        there is none or no room). Steps in flight for it still deliver their tokens: its epoch
        stays, and a steady decode's are kept (_kept_bulk); its part in the plan being made is
        taken back (the executor drops it before that step runs)."""
        if self.kv.host is None:
            return False
        in_bulk = request in self.decodes
        slot, epoch = self.decodes.slot_of(request) if in_bulk else (-1, -1)
        now = self._planning_bulk
        planned_now = in_bulk and now is not None and bool(np.any((now.slots == slot) & (now.epochs == epoch)))
        computed = request.num_computed_tokens - planned_now
        if not self.kv.swap_out(request.request_id, computed):
            return False
        if in_bulk:
            for step_id, step in self._in_flight_bulk.items():
                for position in np.flatnonzero((step.slots == slot) & (step.epochs == epoch)).tolist():
                    self._kept_bulk.setdefault(step_id, []).append((position, request, request.num_preemptions))
            if planned_now:
                request.num_pending_outputs -= 1
            self.decodes.leave(request)
        self.running.remove(request)
        self._forget_on_executor(request.request_id)
        self._prefixes.computing.remove(request)
        self._stop_moving(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = computed
        self.num_preemptions += 1
        self.num_swapped_out += 1
        self.waiting.push_front(request)
        return True
