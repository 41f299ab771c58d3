"""Requests larger than the caps allow, or that do not parse (corrupt bytes, invalid UTF-8 in a
string field), end with INVALID_ARGUMENT saying so. Left to grpc, a parse error inside its
deserializer becomes UNKNOWN with a Python class name, and a message over its receive limit
RESOURCE_EXHAUSTED without naming a field: neither tells a client what to change.

A message is judged by its size before it is parsed, and only small ones are parsed here, on the
event loop: a larger request of a type the intake parses itself goes to its handler unparsed
(frontend/request_parsing.py says why a thread, and counting before decoding)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from scheduler_service.frontend.request_parsing import (
    INLINE_PARSE_BYTES,
    UnparsedRequest,
    unparsable,
)
from scheduler_service.frontend.wire_fields import largest_field

logger = logging.getLogger(__name__)

Deserializer = Callable[[bytes], Any]


class MessageParsingInterceptor(grpc.aio.ServerInterceptor):
    """Parses unary requests inside the call (streamed requests are left to grpc).

    max_request_bytes: the largest request the intake caps allow; a bigger one is refused from
    its length, unparsed, with its largest field named. unparsed_types: message types whose
    handlers take an UnparsedRequest when one is over INLINE_PARSE_BYTES."""

    def __init__(self, max_request_bytes: int, unparsed_types: frozenset[type[Message]] = frozenset()) -> None:
        self._max_request_bytes = max_request_bytes
        self._unparsed_types = unparsed_types

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = _Parser(handler.request_deserializer, self._max_request_bytes, self._unparsed_types)
        if handler.response_streaming:
            return handler._replace(
                request_deserializer=None, unary_stream=_streaming(handler.unary_stream, parse)
            )
        return handler._replace(request_deserializer=None, unary_unary=_unary(handler.unary_unary, parse))


class _Parser:
    def __init__(self, deserializer: Deserializer, max_bytes: int, unparsed_types: frozenset[type[Message]]) -> None:
        self.deserializer = deserializer
        self.max_bytes = max_bytes
        # Generated deserializers are the message class's FromString.
        self.message_class: type[Message] | None = getattr(deserializer, "__self__", None)
        # The type its handler takes unparsed when large, if it does.
        self.handed_over = self.message_class if self.message_class in unparsed_types else None

    def too_big(self, raw: bytes) -> str | None:
        """Why the message is refused unparsed, or None."""
        if len(raw) <= self.max_bytes:
            return None
        reason = f"the request is {len(raw):,} bytes; the request caps allow at most {self.max_bytes:,}"
        field = largest_field(raw)
        if field is None:
            return reason
        descriptor = getattr(self.message_class, "DESCRIPTOR", None)
        known = descriptor.fields_by_number.get(field.number) if descriptor is not None else None
        name = known.name if known is not None else f"number {field.number}"
        return f"{reason} (its field {name} takes {field.size_bytes:,}; see --max-prompt-bytes, --max-prompt-tokens, --max-cache-salt-bytes)"


def _parse(raw: bytes, parse: _Parser) -> tuple[Any, str | None]:
    """The message (or, large, the UnparsedRequest its handler takes), or why it is refused
    (logged here)."""
    refusal = parse.too_big(raw)
    if refusal is not None:
        logger.info("event=request_too_big bytes=%d limit=%d", len(raw), parse.max_bytes)
        return None, refusal
    if parse.handed_over is not None and len(raw) > INLINE_PARSE_BYTES:
        return UnparsedRequest(raw, parse.handed_over), None
    try:
        return parse.deserializer(raw), None
    except DecodeError as error:
        return None, unparsable(error, len(raw))


def _unary(
    behavior: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], parse: _Parser
) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        request, refusal = _parse(raw, parse)
        del raw
        if refusal is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        return await behavior(request, context)

    return parsed


def _streaming(
    behavior: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]], parse: _Parser
) -> Callable[[bytes, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        request, refusal = _parse(raw, parse)
        # Only the handler holds the message from here, so it can drop it long before its
        # stream ends, and before an abort (whose frames grpc keeps in reference cycles).
        del raw
        if refusal is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        responses = behavior(request, context)
        del request
        async for response in responses:
            yield response

    return parsed
