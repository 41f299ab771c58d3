"""K/V that moves between executors, planned by the engine that holds them all.

A move takes a running request from one executor (the source) to another (the destination) with
its computed K/V instead of recomputing it there. Its steps, each in the plans of one side:

1. The source's planner stops planning the request (Scheduler.begin_move) and, once the tokens
   of its steps in flight are in, takes it off its books (depart): its blocks stay held under
   the move's transfer id and the next plan offers them (StepPlan.kv_exports).
2. When the result of that plan is in (the offer is served), a destination is chosen and its
   planner allocates blocks for the request's computed tokens (import_request; blocks its
   prefix cache holds are not fetched); its next plan tells its executor to fetch the rest from
   the source (kv_imports), which it does while it goes on stepping.
3. The destination's executor says when the blocks are written (kv_imports_done): the request
   is queued there and computes on from its K/V; the source's offer ends (end_export). The
   books move the request only then. A failed fetch (either side died, or refused) queues it
   there to be recomputed from its tokens; nothing a client sees changes but the wait.

Moves happen when an executor drains (every running request is moved to the others that can
take it, instead of waiting for it to finish) and, with prefill and decode executors
(ExecutorInfo.role), after each prompt's first token. A request that no executor can take stays
where it is; one whose source dies before its offer is served is recomputed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from scheduler_service.core.move_books import Departure
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.step_plan import StepUpdates
from scheduler_service.core.stop_checker import length_limit
from scheduler_service.planner.lane import ExecutorLane, LaneState
from scheduler_service.planner.metrics import SchedulerMetrics
from scheduler_service.planner.step_trace import StepTrace

logger = logging.getLogger(__name__)

PREFILL_ROLE = "prefill"
DECODE_ROLE = "decode"


@dataclass(slots=True)
class Move:
    departure: Departure
    source: ExecutorLane
    # The source's planner when the move began: a source that reconnects has another.
    source_scheduler: Scheduler
    started_at: float
    # Chosen once the offer is served; None while the request is in transit, held by no planner.
    destination: ExecutorLane | None = None

    @property
    def request(self) -> Request:
        return self.departure.request


def can_take_moves(lane: ExecutorLane, source: ExecutorLane) -> bool:
    """Whether the lane's executor can take a request with its K/V from the source's."""
    info, theirs = lane.info, source.info
    return (
        lane is not source
        and lane.serving
        and lane.scheduler is not None
        and info is not None
        and theirs is not None
        and info.supports_kv_transfer
        and theirs.supports_kv_transfer
        and info.kv_layout == theirs.kv_layout
        and info.role != PREFILL_ROLE
    )


class KvMoves:
    def __init__(
        self,
        lanes: Callable[[], Iterable[ExecutorLane]],
        place: Callable[[list[Request]], None],
        metrics: SchedulerMetrics,
        trace: StepTrace | None = None,
    ) -> None:
        self._lanes = lanes
        self._place = place
        self._metrics = metrics
        self._trace = trace
        self._moves: dict[str, Move] = {}
        # Requests moved since start.
        self.num_moved = 0

    @property
    def in_transit(self) -> list[Request]:
        """Requests between two planners: offered by their source, not yet taken by any."""
        return [move.request for move in self._moves.values() if move.destination is None]

    def destinations(self, source: ExecutorLane) -> list[ExecutorLane]:
        return [lane for lane in self._lanes() if can_take_moves(lane, source)]

    def evacuate(self, lane: ExecutorLane) -> int:
        """Starts moving every running request off a draining executor, when another can take
        them; returns how many."""
        scheduler = lane.scheduler
        if scheduler is None or not self.destinations(lane):
            return 0
        running = [request for request in scheduler.running if not request.moving]
        for request in running:
            scheduler.begin_move(request)
        self._depart_ready(lane)
        if running:
            logger.info("event=requests_moving source=%s count=%d", lane.address, len(running))
        return len(running)

    def rebalance(self, thief: ExecutorLane, min_tokens_left: int) -> int:
        """An idle executor takes running requests from the busiest executor it can take moves
        from that runs at least two: half of them, those with the most tokens left to generate
        among those with at least min_tokens_left left. After it the two run about as many
        each, so neither is idle and nothing moves back. 0 turns it off; returns how many move."""
        # One rebalance at a time: until its moves land, the idle executor still looks idle.
        if not min_tokens_left or thief.info is None or thief.info.role == PREFILL_ROLE or self._moves:
            return 0
        donors = [
            lane
            for lane in self._lanes()
            if lane.serving
            and lane.scheduler is not None
            and lane.info is not None
            and lane.info.role != PREFILL_ROLE
            and can_take_moves(thief, lane)
            and not any(request.moving for request in lane.scheduler.running)
        ]
        if not donors:
            return 0
        donor = max(donors, key=lambda lane: len(lane.scheduler.running))  # type: ignore[union-attr]
        scheduler = donor.scheduler
        assert scheduler is not None
        limit = scheduler.config.max_seq_len
        left = {request: length_limit(request, limit) - request.num_tokens for request in scheduler.running}
        candidates = sorted((r for r in scheduler.running if left[r] >= min_tokens_left), key=left.__getitem__, reverse=True)
        chosen = candidates[: len(scheduler.running) // 2]
        for request in chosen:
            scheduler.begin_move(request)
        if chosen:
            logger.info("event=requests_rebalancing source=%s idle=%s count=%d", donor.address, thief.address, len(chosen))
            self._depart_ready(donor)
        return len(chosen)

    def after_step(self, lane: ExecutorLane, updates: StepUpdates) -> None:
        """After a lane's result: imports that ended there, offers now served there, and
        requests ready to leave it."""
        for done, request in updates.imports_done:
            self._import_ended(lane, done.transfer_id, done.ok, done.error, done.num_bytes, done.seconds, request)
        for transfer_id in updates.offers_ready:
            self._offer_served(transfer_id)
        self._depart_ready(lane)

    def lane_lost(self, lane: ExecutorLane, scheduler: Scheduler | None) -> None:
        """A request in transit from a lost source is recomputed, and so is one being fetched
        from it (the destination stops fetching at once rather than at the fetch's deadline);
        one fetched by a lost destination was requeued with the rest of its requests, and its
        source's offer ends."""
        for transfer_id, move in list(self._moves.items()):
            if move.source_scheduler is scheduler and move.destination is None:
                del self._moves[transfer_id]
                move.request.lose_kv("executor_lost")
                logger.warning(
                    "event=kv_move_failed request_id=%s source=%s reason='the source was lost'",
                    move.request.request_id, lane.address,
                )
                self._metrics.kv_moves.labels("failed").inc()
                self._place([move.request])
            elif move.source_scheduler is scheduler and move.destination is not None:
                del self._moves[transfer_id]
                destination = move.destination
                if destination.scheduler is not None and destination.scheduler.abandon_import(transfer_id) is not None:
                    destination.wake.set()
                logger.warning(
                    "event=kv_move_failed request_id=%s source=%s destination=%s reason='the source was lost mid-fetch'",
                    move.request.request_id, lane.address, destination.address,
                )
                self._metrics.kv_moves.labels("failed").inc()
            elif move.destination is lane:
                del self._moves[transfer_id]
                self._end_export(move)
                self._metrics.kv_moves.labels("failed").inc()

    def request_ended(self, request: Request) -> bool:
        """The request was aborted or stopped: a move of it is given up, its offered blocks
        freed. Returns whether it was in transit (held by no planner)."""
        for transfer_id, move in list(self._moves.items()):
            if move.request is request:
                del self._moves[transfer_id]
                self._end_export(move)
                return move.destination is None
        return False

    def _depart_ready(self, lane: ExecutorLane) -> None:
        scheduler = lane.scheduler
        if scheduler is None:
            return
        ready = scheduler.ready_to_move()
        if not ready:
            return
        destinations = self.destinations(lane)
        now = time.monotonic()
        for request in ready:
            if not any(other.scheduler is not None and other.scheduler.may_import(request) for other in destinations):
                # Nowhere to go with its K/V: it goes on here rather than be recomputed elsewhere.
                scheduler.stay(request)
                continue
            departure = scheduler.depart(request)
            self._moves[departure.transfer_id] = Move(departure, lane, scheduler, now)
            if self._trace is not None:
                self._trace.request_ended(lane.address, request, "move")
        lane.wake.set()

    def _offer_served(self, transfer_id: str) -> None:
        move = self._moves.get(transfer_id)
        if move is None:
            return
        request = move.request
        for lane in sorted(self.destinations(move.source), key=_least_loaded):
            assert lane.scheduler is not None
            fetching = lane.scheduler.import_request(request, move.departure, move.source.address)
            if fetching is None:
                continue
            move.destination = lane
            lane.wake.set()
            if self._trace is not None:
                self._trace.request_added(lane.address, request, lane.scheduler)
            if not fetching:
                # Everything it needs is cached there already.
                del self._moves[transfer_id]
                self._end_export(move)
                self._moved(move, 0, 0, 0.0)
            return
        del self._moves[transfer_id]
        self._end_export(move)
        request.lose_kv("transfer_failed")
        logger.warning(
            "event=kv_move_failed request_id=%s source=%s reason='no executor had room for it'",
            request.request_id, move.source.address,
        )
        self._metrics.kv_moves.labels("failed").inc()
        self._place([request])

    def _import_ended(
        self, lane: ExecutorLane, transfer_id: str, ok: bool, error: str, num_bytes: int, seconds: float, request: Request | None
    ) -> None:
        move = self._moves.pop(transfer_id, None)
        if move is None:
            return
        self._end_export(move)
        if ok and request is not None:
            self._moved(move, len(move.departure.block_ids), num_bytes, seconds)
        elif request is not None:
            self._metrics.kv_moves.labels("failed").inc()
            logger.warning(
                "event=kv_move_failed request_id=%s source=%s destination=%s reason=%r",
                request.request_id, move.source.address, lane.address, error,
            )

    def _moved(self, move: Move, num_blocks: int, num_bytes: int, seconds: float) -> None:
        self.num_moved += 1
        metrics = self._metrics
        metrics.kv_moves.labels("ok").inc()
        metrics.kv_blocks_migrated.inc(num_blocks)
        metrics.kv_transfer_bytes.inc(num_bytes)
        metrics.kv_transfer_seconds.observe(seconds)
        assert move.destination is not None
        logger.info(
            "event=kv_moved request_id=%s source=%s destination=%s blocks=%d bytes=%d transfer_s=%.4f move_s=%.4f",
            move.request.request_id, move.source.address, move.destination.address, num_blocks, num_bytes,
            seconds, time.monotonic() - move.started_at,
        )

    def _end_export(self, move: Move) -> None:
        """The source lets the offered blocks go, if it is still the planner that offered them."""
        source = move.source
        if source.scheduler is move.source_scheduler and source.state in (LaneState.UP, LaneState.DRAINING):
            source.scheduler.end_export(move.departure.transfer_id)
            source.wake.set()


def _least_loaded(lane: ExecutorLane) -> tuple[int, int]:
    scheduler = lane.scheduler
    assert scheduler is not None
    return scheduler.load, -scheduler.kv.num_free_blocks
