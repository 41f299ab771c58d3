"""A front-end's backend (frontend/backend.py): its requests planned by a planner over the
Planner API. The front-end holds each request's durable state (prompt, every token delivered,
sampling parameters and seed, its client's stream), so when its planner is lost it submits them
all again, with those tokens, to the next planner that is up: the new planner recomputes them as
executor failover does, and no client sees a gap, a repeat or an error."""

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from protos.splitserve.executor.v1 import executor_pb2
from protos.splitserve.planner.v1 import planner_pb2
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import ErrorKind, RequestError, RequestRejected
from scheduler_service.core.handles import Handles
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.stop_checker import check_stop
from scheduler_service.frontend.draining import refuse_when_draining
from scheduler_service.frontend.output_stream import OutputStream
from scheduler_service.frontend.status_codes import KINDS_BY_CODE
from scheduler_service.frontend.stream_backlog import BacklogLimits
from scheduler_service.planner.lane_events import MAX_EXECUTOR_LOSSES
from scheduler_service.text.tokenizer import TextProcessor
from scheduler_service.tier.planner_link import PlannerLink
from scheduler_service.tier.request_codec import submitted
from service_support.transport_security import ClientTls

logger = logging.getLogger(__name__)

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_ABORT: FinishReason.ABORT,
}
# As many losses of its planner as of its executor before a request is given up on.
MAX_PLANNER_LOSSES = MAX_EXECUTOR_LOSSES


@dataclass(slots=True)
class _InFlight:
    request: Request
    stream: OutputStream
    trace_context: dict[str, str]
    # The planner it was submitted to (None: waiting for one to be up), and how many were lost.
    planner: PlannerLink | None = None
    num_planner_losses: int = 0
    # When it started waiting for a planner (monotonic), for the no-planner timeout.
    unplaced_since: float = field(default_factory=time.monotonic)


class PlannerClient:
    def __init__(
        self,
        addresses: Sequence[str],
        token: str | None,
        text: TextProcessor | None,
        frontend_id: str,
        stream_interval: int = 1,
        backlog: BacklogLimits = BacklogLimits(),
        no_planner_timeout_s: float = 30.0,
        on_serving: Callable[[bool], None] = lambda serving: None,
        tls: ClientTls | None = None,
    ) -> None:
        self.text = text
        self.frontend_id = frontend_id
        self.links = [PlannerLink(a, token, frontend_id, self._on_batch, self._on_lost, tls) for a in addresses]
        self.current: PlannerLink | None = None
        self._in_flight: dict[int, _InFlight] = {}
        self._handles_by_id: dict[str, int] = {}
        self._handles = Handles(self._in_flight.keys)
        self._stream_interval = stream_interval
        self._backlog = backlog
        self._no_planner_timeout_s = no_planner_timeout_s
        self._on_serving = on_serving
        self._serving = False
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self._model: executor_pb2.ExecutorInfo | None = None

    # ---- Backend -------------------------------------------------------------------------------

    @property
    def info(self) -> executor_pb2.ExecutorInfo | None:
        """The model, as the last planner that knew it said: kept across a planner's loss, so
        requests keep coming while a standby takes over."""
        return self._model

    @property
    def draining(self) -> bool:
        return self._stopping

    @draining.setter
    def draining(self, value: bool) -> None:
        self._stopping = value
        self._report_serving()

    @property
    def wants_trace_context(self) -> bool:
        # Whether the planner traces is its own business: the context goes along, small.
        return True

    @property
    def serving(self) -> bool:
        return self._serving

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def why_no_executor(self) -> str:
        current = self.current
        if current is not None and current.status is not None and current.status.reason:
            return current.status.reason
        return "no planner is up: " + "; ".join(f"{link.address} ({link.reason})" for link in self.links)

    def open_stream(self, request: Request, trace_carrier: Mapping[str, str] | None = None) -> OutputStream:
        refuse_when_draining(self._stopping)
        info = self.info
        if info is None:
            raise RequestRejected(ErrorKind.UNAVAILABLE, f"no executor has been reached yet: {self.why_no_executor()}")
        if request.request_id in self._handles_by_id:
            raise RequestRejected(ErrorKind.DUPLICATE, f"request id {request.request_id!r} is already in flight")
        if request.num_prompt_tokens >= info.max_model_len:
            raise RequestRejected(
                ErrorKind.INVALID,
                f"prompt of {request.num_prompt_tokens} tokens leaves no room to generate under "
                f"the maximum model length of {info.max_model_len}",
            )
        request.arrival_time = request.arrival_time or time.monotonic()
        handle = self._handles.take()
        stream = OutputStream(
            request, self.text, self._stream_interval, self._backlog,
            lambda error: self._end(handle, FinishReason.ABORT, error=error),
        )
        request.output = stream
        entry = _InFlight(request, stream, dict(trace_carrier or {}))
        self._in_flight[handle] = entry
        self._handles_by_id[request.request_id] = handle
        self._place(handle, entry)
        return stream

    def cancel(self, stream: OutputStream) -> bool:
        handle = self._handles_by_id.get(stream.request.request_id)
        if handle is None or self._in_flight[handle].stream is not stream:
            return False
        self._end(handle, FinishReason.ABORT)
        return True

    async def abort_request(self, request_id: str) -> bool:
        """A request of this front-end ends here, with its other choices (SamplingParams.n);
        another's, through the planner."""
        family = [
            handle
            for handle in list(self._handles_by_id.values())
            if (request := self._in_flight[handle].stream.request).request_id == request_id or request.fork_of == request_id
        ]
        if family:
            for handle in family:
                self._end(handle, FinishReason.ABORT)
            return True
        if self.current is None:
            return False
        link = self.current
        try:
            return await link.abort(request_id)
        except grpc.aio.AioRpcError as error:
            raise _unanswered(link, error) from None

    async def server_status(self) -> pb.ServerStatus:
        if self.current is None:
            return pb.ServerStatus()
        link = self.current
        try:
            return await link.server_status()
        except grpc.aio.AioRpcError as error:
            raise _unanswered(link, error) from None

    # ---- running ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Keeps every planner link up and fails requests that found no planner in time."""
        self._tasks = [asyncio.create_task(link.run()) for link in self.links]
        try:
            while True:
                await asyncio.sleep(1.0)
                self._expire_unplaced(time.monotonic())
        finally:
            for task in self._tasks:
                task.cancel()

    async def close(self) -> None:
        for link in self.links:
            await link.close()

    def abort_all(self) -> None:
        for handle in list(self._in_flight):
            self._end(handle, FinishReason.ABORT)

    # ---- planner events -----------------------------------------------------------------------

    def _on_batch(self, link: PlannerLink, batch: planner_pb2.PlannerBatch) -> None:
        if batch.HasField("status"):
            if batch.status.HasField("model"):
                self._model = batch.status.model
            self._status_changed(link)
        if link is not self.current:
            return
        now = time.monotonic()
        messages: dict[int, pb.GenerateResponse] = {}
        logprobs = {entry.handle: entry.logprobs for entry in batch.logprobs}
        counts = batch.num_tokens or itertools.repeat(1)
        # Sliced once per entry: a list slices faster than the message's repeated field.
        token_ids = list(batch.token_ids)
        offset = 0
        for handle, count in zip(batch.handles, counts):
            tokens = token_ids[offset : offset + count]
            offset += count
            entry = self._in_flight.get(handle)
            if entry is None or entry.planner is not link:
                continue
            self._tokens(handle, entry, tokens, logprobs.get(handle, ()), messages, now)
        for handle, queued_s, cached in zip(batch.started, batch.queued_s, batch.cached_tokens):
            entry = self._in_flight.get(handle)
            if entry is not None and entry.request.first_scheduled_time is None:
                entry.request.first_scheduled_time = entry.request.arrival_time + queued_s
                entry.request.num_cached_tokens = cached
        for finished in batch.finished:
            entry = self._in_flight.get(finished.handle)
            if entry is None or entry.planner is not link:
                continue
            request = entry.request
            request.num_preemptions += finished.num_preemptions
            self._finish(finished.handle, FINISH_REASONS[finished.finish_reason], finished.stop_reason or None,
                         messages.pop(finished.handle, None))
        for failed in batch.failed:
            entry = self._in_flight.pop(failed.handle, None)
            if entry is None:
                continue
            self._handles_by_id.pop(entry.request.request_id, None)
            kind = KINDS_BY_CODE.get(failed.code, ErrorKind.INTERNAL)
            entry.stream.fail(RequestError(kind, failed.message, failed.retry_after_s or None))
        for handle, message in messages.items():
            entry = self._in_flight.get(handle)
            if entry is not None:
                entry.stream.send(message)

    def _tokens(
        self,
        handle: int,
        entry: _InFlight,
        tokens: list[int],
        logprobs: Sequence[executor_pb2.TokenLogprob],
        messages: dict[int, pb.GenerateResponse],
        now: float,
    ) -> None:
        request = entry.request
        if request.first_token_time is None:
            request.first_token_time = now
        message, stop = entry.stream.add_tokens(tokens, logprobs)
        # Tokens after the one that completed a stop string are none of the output (nor of its usage).
        request.token_ids.extend(tokens if stop is None else tokens[: stop.num_tokens])
        if handle in messages:
            earlier = messages[handle]
            text = earlier.text + message.text
            earlier.MergeFrom(message)
            earlier.text = text
            message = earlier
        if stop is None:
            messages[handle] = message
            return
        messages.pop(handle, None)
        self._finish(handle, FinishReason.STOP, stop.stop_string, message)
        if entry.planner is not None:
            entry.planner.end(handle, stop.stop_string)

    def _on_lost(self, link: PlannerLink, reason: str) -> None:
        """A planner's stream broke: its requests go to the next planner that is up, with the
        tokens they have."""
        if link is self.current:
            self.current = None
        now = time.monotonic()
        for handle, entry in list(self._in_flight.items()):
            if entry.planner is not link:
                continue
            entry.planner = None
            entry.unplaced_since = now
            entry.num_planner_losses += 1
            if entry.num_planner_losses >= MAX_PLANNER_LOSSES:
                message = (
                    f"the planner was lost {entry.num_planner_losses} times while running request "
                    f"{entry.request.request_id}; giving up on it"
                )
                self._end(handle, FinishReason.ABORT, error=RequestError(ErrorKind.UNAVAILABLE, message))
        self._choose()

    def _status_changed(self, link: PlannerLink) -> None:
        self._choose()
        self._report_serving()

    def _choose(self) -> None:
        """Picks the planner requests go to: one that serves, else any that is up (it may be
        waiting for the executors a lost planner held). The current one stays while it serves,
        or while it is up and no other serves; requests waiting on a planner that does not
        serve move to one that does (they hold no blocks there)."""
        current = self.current
        up = [link for link in self.links if link.up]
        serving = [link for link in up if link.serving]
        if current is not None and current.up and (current.serving or not serving):
            chosen: PlannerLink | None = current
        else:
            chosen = (serving or up or [None])[0]
        if chosen is not current:
            self.current = chosen
            if current is not None and current.up:
                for handle, entry in self._in_flight.items():
                    if entry.planner is current:
                        current.end(handle)
                        entry.planner = None
            if chosen is not None:
                assert chosen.status is not None
                logger.info("event=planner_chosen address=%s planner=%s", chosen.address, chosen.status.planner_id)
        if self.current is not None:
            for handle, entry in list(self._in_flight.items()):
                if entry.planner is None:
                    self._place(handle, entry)
        self._report_serving()

    def _place(self, handle: int, entry: _InFlight) -> None:
        """Sends a request to the current planner, unless it is already complete (its last
        delivered token ended it, and only the planner's word of it was lost)."""
        link = self.current
        if link is None:
            return
        info = self.info
        request = entry.request
        if info is not None and request.num_output_tokens:
            eos = set(info.eos_token_ids) | set(self.text.eos_token_ids if self.text else ())
            done = check_stop(request, eos, info.max_model_len)
            if done is not None:
                self._finish(handle, done[0], done[1], None)
                return
        entry.planner = link
        link.submit(submitted(request, handle, entry.num_planner_losses, entry.trace_context))

    def _expire_unplaced(self, now: float) -> None:
        for handle, entry in list(self._in_flight.items()):
            if entry.planner is None and now - entry.unplaced_since >= self._no_planner_timeout_s:
                message = f"no planner could take the request for {self._no_planner_timeout_s:g} s: {self.why_no_executor()}"
                self._end(handle, FinishReason.ABORT, error=RequestError(ErrorKind.UNAVAILABLE, message))

    # ---- ends ---------------------------------------------------------------------------------

    def _finish(self, handle: int, reason: FinishReason, stop_reason: str | None, message: pb.GenerateResponse | None) -> None:
        entry = self._in_flight.pop(handle, None)
        if entry is None:
            return
        self._handles_by_id.pop(entry.request.request_id, None)
        request = entry.request
        request.finish_reason, request.stop_reason = reason, stop_reason
        request.finish_time = time.monotonic()
        entry.stream.close(message)

    def _end(self, handle: int, reason: FinishReason, error: RequestError | None = None) -> None:
        """Ends a request here (the client went, fell behind, or its planners kept failing) and
        tells its planner to free its blocks."""
        entry = self._in_flight.get(handle)
        if entry is None:
            return
        if entry.planner is not None:
            entry.planner.end(handle)
        if error is None:
            self._finish(handle, reason, None, None)
        else:
            self._in_flight.pop(handle)
            self._handles_by_id.pop(entry.request.request_id, None)
            entry.request.finish_reason = reason
            entry.stream.fail(error)

    def _report_serving(self) -> None:
        serving = self.current is not None and self.current.serving and not self._stopping
        if serving != self._serving:
            self._serving = serving
            self._on_serving(serving)


def _unanswered(link: PlannerLink, error: grpc.aio.AioRpcError) -> RequestRejected:
    """A call the front-end passed on to its planner, failed: with the planner's code (most
    often UNAVAILABLE, the planner lost or not yet replaced: worth retrying), not gRPC's UNKNOWN
    for an exception in the handler."""
    code = error.code()
    kind = KINDS_BY_CODE.get(code.value[0], ErrorKind.UNAVAILABLE)
    return RequestRejected(kind, f"the planner at {link.address} did not answer: {code.name}: {error.details()}")
