"""asyncio client for the splitserve Generation service (grpc.aio): clients.Client's calls
(clients/calls.py), awaited."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType
from typing import TypeVar

import grpc
import grpc.aio

from clients import calls
from clients.calls import (
    CancellingStream,
    UnaryCall,
    awaitable,
    collected_awaitable,
    streaming,
)
from clients.connection import ChannelClient
from clients.errors import SplitserveError
from clients.results import GenerationDelta, delta_from_response

Out = TypeVar("Out")


class AsyncDeltaStream(CancellingStream, AsyncIterator[GenerationDelta]):
    """The deltas of one Generate call; the last one has finish_reason set."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        super().__init__(call)
        self._responses = call.__aiter__()

    def __aiter__(self) -> AsyncDeltaStream:
        return self

    async def __anext__(self) -> GenerationDelta:
        try:
            return delta_from_response(await self._responses.__anext__())
        except grpc.RpcError as error:
            raise SplitserveError.from_rpc_error(error) from None

    async def __aenter__(self) -> AsyncDeltaStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.cancel()


class AsyncClient(ChannelClient):
    """One grpc.aio channel to a scheduler service; create and use it inside one event loop.

    Arguments as for clients.Client. Each call also takes `api_key`, which replaces the client's
    own for that call only, so one channel can serve callers with keys of their own (the
    OpenAI-compatible gateway forwards each HTTP caller's bearer token this way), and
    generate()/stream() take `tenant` likewise.
    """

    _transport = grpc.aio
    _stream_type = AsyncDeltaStream

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.channel.close()

    stream = streaming(calls.generate, "AsyncDeltaStream")
    generate = collected_awaitable(calls.generate)
    abort = awaitable(calls.abort)
    tokenize = awaitable(calls.tokenize)
    detokenize = awaitable(calls.detokenize)
    model_info = awaitable(calls.model_info)
    server_status = awaitable(calls.server_status)
    serving = awaitable(calls.serving)

    async def _run(self, call: UnaryCall[Out]) -> Out:
        method, options = self._channel.unary(call)
        try:
            return call.finish(await method(call.request, **options))
        except grpc.RpcError as error:
            raise SplitserveError.from_rpc_error(error) from None
