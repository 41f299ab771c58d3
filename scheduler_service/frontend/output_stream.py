"""One request's way back to its client: token updates become GenerateResponse messages."""

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from protos.splitserve.executor.v1 import executor_pb2
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import ErrorKind, RequestError
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.frontend.stream_backlog import BacklogLimits, PendingMessage
from scheduler_service.text.detokenizer import IncrementalDetokenizer, StringStop
from scheduler_service.text.tokenizer import TextProcessor

logger = logging.getLogger(__name__)

FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


# What the servicer sends next: a message; an error ends the stream with that error's status,
# None ends it.
StreamItem = pb.GenerateResponse | RequestError | None


class OutputStream:
    """Messages for one Generate call, queued for the servicer that streams them.

    Token messages are folded as they come into the one message the servicer has not taken yet
    (stream_backlog.py), so a stream whose client or event loop fell behind catches up in one
    message, and its backlog costs bytes per token rather than a message per step. A reader that
    falls further behind than backlog allows has its request ended with RESOURCE_EXHAUSTED
    (on_backlog_exceeded; by default the stream just fails).

    stream_interval: tokens gathered before they are sent (the scheduler's --stream-interval).
    The first token goes at once, for the time to first token, and so does the end of the
    stream or an error; held tokens leave with the end, and before an error (never in one
    message with it)."""

    def __init__(
        self,
        request: Request,
        text: TextProcessor | None,
        stream_interval: int = 1,
        backlog: BacklogLimits = BacklogLimits(),
        on_backlog_exceeded: Callable[[RequestError], None] | None = None,
    ) -> None:
        self.request = request
        self._text = text
        self._pending: PendingMessage | None = None
        # Set while there is something to take: released tokens, or the end.
        self._ready = asyncio.Event()
        self._stream_interval = stream_interval
        self._held_tokens = 0
        self._first_sent = False
        # Whether the prompt's scores (SamplingParams.prompt_logprobs) are still to come: they
        # lead the logprob records of the request's first tokens.
        self._prompt_scores_due = request.sampling.prompt_logprobs is not None and request.num_output_tokens == 0
        self._backlog = backlog
        self._on_backlog_exceeded = on_backlog_exceeded or self.fail
        # Set by close() or fail(); what follows the last message is then self.error.
        self.closed = False
        # The request's span while tracing is on (frontend/tracing.py), else None.
        self.trace_span: Any = None
        # Why the request failed, once it has.
        self.error: RequestError | None = None
        self._detokenizer = (
            IncrementalDetokenizer(
                text.tokenizer,
                request.prompt_token_ids,
                request.sampling.skip_special_tokens,
                request.sampling.stop,
                request.sampling.min_tokens,
                request.sampling.include_stop_str_in_output,
            )
            if text is not None
            else None
        )

    def add_tokens(
        self, token_ids: list[int], logprobs: Sequence[executor_pb2.TokenLogprob]
    ) -> tuple[pb.GenerateResponse, StringStop | None]:
        """The message for newly sampled tokens and the stop string their text completed, if any.

        The message carries the tokens (and logprob records) up to the one that completed the
        stop string, as had they come one at a time: the rest (drafts accepted in the same step)
        are none of the output."""
        step = self._detokenizer.push(token_ids) if self._detokenizer is not None else None
        stop = step.stop if step is not None else None
        if stop is not None:
            token_ids = token_ids[: stop.num_tokens]
        message = pb.GenerateResponse(request_id=self.request.request_id, token_ids=token_ids)
        if self._prompt_scores_due:
            self._prompt_scores_due = False
            scored = self.request.num_prompt_tokens - 1
            message.prompt_logprobs.extend(self._client_logprob(record) for record in logprobs[:scored])
            logprobs = logprobs[scored:]
        if stop is not None:
            logprobs = logprobs[: stop.num_tokens]
        message.logprobs.extend(self._client_logprob(record) for record in logprobs)
        if step is not None:
            message.text = step.text_delta
        return message, stop

    def _client_logprob(self, record: executor_pb2.TokenLogprob) -> pb.TokenLogprob:
        """The executor's record as the client API's, which extends it (tests/protos/test_protos.py
        holds them to that) with each token's text bytes where there is a tokenizer."""
        if self._text is None:
            token_bytes, top_token_bytes = b"", []
        else:
            token_bytes = self._text.token_bytes(record.token_id)
            top_token_bytes = [self._text.token_bytes(token) for token in record.top_token_ids]
        return pb.TokenLogprob(
            token_id=record.token_id,
            logprob=record.logprob,
            top_token_ids=record.top_token_ids,
            top_logprobs=record.top_logprobs,
            token_bytes=token_bytes,
            top_token_bytes=top_token_bytes,
        )

    def send(self, message: pb.GenerateResponse) -> None:
        """Queues a token message; the stream owns it from here on."""
        tokens = len(message.token_ids)
        pending = self._fold(message)
        if self._first_sent:
            self._held_tokens += tokens
            if self._held_tokens < self._stream_interval:
                return
        self._first_sent = True
        self._held_tokens = 0
        self._ready.set()
        self._check_backlog(pending)

    async def next_item(self) -> StreamItem:
        """The next item to send, once the stream interval lets it go: every token message
        queued so far as one, then (once closed) the end or the error."""
        await self._ready.wait()
        pending, self._pending = self._pending, None
        if pending is None:
            return self.error
        # Tokens that arrived after the release leave with it, so none are held any more.
        self._held_tokens = 0
        if not self.closed:
            self._ready.clear()
        return pending.take()

    def close(self, message: pb.GenerateResponse | None = None) -> None:
        """Sends the last message (built here if not given) with finish reason, usage, timings."""
        if self.closed:
            return
        request = self.request
        if message is None:
            message = pb.GenerateResponse(request_id=request.request_id)
        if self._detokenizer is not None and request.finish_reason is not FinishReason.ABORT and not self._detokenizer.stopped:
            message.text += self._detokenizer.flush()
        message.finish_reason = FINISH_REASONS[request.finish_reason or FinishReason.ABORT]
        message.stop_reason = request.stop_reason or ""
        message.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=request.num_prompt_tokens,
                completion_tokens=request.num_output_tokens,
                cached_prompt_tokens=request.num_cached_tokens,
            )
        )
        message.timings.CopyFrom(timings(request))
        # Not held to the backlog limits: the stream ends here, one step past them at most.
        self._fold(message)
        self.closed = True
        self._ready.set()

    def fail(self, error: RequestError) -> None:
        if not self.closed:
            self.error = error
            self.closed = True
            self._ready.set()

    def discard(self) -> None:
        """Drops what the client has not taken, once its call is over. The stream itself lives
        on in reference cycles (grpc's call state and its callbacks; the request and its
        stream) until the collector finds them, which for a long stream is a full collection
        (process/gc_tuning.py): what it holds must not live on with it."""
        self._pending = None

    def _fold(self, message: pb.GenerateResponse) -> PendingMessage:
        if self._pending is None:
            self._pending = PendingMessage(message)
        else:
            self._pending.fold(message)
        return self._pending

    def _check_backlog(self, pending: PendingMessage) -> None:
        """Ends the request of a reader that fell behind the limits (checked as tokens are
        released to it, not while the stream interval holds them back): its backlog is dropped
        at once, and the request with its blocks by on_backlog_exceeded."""
        flag = self._backlog.exceeded_by(pending)
        if flag is None:
            return
        self._pending = None
        request_id = self.request.request_id
        logger.warning(
            "event=stream_backlog_exceeded request_id=%s tokens=%d bytes=%d max_tokens=%d max_bytes=%d",
            request_id, pending.tokens, pending.size, self._backlog.max_tokens, self._backlog.max_bytes,
        )
        self._on_backlog_exceeded(
            RequestError(
                ErrorKind.OVERLOADED,
                f"the client read too slowly: it fell {pending.tokens} tokens ({pending.size} "
                f"bytes) behind its request {request_id!r}, past the scheduler's {flag}; the "
                "request was ended. Read the stream as it arrives (or ask for fewer logprobs).",
            )
        )


def timings(request: Request) -> pb.Timings:
    arrival = request.arrival_time

    def since_arrival(moment: float | None) -> float:
        return moment - arrival if moment is not None else 0.0

    return pb.Timings(
        queued_s=since_arrival(request.first_scheduled_time),
        time_to_first_token_s=since_arrival(request.first_token_time),
        total_s=since_arrival(request.finish_time),
        num_preemptions=request.num_preemptions,
    )
