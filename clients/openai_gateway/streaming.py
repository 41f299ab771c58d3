"""Server-sent events, and tying a request's life to its HTTP client's connection: a client that
goes away cancels the gRPC call, so the scheduler aborts the request and frees its KV blocks."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from clients.async_client import AsyncDeltaStream
from clients.errors import SplitserveError
from clients.openai_gateway.errors import GatewayError, from_splitserve
from clients.openai_gateway.responses import Shaper, total_usage
from clients.results import GenerationDelta, Usage

logger = logging.getLogger(__name__)

T = TypeVar("T")
DONE_EVENT = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The HTTP client closed its connection before the answer was ready."""


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that always closes its generator when the response ends.

    Starlette stops iterating when the client disconnects but may leave the generator suspended
    at a `yield` until it is garbage-collected; closing it here runs its cleanup (cancelling the
    gRPC call) at once.
    """

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits work unless the client disconnects first: then cancels it, raises ClientDisconnected.

    Only for the time before a response starts: once a StreamingResponse runs, it listens for
    the disconnect itself, and two listeners would compete for the same messages.
    """
    work_task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({work_task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task.done() and not work_task.cancelled():
        return work_task.result()
    raise ClientDisconnected


async def _disconnect(request: Request) -> None:
    # The body has been read already, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def first_delta(request: Request, stream: AsyncDeltaStream) -> GenerationDelta:
    """The stream's first delta, read before any response is sent so that a refused request
    still gets its HTTP status instead of a 200 stream holding an error."""

    async def next_delta() -> GenerationDelta | None:
        return await anext(stream, None)

    try:
        delta = await until_disconnected(request, next_delta())
    except BaseException:
        stream.cancel()
        raise
    if delta is None:
        raise GatewayError(502, "the scheduler ended the stream without output")
    return delta


async def collect(request: Request, stream: AsyncDeltaStream) -> list[GenerationDelta]:
    """Every delta of the stream (for a response sent whole)."""

    async def read_all() -> list[GenerationDelta]:
        return [delta async for delta in stream]

    async with stream:
        return await until_disconnected(request, read_all())


async def event_stream(
    stream: AsyncDeltaStream, first: GenerationDelta, shaper: Shaper, request_id: str, num_choices: int = 1
) -> AsyncGenerator[str, None]:
    """The response's events: chunks, the usage chunk when asked, then [DONE]; an error after
    the response started becomes one error event, which ends the stream. The stream is over
    once each of its num_choices choices has had its finish reason."""
    async with stream:
        delta: GenerationDelta | None = first
        # Each finished choice's usage, by index.
        finished: dict[int, Usage | None] = {}
        try:
            for chunk in shaper.opening():
                yield sse_event(chunk)
            while delta is not None:
                for chunk in shaper.chunks(delta):
                    yield sse_event(chunk)
                if delta.finish_reason is not None:
                    finished[delta.index] = delta.usage
                    if len(finished) == num_choices:
                        break
                delta = await anext(stream, None)
            if delta is None:
                raise GatewayError(502, "the scheduler ended the stream without a finish reason")
            usage = total_usage([finished[index] for index in sorted(finished)])
            for chunk in shaper.closing(usage):
                yield sse_event(chunk)
        except (SplitserveError, GatewayError) as failure:
            error = from_splitserve(failure) if isinstance(failure, SplitserveError) else failure
            logger.info(
                "event=stream_failed request_id=%s status=%d code=%s message=%r",
                request_id, error.status, error.code, error.message,
            )
            yield sse_event(error.body())
            return
        except (GeneratorExit, asyncio.CancelledError):
            logger.info("event=client_disconnected request_id=%s streaming=true", request_id)
            raise
    logger.info(
        "event=request_finished request_id=%s streaming=true finish_reason=%s prompt_tokens=%s "
        "completion_tokens=%s",
        request_id, delta.finish_reason, usage.prompt_tokens if usage else None,
        usage.completion_tokens if usage else None,
    )
    yield DONE_EVENT
