"""The engine's intake: a new request checked and admitted (its tenant's quotas, its deadline),
given its output stream and placed on a lane by the router; and every request that has no lane
(queued before an executor was up, sent back by a lost or draining one, seated for its tenant)
placed again.

A mixin of Engine (planner/engine.py), kept apart so that where a request goes reads in one
file; it works on the engine's own books.
"""

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from protos.splitserve.executor.v1 import executor_pb2
from scheduler_service.core.deadline_admission import Candidate, DeadlineAdmission
from scheduler_service.core.errors import (
    AdmissionRefused,
    ErrorKind,
    RequestError,
    RequestRejected,
)
from scheduler_service.core.length_limits import (
    check_room_in_cache,
    check_room_under_model_length,
)
from scheduler_service.core.request import Request
from scheduler_service.core.router import route
from scheduler_service.core.tenant_quotas import TenantQuotas
from scheduler_service.core.tenants import TenantTable, load_tenants_file
from scheduler_service.frontend.draining import refuse_when_draining
from scheduler_service.frontend.output_stream import OutputStream
from scheduler_service.frontend.tracing import Tracing
from scheduler_service.planner.engine_options import EngineOptions
from scheduler_service.planner.kv_moves import PREFILL_ROLE
from scheduler_service.planner.lane import ExecutorLane
from scheduler_service.planner.metrics import SchedulerMetrics
from scheduler_service.planner.request_sink import RequestSink
from scheduler_service.planner.step_trace import StepTrace
from scheduler_service.structured.grammars import Grammars
from scheduler_service.text.tokenizer import TextProcessor

# The engine's logger, whichever of its files logs: every line reads logger= as before.
logger = logging.getLogger("scheduler_service.planner.engine")


class EngineUnavailable(RequestRejected):
    """No executor has been reached yet."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorKind.UNAVAILABLE, message)


class Intake:
    """What it uses of the Engine it is mixed into."""

    text: TextProcessor | None
    grammars: Grammars
    options: EngineOptions
    metrics: SchedulerMetrics
    tracing: Tracing
    step_trace: StepTrace | None
    info: executor_pb2.ExecutorInfo | None
    unplaced: list[Request]
    _arrivals: Iterator[int]
    draining: bool
    queue_before_first_executor: bool
    quotas: TenantQuotas
    deadlines: DeadlineAdmission
    # Requests waiting anywhere (a property of the Engine).
    num_waiting: int
    why_no_executor: Callable[[], str]
    _find: Callable[[str], Request | None]
    _serving_lanes: Callable[[], list[ExecutorLane]]
    # delivery.py
    _abort: Callable[..., bool]
    _close: Callable[..., None]
    _fail: Callable[[Request, RequestError], None]

    def submit(
        self,
        request: Request,
        trace_carrier: Mapping[str, str] | None = None,
        open_sink: Callable[[Request], RequestSink] | None = None,
        resumed: bool = False,
    ) -> RequestSink:
        """Queues a request; its tokens go to the sink open_sink makes for it (by default its
        client's stream in this process). RequestRejected says why it cannot run. resumed: a
        request its client already streams, submitted again after its planner was lost: its
        tenant's quotas and its deadline were judged when it arrived, and are not again."""
        info = self.info
        refuse_when_draining(self.draining)
        if info is None and not self.queue_before_first_executor:
            raise EngineUnavailable(f"no executor has been reached yet: {self.why_no_executor()}")
        if self._find(request.request_id) is not None:
            raise RequestRejected(
                ErrorKind.DUPLICATE, f"request id {request.request_id!r} is already in flight"
            )
        if info is not None:
            check_room_under_model_length(request.num_prompt_tokens, info.max_model_len)
        waiting = self.num_waiting
        if waiting >= self.options.max_waiting:
            raise RequestRejected(
                ErrorKind.OVERLOADED, f"{waiting} requests are already waiting; retry later"
            )
        serving = self._serving_lanes()
        if serving:
            largest = max(lane.scheduler.config.max_seq_len for lane in serving)
            check_room_in_cache(
                request.num_prompt_tokens, largest, f"the largest KV cache of any executor ({largest} tokens)"
            )
        if info is not None:
            self._constrain(request, info)
        request.arrival_time = request.arrival_time or time.monotonic()
        request.arrival_index = next(self._arrivals)
        # Lanes whose KV cache could hold it (check_room_in_cache saw that one does).
        intake = [
            lane for lane in (self._intake_lanes(request, serving) if serving else [])
            if request.num_tokens < lane.scheduler.config.max_seq_len
        ]
        try:
            index = self._admit(request, intake, resumed)
        except AdmissionRefused as refused:
            self.metrics.request_refused(request.tenant, refused.reason)
            logger.info(
                "event=request_refused request_id=%s tenant=%s reason=%s retry_after_s=%.1f",
                request.request_id, request.tenant, refused.reason, refused.retry_after_s or 0.0,
            )
            raise
        stream: RequestSink = (
            open_sink(request)
            if open_sink is not None
            else OutputStream(
                request, self.text, self.options.stream_interval, self.options.stream_backlog,
                lambda error: self._abort(request, error),
            )
        )
        request.output = stream
        if self.tracing.enabled:
            self.tracing.request_started(stream, trace_carrier or {})
        if index is not None and intake:
            lane = intake[index]
            try:
                lane.scheduler.add_request(request)
            except RequestRejected:
                self.quotas.ended(request)
                raise
            if self.step_trace is not None:
                self.step_trace.request_added(lane.address, request, lane.scheduler)
            lane.wake.set()
        elif index is not None:
            # Executors were reached before, so one is expected back.
            self.unplaced.append(request)
        # Else its tenant's max_running is reached: it waits in the tenant's queue (quotas)
        # until one of the tenant's requests ends.
        return stream

    def _admit(self, request: Request, intake: list[ExecutorLane], resumed: bool) -> int | None:
        """Where a new request goes: the index in intake of its lane (the router's, unless its
        deadline is better met on another, deadline_admission), or None while it waits for a
        seat under its tenant's max_running. AdmissionRefused past its tenant's quotas or its
        deadline; nothing is booked then."""
        routed = (self._route(request, intake) or 0) if intake else 0
        if intake and not resumed and self.deadlines.judges(request):
            candidates = [Candidate.of_lane(lane.scheduler, lane.step_timer, lane.options.target_itl_s) for lane in intake]
            routed = self.deadlines.choose(request, candidates, routed, time.monotonic())
        if self.quotas.admit(request, self.info.max_model_len if self.info is not None else None, not resumed):
            return routed
        wait = self.quotas.seat_wait_s(request.tenant)
        time_left = request.ttft_deadline - time.monotonic()
        if request.ttft_deadline_s and not resumed and wait > self.deadlines.margin * time_left:
            self.quotas.ended(request)
            raise AdmissionRefused(
                "deadline",
                ErrorKind.OVERLOADED,
                f"tenant {request.tenant!r} has its max_running requests running; a seat is predicted "
                f"in {wait * 1000:.0f} ms, past the deadline of {request.ttft_deadline_s * 1000:.0f} ms "
                "(ttft_deadline_ms); retry later",
                wait,
            )
        return None

    def open_stream(self, request: Request, trace_carrier: Mapping[str, str] | None = None) -> OutputStream:
        """submit() with the request's client in this process (the client API's Generate)."""
        stream = self.submit(request, trace_carrier)
        assert isinstance(stream, OutputStream)
        return stream

    @property
    def wants_trace_context(self) -> bool:
        return self.tracing.enabled

    def reload_tenants(self) -> TenantTable:
        """Reads --tenants-file again; ValueError (TenantsFileError) when the file is wrong,
        LookupError when there is none. The new table applies to requests from now on."""
        source = self.quotas.table.source
        if source is None:
            raise LookupError("this scheduler has no --tenants-file to reload")
        table = load_tenants_file(source)
        self.quotas.table = table
        logger.info("event=tenants_reloaded source=%s tenants=%d", source, len(table.tenants))
        # A raised max_running seats held requests now, not when the tenant's next one ends.
        for tenant in list(self.quotas.books):
            self._place(self.quotas.seat_held(tenant))
        return table

    def _place(self, requests: Iterable[Request]) -> None:
        """Puts requests that have no lane on the lanes taking work, or keeps them unplaced."""
        serving = self._serving_lanes()
        for request in requests:
            if request.is_finished:
                continue
            if not serving:
                self.unplaced.append(request)
                continue
            # Queued before any executor told the vocabulary: its grammar state is made now.
            if request.grammar is None and request.sampling.structured_output is not None:
                assert self.info is not None  # a lane is serving
                try:
                    self._constrain(request, self.info)
                except RequestRejected as rejected:
                    self._fail(request, RequestError(rejected.kind, str(rejected)))
                    continue
            intake = self._intake_lanes(request, serving)
            lane = intake[self._route(request, intake) or 0]
            if not lane.scheduler.adopt(request):
                self._close(request)
            elif self.step_trace is not None:
                self.step_trace.request_added(lane.address, request, lane.scheduler)
            lane.wake.set()
        self.unplaced.sort(key=lambda r: r.arrival_index)

    def _intake_lanes(self, request: Request, serving: list[ExecutorLane]) -> list[ExecutorLane]:
        """Where a request with its prompt to compute may go. Beside prefill executors that hand
        their requests on (a decode executor is up), a prompt with at least prefill_min_tokens
        uncached tokens goes to a prefill executor, any other to the rest; else anywhere."""
        prefill = [lane for lane in serving if lane.scheduler.hand_off_after_prefill]
        if not prefill:
            return serving
        others = [lane for lane in serving if lane.info is not None and lane.info.role != PREFILL_ROLE]
        if not others:
            return prefill
        cached = max(lane.scheduler.affinity(request) for lane in others)
        return prefill if request.num_tokens - cached >= self.options.prefill_min_tokens else others

    def _constrain(self, request: Request, info: executor_pb2.ExecutorInfo) -> None:
        """Gives a constrained request its place in its grammar, after the output it has."""
        spec = request.sampling.structured_output
        if spec is None:
            return
        stop_ids = set(info.eos_token_ids) | set(self.text.eos_token_ids if self.text else ())
        request.grammar = self.grammars.state(spec, info.vocab_size, stop_ids, request.output_token_ids)

    def _route(self, request: Request, lanes: Sequence[ExecutorLane]) -> int | None:
        choice = route(
            request, [lane.scheduler for lane in lanes], self.options.route_tokens_per_request
        )
        return choice.index if choice is not None else None
