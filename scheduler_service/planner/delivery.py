"""What reaches a request's stream: each step's tokens (one by one, or the steady decodes' in
bulk), and its end: finished, stopped at a string, aborted or failed, with its tenant's books and
the requests held for the seat it leaves.

A mixin of Engine (planner/engine.py), kept apart so that the path a token takes from a step's
answer to its client, the engine's hottest, reads in one file; it works on the engine's own
books.
"""

import logging
import time
from collections.abc import Callable, Iterable

import numpy as np

from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.deadline_admission import DeadlineAdmission
from scheduler_service.core.errors import RequestError
from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.step_plan import RequestUpdate, StepOutput, StepUpdates
from scheduler_service.core.tenant_quotas import TenantQuotas
from scheduler_service.frontend.tracing import Tracing
from scheduler_service.planner.kv_moves import KvMoves
from scheduler_service.planner.lane import ExecutorLane, LaneState
from scheduler_service.planner.metrics import SchedulerMetrics
from scheduler_service.planner.request_sink import RequestSink
from scheduler_service.planner.step_trace import StepTrace

# The engine's logger, whichever of its files logs: every line reads logger= as before.
logger = logging.getLogger("scheduler_service.planner.engine")


class Delivery:
    """What it uses of the Engine it is mixed into."""

    metrics: SchedulerMetrics
    tracing: Tracing
    step_trace: StepTrace | None
    unplaced: list[Request]
    moves: KvMoves
    quotas: TenantQuotas
    share: FairShare
    deadlines: DeadlineAdmission
    bulk_delivery: Callable[[np.ndarray, list[int]], None] | None
    _find: Callable[[str], Request | None]
    _lane_of: Callable[[Request], ExecutorLane | None]
    _every_request: Callable[[], list[Request]]
    _trace_ended: Callable[[ExecutorLane, Request, str], None]
    _count: Callable[[ExecutorLane], None]
    _observe_lane: Callable[[ExecutorLane], None]
    # intake.py
    _place: Callable[[Iterable[Request]], None]
    # lane_events.py
    _sweep_draining: Callable[[ExecutorLane], None]

    def deliver(self, lane: ExecutorLane, output: StepOutput, updates: StepUpdates) -> None:
        if self.step_trace is not None and lane.scheduler is not None:
            self.step_trace.result_applied(lane.address, output, updates, lane.scheduler)
        received_ns = time.time_ns() if self.tracing.enabled else 0
        self.metrics.inter_token.observe_all(updates.inter_token_gaps)
        if updates.verified and lane.scheduler is not None:
            self.metrics.drafts_verified(lane.scheduler.speculation.method, updates.verified)
        for update in updates.updates:
            self._deliver(lane, update)
        self._deliver_decoded(lane, updates)
        self.moves.after_step(lane, updates)
        if lane.state is LaneState.DRAINING:
            self._sweep_draining(lane)
        if self.tracing.enabled:
            requests = [update.request for update in updates.updates] + updates.decoded_requests
            self.tracing.step_done(lane.address, output, requests, received_ns)
        self._count(lane)
        self._observe_lane(lane)

    def _deliver(self, lane: ExecutorLane, update: RequestUpdate) -> None:
        request = update.request
        if update.error is not None:
            logger.error(
                "event=request_failed_in_executor request_id=%s executor=%s kind=%s reason=%r",
                request.request_id, lane.address, update.error.kind.value, update.error.message,
            )
            self._fail(request, update.error)
            return
        stream = _stream_of(request)
        message, stop = stream.add_tokens(update.new_token_ids, update.new_logprobs)
        # Tokens after the one that completed a stop string are none of the output.
        num_after_stop = 0 if stop is None else len(update.new_token_ids) - stop.num_tokens
        self.metrics.generation_tokens.inc(len(update.new_token_ids) - num_after_stop)
        if stop is not None and lane.scheduler is not None:
            lane.scheduler.stop_at_string(request, stop.stop_string, num_after_stop)
            self._trace_ended(lane, request, "stop")
        if request.is_finished:
            self._close(request, message)
        else:
            stream.send(message)

    def _deliver_decoded(self, lane: ExecutorLane, updates: StepUpdates) -> None:
        """Steady decodes' tokens: one each, none finishing (the scheduler saw to that), so
        only a stop string can end one here. This loop runs once per token the scheduler
        delivers, unless they go on in bulk."""
        token_ids = updates.decoded_token_ids
        self.metrics.generation_tokens.inc(len(token_ids))
        if self.bulk_delivery is not None:
            if token_ids:
                self.bulk_delivery(updates.decoded_keys, token_ids)
            return
        for request, token in zip(updates.decoded_requests, token_ids, strict=True):
            stream = _stream_of(request)
            message, stop = stream.add_tokens([token], ())
            if stop is not None and lane.scheduler is not None:
                lane.scheduler.stop_at_string(request, stop.stop_string)
                self._trace_ended(lane, request, "stop")
                self._close(request, message)
            else:
                stream.send(message)

    def stop_at_string(self, stream: RequestSink, stop_string: str) -> None:
        """Ends the request of this sink, whose text reached a stop string where it was
        detokenized (a front-end): as when this process finds one while delivering."""
        request = stream.request
        if self._find(request.request_id) is not request:
            return
        lane = self._lane_of(request)
        in_transit = self.moves.request_ended(request)
        if lane is not None and lane.scheduler is not None:
            lane.scheduler.stop_at_string(request, stop_string)
            self._trace_ended(lane, request, "stop")
            lane.wake.set()
        else:
            if not in_transit and request in self.unplaced:
                self.unplaced.remove(request)
            request.finish_reason, request.stop_reason = FinishReason.STOP, stop_string
        self._close(request)

    async def abort_request(self, request_id: str) -> bool:
        return self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        """Ends the request with this client id, and its other choices (SamplingParams.n)."""
        family = [r for r in self._every_request() if r.request_id == request_id or r.fork_of == request_id]
        for request in family:
            self._abort(request)
        return bool(family)

    def cancel(self, stream: RequestSink) -> bool:
        """Aborts the request of this stream, if still running; unlike abort(id) it never
        touches a newer request that reuses the id after this one ended."""
        request = stream.request
        return self._find(request.request_id) is request and self._abort(request)

    def abort_all(self) -> None:
        for request in self._every_request():
            self._abort(request)

    def _abort(self, request: Request, error: RequestError | None = None) -> bool:
        """Ends a request now, freeing its blocks; its stream closes, or fails with error."""
        lane = self._lane_of(request)
        in_transit = self.moves.request_ended(request)
        if lane is not None and lane.scheduler is not None:
            lane.scheduler.finish(request, FinishReason.ABORT)
            self._trace_ended(lane, request, "abort")
            lane.wake.set()
        else:
            # Unplaced, held for its tenant's seat or in transit: no scheduler holds it, so
            # nothing else is to free (a held one leaves the tenant's queue as it closes).
            if not in_transit and request in self.unplaced:
                self.unplaced.remove(request)
            request.finish_reason = FinishReason.ABORT
        if error is None:
            self._close(request)
        else:
            self._fail(request, error)
        return True

    def _close(self, request: Request, message: pb.GenerateResponse | None = None) -> None:
        stream = _stream_of(request)
        if not stream.closed:
            stream.close(message)
            self._ended(request)
            self.tracing.request_finished(stream)

    def _fail(self, request: Request, error: RequestError) -> None:
        stream = _stream_of(request)
        if not stream.closed:
            stream.fail(error)
            self._ended(request)
            self.tracing.request_finished(stream)

    def _ended(self, request: Request) -> None:
        """A request's stream is over: its tenant's books, and the requests of that tenant held
        for the seat it leaves."""
        self.metrics.request_finished(request)
        self.share.leave(request)
        if request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.deadlines.finished(request)
        seated = self.quotas.ended(request)
        if seated:
            self._place(seated)


def _stream_of(request: Request) -> RequestSink:
    """The stream submit() attached to the request."""
    stream = request.output
    assert stream is not None, f"request {request.request_id} has no output stream"
    return stream
