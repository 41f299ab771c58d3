"""The engine: every executor's lane, where requests go, and what happens when an executor goes.

Each lane (planner/lane.py) plans and steps at its own executor's pace. The engine places each
new request on a lane with the router (core/router.py: prefix affinity weighed against load),
moves queued requests to a lane that has nothing to do, and when an executor is lost (or
drained) moves its requests to the lanes still up, to be recomputed there from the tokens they
have; with no lane up they wait, unplaced, for one to come (back). Clients see none of it: a
request's stream goes on where it stopped.
"""

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from protos.splitserve.executor.v1 import executor_pb2
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.config import SchedulingKnobs
from scheduler_service.core.deadline_admission import Candidate, DeadlineAdmission
from scheduler_service.core.errors import (
    AdmissionRefused,
    ErrorKind,
    RequestError,
    RequestRejected,
)
from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.length_limits import (
    check_room_in_cache,
    check_room_under_model_length,
)
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.router import DEFAULT_TOKENS_PER_REQUEST, route
from scheduler_service.core.step_plan import (
    RequestUpdate,
    StepOutput,
    StepPlan,
    StepUpdates,
)
from scheduler_service.core.suffix_proposer import SuffixTable
from scheduler_service.core.tenant_quotas import TenantQuotas
from scheduler_service.core.tenants import TenantTable, load_tenants_file
from scheduler_service.frontend.draining import refuse_when_draining
from scheduler_service.frontend.output_stream import OutputStream
from scheduler_service.frontend.stream_backlog import BacklogLimits
from scheduler_service.frontend.tracing import NO_TRACING, Tracing
from scheduler_service.planner.executor_link import ExecutorLink
from scheduler_service.planner.executor_status import executor_status
from scheduler_service.planner.kv_moves import DECODE_ROLE, PREFILL_ROLE, KvMoves
from scheduler_service.planner.lane import ExecutorLane, LaneOptions, LaneState
from scheduler_service.planner.lane_audit import ExecutorAudit
from scheduler_service.planner.metrics import SchedulerMetrics
from scheduler_service.planner.request_sink import RequestSink
from scheduler_service.planner.step_trace import StepTrace
from scheduler_service.structured.grammars import Grammars
from scheduler_service.text.tokenizer import TextProcessor

logger = logging.getLogger(__name__)

# A request whose executor is lost this many times while it runs is failed rather than retried:
# it may be what brings executors down.
MAX_EXECUTOR_LOSSES = 3
# A request waits this long while no executor can take it (all down, drained or refused) before
# it fails with UNAVAILABLE naming why: long enough for a killed executor to be restarted and
# reload a small model, short enough that a client of a drained fleet is not left hanging.
DEFAULT_NO_EXECUTOR_TIMEOUT_S = 30.0
# With prefill executors: prompts with fewer uncached tokens than this skip them and are computed
# where they will decode (a short prompt costs less to compute than to move).
DEFAULT_PREFILL_MIN_TOKENS = 64
# A running request moves to an idle executor only with this many tokens left to generate: the
# move costs about one step of the idle executor (it fetches while it steps), and a request that
# ends sooner would not repay it.
DEFAULT_REBALANCE_MIN_TOKENS_LEFT = 128


@dataclass(slots=True, frozen=True)
class EngineOptions:
    lane: LaneOptions = LaneOptions()
    # Requests allowed to wait before new ones are refused with RESOURCE_EXHAUSTED.
    max_waiting: int = 10_000
    # Routing: cached prompt tokens worth one more queued request (core/router.py).
    route_tokens_per_request: int = DEFAULT_TOKENS_PER_REQUEST
    # Tokens a stream gathers before sending them (frontend/output_stream.py).
    stream_interval: int = 1
    # How far a stream's reader may fall behind before its request is ended
    # (frontend/stream_backlog.py).
    stream_backlog: BacklogLimits = BacklogLimits()
    # Seconds a request may wait with no executor able to take it (see run()).
    no_executor_timeout_s: float = DEFAULT_NO_EXECUTOR_TIMEOUT_S
    # Uncached prompt tokens from which a request goes to a prefill executor (--prefill-min-tokens).
    prefill_min_tokens: int = DEFAULT_PREFILL_MIN_TOKENS
    # An idle executor takes running requests with at least this many tokens left to generate
    # from a busier one, with their K/V (kv_moves.rebalance); 0: never.
    rebalance_min_tokens_left: int = DEFAULT_REBALANCE_MIN_TOKENS_LEFT


class EngineUnavailable(RequestRejected):
    """No executor has been reached yet."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorKind.UNAVAILABLE, message)


class Engine:
    def __init__(
        self,
        scheduler_id: str,
        text: TextProcessor | None,
        options: EngineOptions,
        metrics: SchedulerMetrics,
        on_serving: Callable[[bool], None] = lambda serving: None,
        link_factory: Callable[[str, str], ExecutorLink] = ExecutorLink,
        tracing: Tracing = NO_TRACING,
        step_trace: StepTrace | None = None,
        grammars: Grammars | None = None,
        tenants: TenantTable | None = None,
    ) -> None:
        self.scheduler_id = scheduler_id
        self.text = text
        # Where constrained requests' grammar states come from (structured outputs).
        self.grammars = grammars if grammars is not None else Grammars(text)
        self.options = options
        self.metrics = metrics
        self.tracing = tracing
        # --trace-dir: every plan, result and request event, for replay (planner/step_trace.py).
        self.step_trace = step_trace
        self.on_serving = on_serving
        self._link_factory = link_factory
        self.lanes: dict[str, ExecutorLane] = {}
        # The first executor reached fixes the model every other one must serve.
        self.info: executor_pb2.ExecutorInfo | None = None
        # Requests no lane can take now (none up), in arrival order.
        self.unplaced: list[Request] = []
        # When each unplaced request was first seen unplaced (run() checks once a second).
        self._unplaced_since: dict[str, float] = {}
        self._arrivals = itertools.count()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._first_up = asyncio.Event()
        self._serving = False
        # Set on shutdown: new requests are refused while the ones in flight finish.
        self.draining = False
        # A standby planner takes requests before it has reached any executor (front-ends move
        # theirs to it when their planner is lost); they wait, unplaced, for the executors.
        self.queue_before_first_executor = False
        # Where steady decodes' tokens go in bulk, by delivery key (Request.delivery_key), when
        # every request's sink only passes tokens on (the planner's, to its front-ends): then no
        # token is looked at one by one here. None: each goes to its request's sink.
        self.bulk_delivery: Callable[[np.ndarray, list[int]], None] | None = None
        # Since start, over every lane and every planner a lane had (a lost executor's planner
        # goes with it).
        self.num_preemptions = 0
        self.num_steps = 0
        self._counts_seen: dict[str, tuple[int, int]] = {}
        self._recomputed_seen: dict[str, dict[str, int]] = {}
        self.num_recomputed_tokens = 0
        # Requests moving between executors with their K/V (planner/kv_moves.py).
        self.moves = KvMoves(lambda: self.lanes.values(), self._place, metrics, step_trace)
        # Tenants' quotas (and their requests held for a seat), the fair policy's books over
        # every executor, and admission by deadline.
        self.quotas = TenantQuotas(tenants if tenants is not None else TenantTable())
        self.share = FairShare(lambda tenant: self.quotas.table.limits(tenant).weight)
        self.deadlines = DeadlineAdmission()
        # Recent outputs of the requests on every executor, which the suffix proposer of
        # speculative decoding continues from (core/suffix_proposer.py).
        self.suffixes = SuffixTable()
        metrics.count_when_scraped(lambda: self.num_running, lambda: self.num_waiting, self._kv_usage)

    # ---- executors ---------------------------------------------------------------------------

    def add_executor(self, address: str) -> None:
        if address in self.lanes:
            return
        eos = frozenset(self.text.eos_token_ids if self.text else ())
        link = self._link_factory(address, self.scheduler_id)
        lane = ExecutorLane(address, link, self.options.lane, self, eos)
        self.lanes[address] = lane
        self._tasks[address] = asyncio.get_running_loop().create_task(lane.run())
        logger.info("event=executor_added address=%s", address)

    def remove_executor(self, address: str) -> None:
        """Takes an executor out for good: drained first, so nothing it runs fails."""
        lane = self.lanes.get(address)
        if lane is not None:
            lane.retired = True
            if lane.state in (LaneState.UP, LaneState.DRAINING):
                self.drain(address)
            else:
                self._forget_lane(lane)

    def drain(self, address: str) -> ExecutorLane:
        lane = self._lane(address)
        if lane.state is LaneState.UP:
            lane.drain()
            assert lane.scheduler is not None
            queued = lane.scheduler.release_waiting(lane.scheduler.queued)
            self._trace_left(lane, queued)
            self._place(queued)
            self._report_serving()
            self.moves.evacuate(lane)
        return lane

    def resume(self, address: str) -> ExecutorLane:
        lane = self._lane(address)
        lane.retired = False
        lane.resume()
        self._report_serving()
        return lane

    async def audit(self) -> list[ExecutorAudit]:
        """Every executor's block accounting checked end to end (lane.audit), together."""
        return list(await asyncio.gather(*(lane.audit() for lane in self.lanes.values())))

    def knobs(self) -> SchedulingKnobs:
        lane = self.options.lane
        return SchedulingKnobs(lane.policy, lane.mode, lane.max_num_batched_tokens, lane.max_num_seqs)

    def reconfigure(self, knobs: SchedulingKnobs) -> None:
        """Every executor's planner, and those of executors that join later, plan under these
        knobs from their next step on."""
        lane_options = replace(
            self.options.lane,
            policy=knobs.policy,
            mode=knobs.mode,
            max_num_batched_tokens=knobs.max_num_batched_tokens,
            max_num_seqs=knobs.max_num_seqs,
        )
        self.options = replace(self.options, lane=lane_options)
        for lane in self.lanes.values():
            lane.options = lane_options
            if lane.scheduler is not None:
                lane.scheduler.reconfigure(knobs)
        logger.info(
            "event=scheduling_reconfigured policy=%s mode=%s max_num_batched_tokens=%d max_num_seqs=%d",
            knobs.policy.value, knobs.mode.value, knobs.max_num_batched_tokens, knobs.max_num_seqs,
        )

    @property
    def serving(self) -> bool:
        """Whether an executor takes requests now."""
        return self._serving

    async def wait_until_serving(self) -> None:
        await self._first_up.wait()

    async def run(self) -> None:
        """Runs until cancelled; a lane whose loop fails takes the engine down with it. Once a
        second, requests that no executor could take for --no-executor-timeout fail."""
        while True:
            tasks = list(self._tasks.values())
            if not tasks:
                await asyncio.sleep(1.0)
            else:
                done, _ = await asyncio.wait(tasks, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
            self.expire_unplaced(time.monotonic())

    def expire_unplaced(self, now: float) -> None:
        """Fails the requests that have waited unplaced for the timeout: with every executor
        drained, down or refused, a client learns why instead of waiting without end."""
        since = {r.request_id: self._unplaced_since.get(r.request_id, now) for r in self.unplaced}
        self._unplaced_since = since
        timeout = self.options.no_executor_timeout_s
        expired = [r for r in self.unplaced if now - since[r.request_id] >= timeout]
        if not expired:
            return
        message = f"no executor could take the request for {timeout:g} s: {self.why_no_executor()}"
        for request in expired:
            self.unplaced.remove(request)
            del since[request.request_id]
            request.finish_reason = FinishReason.ABORT
            self._fail(request, RequestError(ErrorKind.UNAVAILABLE, message))
        logger.warning("event=requests_expired_unplaced count=%d reason=%r", len(expired), message)

    def why_no_executor(self) -> str:
        """Each executor's state and reason, as a client reads it in an error."""
        if not self.lanes:
            return "no executor is configured"
        parts = []
        for lane in self.lanes.values():
            part = f"{lane.address} is {lane.state.value}"
            if lane.reason and lane.reason != lane.state.value:
                part += f" ({lane.reason})"
            if lane.state in (LaneState.DRAINING, LaneState.DRAINED):
                part += " (Admin/ResumeExecutor takes it back)"
            parts.append(part)
        return "; ".join(parts)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for lane in self.lanes.values():
            await lane.link.close()

    # ---- requests ----------------------------------------------------------------------------

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
        if intake and not resumed:
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

    def open_stream(self, request: Request, trace_carrier: Mapping[str, str] | None = None) -> OutputStream:
        """submit() with the request's client in this process (the client API's Generate)."""
        stream = self.submit(request, trace_carrier)
        assert isinstance(stream, OutputStream)
        return stream

    @property
    def wants_trace_context(self) -> bool:
        return self.tracing.enabled

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

    async def server_status(self) -> pb.ServerStatus:
        """Queues, KV cache and executors, as GetServerStatus reports them."""
        options = self.options.lane
        status = pb.ServerStatus(
            policy=options.policy.value,
            mode=options.mode.value,
            num_waiting=self.num_waiting,
            num_running=self.num_running,
        )
        queried = hits = 0
        for lane in self.lanes.values():
            executor = executor_status(lane)
            status.executors.append(executor)
            status.kv_blocks_total += executor.kv_blocks_total
            status.kv_blocks_free += executor.kv_blocks_free
            status.state_slots_total += executor.state_slots_total
            status.state_slots_free += executor.state_slots_free
            if lane.scheduler is not None:
                stats = lane.scheduler.kv.stats()
                queried += stats.queried_tokens
                hits += stats.hit_tokens
        status.prefix_cache_hit_rate = hits / queried if queried else 0.0
        status.num_preemptions = self.num_preemptions
        status.num_steps = self.num_steps
        status.num_kv_moves = self.moves.num_moved
        status.num_recomputed_tokens = self.num_recomputed_tokens
        return status

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

    # The totals are read by the metrics' scrape too, from its own thread: they iterate over a
    # copy of the lanes (made in one step), and read each lane's planner once.

    @property
    def num_waiting(self) -> int:
        return len(self.unplaced) + self.quotas.num_held + sum(
            scheduler.num_waiting for lane in list(self.lanes.values()) if (scheduler := lane.scheduler)
        )

    @property
    def num_running(self) -> int:
        return sum(len(scheduler.running) for lane in list(self.lanes.values()) if (scheduler := lane.scheduler))

    def _kv_usage(self) -> float:
        """Share of the serving executors' KV blocks in use."""
        total = free = 0
        for lane in list(self.lanes.values()):
            scheduler = lane.scheduler
            if lane.serving and scheduler is not None:
                total += scheduler.kv.pool.num_blocks
                free += scheduler.kv.num_free_blocks
        return 1.0 - free / total if total else 0.0

    # ---- lane hooks --------------------------------------------------------------------------

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

    # ---- internals ---------------------------------------------------------------------------

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

    def _trace_ended(self, lane: ExecutorLane, request: Request, how: str) -> None:
        if self.step_trace is not None:
            self.step_trace.request_ended(lane.address, request, how)

    def _trace_left(self, lane: ExecutorLane, requests: Iterable[Request]) -> None:
        for request in requests:
            self._trace_ended(lane, request, "leave")

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

    def _every_request(self) -> list[Request]:
        placed = [r for lane in self.lanes.values() if lane.scheduler is not None for r in lane.scheduler.requests.values()]
        return [*placed, *self.unplaced, *self.moves.in_transit, *self.quotas.held()]

    def _find(self, request_id: str) -> Request | None:
        for lane in self.lanes.values():
            if lane.scheduler is not None and request_id in lane.scheduler.requests:
                return lane.scheduler.requests[request_id]
        return next(
            (r for r in [*self.unplaced, *self.moves.in_transit, *self.quotas.held()] if r.request_id == request_id), None
        )

    def _lane_of(self, request: Request) -> ExecutorLane | None:
        for lane in self.lanes.values():
            if lane.scheduler is not None and lane.scheduler.requests.get(request.request_id) is request:
                return lane
        return None

    def _lane(self, address: str) -> ExecutorLane:
        lane = self.lanes.get(address)
        if lane is None:
            known = ", ".join(sorted(self.lanes)) or "none"
            raise RequestRejected(ErrorKind.NOT_FOUND, f"no executor at {address!r} (known: {known})")
        return lane

    def _serving_lanes(self) -> list[ExecutorLane]:
        return [lane for lane in self.lanes.values() if lane.serving and lane.scheduler is not None]

    def _forget_lane(self, lane: ExecutorLane) -> None:
        self.lanes.pop(lane.address, None)
        task = self._tasks.pop(lane.address, None)
        if task is not None:
            task.cancel()
        asyncio.get_running_loop().create_task(lane.link.close())
        self.metrics.executor_removed(lane.address)
        logger.info("event=executor_removed address=%s", lane.address)

    def _report_serving(self) -> None:
        for lane in self.lanes.values():
            if lane.scheduler is not None and lane.info is not None and lane.info.role == PREFILL_ROLE:
                lane.scheduler.hand_off_after_prefill = bool(self.moves.destinations(lane))
        serving = bool(self._serving_lanes())
        self.metrics.executors_up.set(len(self._serving_lanes()))
        if serving != self._serving:
            self._serving = serving
            self.on_serving(serving)

    def _count(self, lane: ExecutorLane) -> None:
        """Adds the lane's new preemptions and steps to the totals. Requests sent back by a lost
        executor count as preempted: they are recomputed the same way."""
        scheduler = lane.scheduler
        if scheduler is None:
            return
        preemptions, steps = self._counts_seen.get(lane.address, (0, 0))
        new_preemptions = scheduler.num_preemptions - preemptions
        self.num_preemptions += new_preemptions
        self.num_steps += scheduler.num_steps - steps
        self.metrics.preemptions.inc(new_preemptions)
        self._counts_seen[lane.address] = (scheduler.num_preemptions, scheduler.num_steps)
        seen = self._recomputed_seen.setdefault(lane.address, {})
        for reason, tokens in scheduler.recomputed_tokens.items():
            if tokens != seen.get(reason, 0):
                self.metrics.recomputed_tokens.labels(reason).inc(tokens - seen.get(reason, 0))
                self.num_recomputed_tokens += tokens - seen.get(reason, 0)
                seen[reason] = tokens

    def _observe_lane(self, stepped: ExecutorLane) -> None:
        """After a lane's step, that lane's own gauges (the totals over every lane are read
        when scraped: SchedulerMetrics.count_when_scraped)."""
        scheduler = stepped.scheduler
        if scheduler is not None:
            lane_total = scheduler.kv.pool.num_blocks
            lane_usage = 1.0 - scheduler.kv.num_free_blocks / lane_total if lane_total else 0.0
            self.metrics.executor_stepped(stepped.address, scheduler.load, lane_usage)


def _stream_of(request: Request) -> RequestSink:
    """The stream submit() attached to the request."""
    stream = request.output
    assert stream is not None, f"request {request.request_id} has no output stream"
    return stream
