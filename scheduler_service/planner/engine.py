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
from collections.abc import Callable, Iterable
from dataclasses import replace

import numpy as np

from protos.splitserve.executor.v1 import executor_pb2
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.config import SchedulingKnobs
from scheduler_service.core.deadline_admission import DeadlineAdmission
from scheduler_service.core.errors import ErrorKind, RequestError, RequestRejected
from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.suffix_proposer import SuffixTable
from scheduler_service.core.tenant_quotas import TenantQuotas
from scheduler_service.core.tenants import TenantTable
from scheduler_service.frontend.tracing import NO_TRACING, Tracing
from scheduler_service.planner.delivery import Delivery
from scheduler_service.planner.engine_options import EngineOptions
from scheduler_service.planner.executor_link import ExecutorLink
from scheduler_service.planner.executor_status import executor_status
from scheduler_service.planner.intake import Intake
from scheduler_service.planner.kv_moves import PREFILL_ROLE, KvMoves
from scheduler_service.planner.lane import ExecutorLane, LaneState
from scheduler_service.planner.lane_audit import ExecutorAudit
from scheduler_service.planner.lane_events import LaneEvents
from scheduler_service.planner.metrics import SchedulerMetrics
from scheduler_service.planner.step_trace import StepTrace
from scheduler_service.structured.grammars import Grammars
from scheduler_service.text.tokenizer import TextProcessor

logger = logging.getLogger(__name__)


class Engine(Intake, Delivery, LaneEvents):
    """Every executor's lane and the requests on them. Its parts are mixins in files of their
    own: where a new request goes (intake.py), what reaches its stream (delivery.py), and what
    it does as executors come and go (lane_events.py)."""

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

    # ---- status and totals -------------------------------------------------------------------

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

    # ---- internals ---------------------------------------------------------------------------

    def _trace_ended(self, lane: ExecutorLane, request: Request, how: str) -> None:
        if self.step_trace is not None:
            self.step_trace.request_ended(lane.address, request, how)

    def _trace_left(self, lane: ExecutorLane, requests: Iterable[Request]) -> None:
        for request in requests:
            self._trace_ended(lane, request, "leave")

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

