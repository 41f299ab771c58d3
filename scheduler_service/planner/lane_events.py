"""The engine's side of its lanes' lives (lane.LaneHooks): an executor refused, up, lost (its
requests placed on the others, or failed after MAX_EXECUTOR_LOSSES), idle (it takes queued
requests from the busiest lane, else running ones with their K/V), draining and drained.

A mixin of Engine (planner/engine.py), kept apart so that what the engine does as executors come
and go reads in one file; it works on the engine's own books.
"""

import asyncio
import logging
from collections.abc import Callable, Iterable

from protos.splitserve.executor.v1 import executor_pb2
from scheduler_service.core.errors import ErrorKind, RequestError
from scheduler_service.core.request import Request
from scheduler_service.core.step_plan import StepPlan
from scheduler_service.planner.engine_options import EngineOptions
from scheduler_service.planner.kv_moves import DECODE_ROLE, KvMoves
from scheduler_service.planner.lane import ExecutorLane, LaneState
from scheduler_service.planner.metrics import SchedulerMetrics
from scheduler_service.planner.step_trace import StepTrace

# The engine's logger, whichever of its files logs: every line reads logger= as before.
logger = logging.getLogger("scheduler_service.planner.engine")

# A request whose executor is lost this many times while it runs is failed rather than retried:
# it may be what brings executors down.
MAX_EXECUTOR_LOSSES = 3


class LaneEvents:
    """What it uses of the Engine it is mixed into."""

    options: EngineOptions
    metrics: SchedulerMetrics
    step_trace: StepTrace | None
    lanes: dict[str, ExecutorLane]
    info: executor_pb2.ExecutorInfo | None
    unplaced: list[Request]
    moves: KvMoves
    _unplaced_since: dict[str, float]
    _first_up: asyncio.Event
    _counts_seen: dict[str, tuple[int, int]]
    _recomputed_seen: dict[str, dict[str, int]]
    drain: Callable[[str], ExecutorLane]
    _serving_lanes: Callable[[], list[ExecutorLane]]
    _trace_left: Callable[[ExecutorLane, Iterable[Request]], None]
    _count: Callable[[ExecutorLane], None]
    _report_serving: Callable[[], None]
    _forget_lane: Callable[[ExecutorLane], None]
    # intake.py
    _place: Callable[[Iterable[Request]], None]
    # delivery.py
    _close: Callable[..., None]
    _fail: Callable[[Request, RequestError], None]

    def refusal(self, lane: ExecutorLane, info: executor_pb2.ExecutorInfo) -> str | None:
        """Why this executor may not serve beside the others, or None."""
        model = self.info
        if model is not None:
            ours = (model.vocab_size, sorted(model.eos_token_ids), model.max_model_len)
            theirs = (info.vocab_size, sorted(info.eos_token_ids), info.max_model_len)
            if ours != theirs:
                return (
                    f"it serves another model: vocab_size, eos_token_ids, max_model_len are "
                    f"{theirs}, the other executors' are {ours}"
                )
        for other in self.lanes.values():
            if (
                other is not lane
                and other.info is not None
                and other.state in (LaneState.UP, LaneState.DRAINING)
                and other.info.incarnation_id == info.incarnation_id
            ):
                return f"it is the executor already served at {other.address}"
        return None

    def lane_up(self, lane: ExecutorLane) -> None:
        if self.step_trace is not None and lane.scheduler is not None:
            self.step_trace.executor_up(
                lane.address, lane.scheduler.config, lane.options.pipeline_depth, lane.options.target_itl_s
            )
        if self.info is None:
            self.info = lane.info
        self._counts_seen[lane.address] = (0, 0)
        self._recomputed_seen[lane.address] = {}
        self._first_up.set()
        placing, self.unplaced = self.unplaced, []
        self._unplaced_since.clear()
        self._place(placing)
        self._report_serving()

    def lane_lost(self, lane: ExecutorLane, reason: str) -> None:
        scheduler = lane.scheduler
        evicted = scheduler.evict_all() if scheduler is not None else []
        if self.step_trace is not None:
            self.step_trace.executor_lost(lane.address)
        self._count(lane)
        self.moves.lane_lost(lane, scheduler)
        self._report_serving()
        keep = []
        for request in evicted:
            if request.num_executor_losses >= MAX_EXECUTOR_LOSSES:
                message = (
                    f"the executor was lost {request.num_executor_losses} times while running "
                    f"request {request.request_id}; giving up on it"
                )
                self._fail(request, RequestError(ErrorKind.UNAVAILABLE, message))
            else:
                keep.append(request)
        logger.warning(
            "event=executor_lost address=%s reason=%r requeued=%d", lane.address, reason, len(keep)
        )
        self._place(keep)

    def lane_idle(self, lane: ExecutorLane) -> None:
        """Gives an executor with nothing to do queued requests of others, else running ones
        (kv_moves.rebalance, --rebalance-min-tokens-left)."""
        if not self._steal_queued(lane):
            self.moves.rebalance(lane, self.options.rebalance_min_tokens_left)

    def _steal_queued(self, lane: ExecutorLane) -> bool:
        """Takes queued requests from the busiest other lane for an executor with none: a
        request moves when what the donor has cached for it, beyond what this lane has, is
        worth less than the requests queued ahead of it there (the router's exchange rate)."""
        thief = lane.scheduler
        if lane.info is not None and lane.info.role == DECODE_ROLE:
            # A decode executor computes prompts only when they are short (_intake_lanes).
            return False
        donors = [
            other
            for other in self._serving_lanes()
            if other is not lane and other.scheduler is not None and other.scheduler.num_waiting
        ]
        if not donors or thief is None:
            return False
        donor_lane = max(donors, key=lambda other: other.scheduler.num_waiting)
        donor = donor_lane.scheduler
        rate = self.options.route_tokens_per_request
        queued = donor.queued
        worth_moving = [
            request
            for ahead, request in enumerate(queued)
            # One that arrived with its K/V runs where it is.
            if not request.num_computed_tokens
            and donor.affinity(request) - thief.affinity(request) < rate * ahead
        ][-(-len(queued) // 2) :]
        if not worth_moving:
            return False
        taken = donor.release_waiting(worth_moving)
        self._trace_left(donor_lane, taken)
        moved = [request for request in taken if thief.adopt(request)]
        if self.step_trace is not None:
            for request in moved:
                self.step_trace.request_added(lane.address, request, thief)
        for request in taken:
            if request.is_finished:
                self._close(request)
        logger.info(
            "event=requests_moved to=%s count=%d", lane.address, len(moved)
        )
        return True

    def lane_state_changed(self, lane: ExecutorLane) -> None:
        self.metrics.executor_changed(lane.address, lane.state.value)

    def executor_draining(self, lane: ExecutorLane) -> None:
        logger.info("event=executor_shutting_down address=%s placed=%d", lane.address, lane.scheduler.load if lane.scheduler else 0)
        self.drain(lane.address)

    def lane_drained(self, lane: ExecutorLane) -> None:
        self._count(lane)
        self._report_serving()
        if lane.retired:
            self._forget_lane(lane)

    def plan_sent(self, lane: ExecutorLane, plan: StepPlan, planned_at: float) -> None:
        if self.step_trace is not None and lane.scheduler is not None:
            self.step_trace.plan_sent(lane.address, plan, lane.scheduler.decoded_in(plan), planned_at)

    def _sweep_draining(self, lane: ExecutorLane) -> None:
        """A draining executor's requests that went back to waiting since (preempted) go to the
        others; running ones that stayed for want of room move when room comes."""
        scheduler = lane.scheduler
        if scheduler is None or not self._serving_lanes():
            return
        if scheduler.num_waiting:
            queued = scheduler.release_waiting(scheduler.queued)
            self._trace_left(lane, queued)
            self._place(queued)
        if any(not request.moving for request in scheduler.running):
            self.moves.evacuate(lane)
