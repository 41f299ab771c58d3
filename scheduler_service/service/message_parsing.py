"""Requests that do not parse (corrupt bytes, invalid UTF-8 in a string field) end with
INVALID_ARGUMENT saying so. Left to grpc, a parse error inside its deserializer becomes UNKNOWN
with a Python class name, which tells a client nothing it can act on."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

logger = logging.getLogger(__name__)

Deserializer = Callable[[bytes], Any]


class MessageParsingInterceptor(grpc.aio.ServerInterceptor):
    """Parses unary requests inside the call (streamed requests are left to grpc)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        if handler.response_streaming:
            return handler._replace(
                request_deserializer=None, unary_stream=_streaming(handler.unary_stream, parse)
            )
        return handler._replace(request_deserializer=None, unary_unary=_unary(handler.unary_unary, parse))


async def _parse_or_abort(raw: bytes, parse: Deserializer, context: grpc.aio.ServicerContext) -> Any:
    try:
        return parse(raw)
    except DecodeError as error:
        logger.info("event=request_unparsable bytes=%d error=%r", len(raw), str(error))
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request message does not parse ({error}); strings must be valid UTF-8",
        )


def _unary(
    behavior: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], parse: Deserializer
) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(await _parse_or_abort(raw, parse, context), context)

    return parsed


def _streaming(
    behavior: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]], parse: Deserializer
) -> Callable[[bytes, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        request = await _parse_or_abort(raw, parse, context)
        # Only the handler holds the message from here, so it can drop it long before its
        # stream ends, and before an abort (whose frames grpc keeps in reference cycles).
        del raw
        responses = behavior(request, context)
        del request
        async for response in responses:
            yield response

    return parsed
