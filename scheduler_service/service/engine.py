"""The engine loop: plan, send, receive, update, with the next plan on the wire before the last
result returns, so the executor never waits for the scheduler."""

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from protos.splitserve.executor.v1 import executor_pb2
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.errors import ErrorKind, RequestError, RequestRejected
from scheduler_service.core.policy import Policy, StepMode
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.scheduler import ExecutorReset, Scheduler
from scheduler_service.core.step_plan import RequestUpdate
from scheduler_service.service.executor_link import ExecutorLink, ExecutorLost
from scheduler_service.service.metrics import SchedulerMetrics
from scheduler_service.service.output_stream import OutputStream
from scheduler_service.service.plan_codec import output_from_proto, plan_to_proto
from scheduler_service.text.tokenizer import TextProcessor

logger = logging.getLogger(__name__)

# A request whose executor is lost this many times while it runs is failed rather than retried:
# it may be what brings the executor down.
MAX_EXECUTOR_LOSSES = 3


@dataclass(slots=True, frozen=True)
class EngineOptions:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: Policy = Policy.FCFS
    mode: StepMode = StepMode.MIXED
    # Requests allowed to wait before new ones are refused with RESOURCE_EXHAUSTED.
    max_waiting: int = 10_000
    # Plans on the wire at once: 2 lets the executor start step N+1 as soon as step N ends.
    pipeline_depth: int = 2


class EngineUnavailable(RequestRejected):
    """No executor has been reached yet."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorKind.UNAVAILABLE, message)


class Engine:
    def __init__(
        self,
        link: ExecutorLink,
        text: TextProcessor | None,
        options: EngineOptions,
        metrics: SchedulerMetrics,
        on_executor_state: Callable[[bool], None] = lambda up: None,
    ) -> None:
        self.link = link
        self.text = text
        self.options = options
        self.metrics = metrics
        self.on_executor_state = on_executor_state
        self.info: executor_pb2.ExecutorInfo | None = None
        self.scheduler: Scheduler | None = None
        self.executor_up = False
        self._wake = asyncio.Event()
        self._preemptions_seen = 0

    async def connect(self) -> None:
        info = await self.link.connect()
        self.info = info
        eos = set(info.eos_token_ids) | set(self.text.eos_token_ids if self.text else ())
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_kv_blocks=info.num_kv_blocks,
                block_size=info.block_size,
                max_model_len=info.max_model_len,
                max_num_seqs=self.options.max_num_seqs,
                max_num_batched_tokens=self.options.max_num_batched_tokens,
                policy=self.options.policy,
                mode=self.options.mode,
            ),
            eos_token_ids=eos,
        )
        self._set_executor_up(True)

    def submit(self, request: Request) -> OutputStream:
        scheduler = self._require_scheduler()
        if len(scheduler.waiting) >= self.options.max_waiting:
            raise RequestRejected(
                ErrorKind.OVERLOADED, f"{len(scheduler.waiting)} requests are already waiting; retry later"
            )
        scheduler.add_request(request)
        stream = request.output = OutputStream(request, self.text)
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> bool:
        request = self.scheduler.requests.get(request_id) if self.scheduler else None
        return request is not None and self._abort(request)

    def cancel(self, stream: OutputStream) -> bool:
        """Aborts the request of this stream, if still running; unlike abort(id) it never
        touches a newer request that reuses the id after this one ended."""
        request = stream.request
        if self.scheduler is None or self.scheduler.requests.get(request.request_id) is not request:
            return False
        return self._abort(request)

    def abort_all(self) -> None:
        if self.scheduler is not None:
            for request in list(self.scheduler.requests.values()):
                self._abort(request)

    def _abort(self, request: Request) -> bool:
        self._require_scheduler().finish(request, FinishReason.ABORT)
        self._close(request)
        self._wake.set()
        return True

    async def run(self) -> None:
        """Runs until cancelled. A lost executor is reconnected; its requests are recomputed."""
        while True:
            try:
                await self._drive()
            except ExecutorLost as lost:
                logger.warning("event=executor_lost address=%s reason=%s", self.link.address, lost)
                self._set_executor_up(False)
                info = await self.link.connect()
                self.info = info
                scheduler = self._require_scheduler()
                reset = scheduler.reset_executor(info.num_kv_blocks, info.block_size, info.max_model_len)
                self._settle_after_reset(scheduler, reset)
                self._set_executor_up(True)

    def _settle_after_reset(self, scheduler: Scheduler, reset: ExecutorReset) -> None:
        for request in reset.finished:
            self._close(request)
        for request in reset.requeued:
            if request.num_executor_losses >= MAX_EXECUTOR_LOSSES:
                scheduler.finish(request, FinishReason.ABORT)
                message = (
                    f"the executor was lost {request.num_executor_losses} times while running "
                    f"request {request.request_id}; giving up on it"
                )
                self._fail(request, RequestError(ErrorKind.UNAVAILABLE, message))
        logger.info(
            "event=requests_requeued count=%d finished=%d", len(reset.requeued), len(reset.finished)
        )

    async def _drive(self) -> None:
        scheduler = self._require_scheduler()
        in_flight: deque[int] = deque()
        while True:
            while len(in_flight) < self.options.pipeline_depth:
                plan = scheduler.schedule()
                if not plan.has_work and not plan.dropped_request_ids:
                    break
                await self.link.send(plan_to_proto(plan, scheduler.eos_token_ids))
                in_flight.append(plan.step_id)
            self._observe_queues(scheduler)
            if not in_flight:
                self._wake.clear()
                await self._wake.wait()
                continue
            result = output_from_proto(await self.link.receive())
            in_flight.popleft()
            self.metrics.forward_time.observe(result.forward_time_s)
            self.metrics.step_time.observe(result.step_time_s)
            for update in scheduler.update(result):
                self._deliver(update)

    def _deliver(self, update: RequestUpdate) -> None:
        request = update.request
        if update.error is not None:
            logger.error(
                "event=request_failed_in_executor request_id=%s kind=%s reason=%r",
                request.request_id, update.error.kind.value, update.error.message,
            )
            self._fail(request, update.error)
            return
        self.metrics.generation_tokens.inc(len(update.new_token_ids))
        stream = _stream_of(request)
        message, stop_string = stream.add_tokens(update.new_token_ids, update.new_logprobs)
        if stop_string is not None:
            self._require_scheduler().stop_at_string(request, stop_string)
        if request.is_finished:
            self._close(request, message)
        else:
            stream.queue.put_nowait(message)

    def _close(self, request: Request, message: pb.GenerateResponse | None = None) -> None:
        stream = _stream_of(request)
        if not stream.closed:
            stream.close(message)
            self.metrics.request_finished(request)

    def _fail(self, request: Request, error: RequestError) -> None:
        stream = _stream_of(request)
        if not stream.closed:
            stream.fail(error)
            self.metrics.request_finished(request)

    def _observe_queues(self, scheduler: Scheduler) -> None:
        self.metrics.running.set(len(scheduler.running))
        self.metrics.waiting.set(len(scheduler.waiting))
        self.metrics.kv_usage.set(scheduler.kv.stats().usage)
        # Requests sent back by a lost executor count too: they are recomputed the same way.
        self.metrics.preemptions.inc(scheduler.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = scheduler.num_preemptions

    def _set_executor_up(self, up: bool) -> None:
        self.executor_up = up
        self.metrics.executors_up.set(1 if up else 0)
        self.on_executor_state(up)

    def _require_scheduler(self) -> Scheduler:
        if self.scheduler is None:
            raise EngineUnavailable(f"the executor at {self.link.address} has not been reached yet")
        return self.scheduler


def _stream_of(request: Request) -> OutputStream:
    """The stream submit() attached to the request."""
    stream = request.output
    assert isinstance(stream, OutputStream), f"request {request.request_id} has no output stream"
    return stream
