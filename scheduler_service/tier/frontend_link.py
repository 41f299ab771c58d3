"""The planner's side of one front-end's Connect stream: the requests it submitted, by handle,
and the batch of tokens and ends gathered for it, sent as one PlannerBatch (never one message
per token).

A batch is queued as soon as its first entry is gathered and goes on gathering until the stream's
writer takes it: one step's tokens when the writer is idle (it takes the batch once the turn of
the event loop that gathered them ends), the tokens of every step that came back meanwhile when
it is still sending the last one. So a busy planner sends fewer, larger messages, with no token
held back to make them."""

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from protos.splitserve.executor.v1 import executor_pb2
from protos.splitserve.planner.v1 import planner_pb2
from scheduler_service.core.errors import RequestError
from scheduler_service.core.request import Request
from scheduler_service.frontend.output_stream import FINISH_REASONS
from scheduler_service.frontend.status_codes import STATUS_CODES

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Gathered:
    """One PlannerBatch in the making, as plain lists until it is sent."""

    handles: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # Tokens of each entry of handles, kept from the first entry that got other than one: until
    # then every entry got one (steady decodes), and the message leaves num_tokens out.
    num_tokens: list[int] | None = None
    logprobs: list[planner_pb2.RequestLogprobs] = field(default_factory=list)
    started: list[int] = field(default_factory=list)
    queued_s: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    finished: list[planner_pb2.FinishedRequest] = field(default_factory=list)
    failed: list[planner_pb2.FailedRequest] = field(default_factory=list)

    def message(self) -> planner_pb2.PlannerBatch:
        batch = planner_pb2.PlannerBatch(
            handles=self.handles,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            started=self.started,
            queued_s=self.queued_s,
            cached_tokens=self.cached_tokens,
            finished=self.finished,
            failed=self.failed,
        )
        if self.num_tokens is not None:
            batch.num_tokens.extend(self.num_tokens)
        return batch


class FrontendLink:
    def __init__(self, frontend_id: str, peer: str, index: int) -> None:
        self.frontend_id = frontend_id
        self.peer = peer
        # This stream's number on the planner: the high half of its requests' delivery keys.
        self.index = index
        # What the stream submitted and has not seen end, by handle.
        self.requests: dict[int, "RemoteSink"] = {}
        # What to send, in order: batches (the last still gathering until taken), statuses, and
        # None, which ends the stream.
        self.outbox: asyncio.Queue[_Gathered | planner_pb2.PlannerBatch | None] = asyncio.Queue()
        # The batch queued and not yet taken, which what is gathered joins.
        self._gathered: _Gathered | None = None

    def tokens(
        self, sink: "RemoteSink", token_ids: list[int], logprobs: Sequence[executor_pb2.TokenLogprob]
    ) -> None:
        # Called once per token delivered: the common case (one token, no logprobs, started) is
        # two appends.
        gathered = self._gathered or self._gather()
        gathered.handles.append(sink.handle)
        gathered.token_ids.extend(token_ids)
        if gathered.num_tokens is not None:
            gathered.num_tokens.append(len(token_ids))
        elif len(token_ids) != 1:
            gathered.num_tokens = [1] * (len(gathered.handles) - 1) + [len(token_ids)]
        if logprobs:
            gathered.logprobs.append(planner_pb2.RequestLogprobs(handle=sink.handle, logprobs=logprobs))
        if not sink.started:
            sink.started = True
            request = sink.request
            gathered.started.append(sink.handle)
            scheduled = request.first_scheduled_time
            gathered.queued_s.append(scheduled - request.arrival_time if scheduled is not None else 0.0)
            gathered.cached_tokens.append(request.num_cached_tokens)

    def bulk_tokens(self, handles: list[int], token_ids: list[int]) -> None:
        """One token each for requests that have started: steady decodes, whose first token
        after their prefill always came through tokens()."""
        gathered = self._gathered or self._gather()
        gathered.handles += handles
        gathered.token_ids += token_ids
        if gathered.num_tokens is not None:
            gathered.num_tokens += [1] * len(handles)

    def finished(self, sink: "RemoteSink") -> None:
        request = sink.request
        self.requests.pop(sink.handle, None)
        if request.finish_reason is None:
            return
        self._gather().finished.append(
            planner_pb2.FinishedRequest(
                handle=sink.handle,
                finish_reason=FINISH_REASONS[request.finish_reason],
                num_preemptions=request.num_preemptions,
                stop_reason=request.stop_reason or "",
            )
        )

    def failed(self, handle: int, error: RequestError) -> None:
        self.requests.pop(handle, None)
        self._gather().failed.append(
            planner_pb2.FailedRequest(
                handle=handle,
                code=STATUS_CODES[error.kind].value[0],
                message=error.message,
                retry_after_s=error.retry_after_s or 0.0,
            )
        )

    def status(self, status: planner_pb2.PlannerStatus) -> None:
        """Sent after whatever was gathered before it, and before anything gathered after."""
        self._gathered = None
        self.outbox.put_nowait(planner_pb2.PlannerBatch(status=status))

    def close(self) -> None:
        self._gathered = None
        self.outbox.put_nowait(None)

    def take(self, item: "_Gathered | planner_pb2.PlannerBatch") -> planner_pb2.PlannerBatch:
        """What the writer sends for an item it took from the outbox: a gathered batch gathers
        no more from here on."""
        if isinstance(item, planner_pb2.PlannerBatch):
            return item
        if item is self._gathered:
            self._gathered = None
        return item.message()

    def _gather(self) -> _Gathered:
        if self._gathered is None:
            self._gathered = _Gathered()
            self.outbox.put_nowait(self._gathered)
        return self._gathered


class RemoteSink:
    """A request's sink on the planner: its tokens go to the front-end that holds its client,
    which detokenizes them, finds stop strings and streams (output_stream.OutputStream there)."""

    __slots__ = ("request", "closed", "error", "trace_span", "link", "handle", "started")

    def __init__(self, request: Request, link: FrontendLink, handle: int) -> None:
        self.request = request
        self.closed = False
        self.error: RequestError | None = None
        self.trace_span: object = None
        self.link = link
        self.handle = handle
        # Whether its first tokens from this planner went out (with its queue time).
        self.started = False

    def add_tokens(
        self, token_ids: list[int], logprobs: Sequence[executor_pb2.TokenLogprob]
    ) -> tuple[tuple[list[int], Sequence[executor_pb2.TokenLogprob]], None]:
        return (token_ids, logprobs), None

    def send(self, message: tuple[list[int], Sequence[executor_pb2.TokenLogprob]]) -> None:
        token_ids, logprobs = message
        # No tokens but records: a prompt scored alone (max_tokens 0).
        if token_ids or logprobs:
            self.link.tokens(self, token_ids, logprobs)

    def close(self, message: tuple[list[int], Sequence[executor_pb2.TokenLogprob]] | None = None) -> None:
        if self.closed:
            return
        if message is not None:
            self.send(message)
        self.closed = True
        self.link.finished(self)

    def fail(self, error: RequestError) -> None:
        if self.closed:
            return
        self.closed = True
        self.error = error
        self.link.failed(self.handle, error)
