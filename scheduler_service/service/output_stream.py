"""One request's way back to its client: token updates become GenerateResponse messages."""

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any

from protos.splitserve.executor.v1 import executor_pb2
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import RequestError
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.text.detokenizer import IncrementalDetokenizer
from scheduler_service.text.tokenizer import TextProcessor

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

    stream_interval: tokens gathered before they are sent (the scheduler's --stream-interval).
    The first token goes at once, for the time to first token, and so does anything that is not
    a token message (the end of the stream, an error); held tokens leave with it."""

    def __init__(self, request: Request, text: TextProcessor | None, stream_interval: int = 1) -> None:
        self.request = request
        self._text = text
        self._items: deque[StreamItem] = deque()
        self._ready = asyncio.Event()
        self._stream_interval = stream_interval
        self._held_tokens = 0
        self._first_sent = False
        self.closed = False
        # When tokens last reached this stream (time.monotonic), for the inter-token latency.
        self.last_tokens_at: float | None = None
        # The request's span while tracing is on (service/tracing.py), else None.
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
    ) -> tuple[pb.GenerateResponse, str | None]:
        """The message for newly sampled tokens and the stop string they completed, if any."""
        message = pb.GenerateResponse(request_id=self.request.request_id, token_ids=token_ids)
        for record in logprobs:
            # The client API's TokenLogprob extends the executor's wire format
            # (tests/protos/test_protos.py holds them to it), so the record passes through as
            # bytes, and gains each token's text bytes where there is a tokenizer.
            entry = message.logprobs.add()
            entry.MergeFromString(record.SerializeToString())
            if self._text is not None:
                token_bytes = self._text.token_bytes
                entry.token_bytes = token_bytes(entry.token_id)
                entry.top_token_bytes.extend([token_bytes(token) for token in entry.top_token_ids])
        if self._detokenizer is None:
            return message, None
        step = self._detokenizer.push(token_ids)
        message.text = step.text_delta
        return message, step.stop_string

    def send(self, item: StreamItem) -> None:
        self._items.append(item)
        if isinstance(item, pb.GenerateResponse) and self._first_sent:
            self._held_tokens += len(item.token_ids)
            if self._held_tokens < self._stream_interval:
                return
        self._first_sent = True
        self._held_tokens = 0
        self._ready.set()

    async def next_item(self) -> StreamItem:
        """The next item to send, once the stream interval lets it go. Token messages queued
        behind a message are folded into it, so a stream whose client or event loop fell behind
        catches up in one message instead of one per step: the cost of sending stays per step,
        not per token."""
        while not (self._items and self._ready.is_set()):
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, pb.GenerateResponse):
            while self._items and isinstance(self._items[0], pb.GenerateResponse):
                following = self._items.popleft()
                text = item.text + following.text
                item.MergeFrom(following)
                item.text = text
            # Tokens that arrived after the release leave with it, so none are held any more.
            self._held_tokens = 0
        if not self._items:
            self._ready.clear()
        return item

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
        self.send(message)
        self.send(None)
        self.closed = True

    def fail(self, error: RequestError) -> None:
        if not self.closed:
            self.error = error
            self.send(error)
            self.closed = True


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
