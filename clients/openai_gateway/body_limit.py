"""Caps on request bodies, enforced before a body is held in memory: one body's size
(--max-body-bytes), and what the bodies of the requests in progress hold together
(--max-body-bytes-in-flight).

A declared Content-Length over the cap is refused from the headers alone, unread; a chunked body
is counted as it arrives and refused at the first byte past the cap. Either way the answer is a
413 in OpenAI's error shape and the connection is closed, so the rest of the body is never read.
A body within the cap is read whole here and handed on as one message, as the JSON routes would
read it anyway.

A request's body counts against the budget from its first byte (its declared length then, or
what has arrived of a chunked one; a length stated and never sent holds nothing) until its
response has been sent: the body, its JSON, the request built from it and that request's gRPC
message live about that long, five to six times the body in all. Bodies of up to
SMALL_BODY_BYTES are not counted, so that ordinary requests are never turned away because large
ones are in progress (or stalled mid-body). Without the budget, thirty 15 MiB bodies at once
took the gateway from 64 MiB to 1.5 GiB resident (and 1.4 GiB stayed); with the default, a
hundred at once peak at 310-400 MiB. A body that does not fit is read and dropped as it arrives,
holding nothing, and answered 503, which OpenAI's clients retry after a pause (here
Retry-After: 1); it is read so that the client, still sending it, hears the answer.

A body that goes --body-read-timeout seconds without a byte arriving is answered 408 (which
OpenAI's clients retry) and its connection closed, so a client that starts a large body and
stalls holds its share of the budget that long at most (uvicorn has no timeout of its own for a
body in progress; nginx's client_body_timeout is the same rule, at 60 s).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clients.openai_gateway.errors import GatewayError

DEFAULT_MAX_BODY_BYTES = 16 << 20
# Three of the largest bodies at once, 250-340 MiB more at the peak: within the 512 MiB the
# Kubernetes gateway pod may use (deploy/kubernetes/base/gateway.yaml), with ~100 MiB to spare.
DEFAULT_MAX_BODY_BYTES_IN_FLIGHT = 48 << 20
# Chat and completion requests are a few kilobytes; a prompt of some thousands of tokens, tens.
SMALL_BODY_BYTES = 64 << 10
# A client on a slow link still sends something every few seconds.
DEFAULT_BODY_READ_TIMEOUT_S = 30.0


@dataclass(slots=True)
class BodyBudget:
    """Bytes of request bodies held by the requests in progress, and how many may be."""

    limit: int
    held: int = 0

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


def check_budget(max_bytes: int, max_bytes_in_flight: int) -> None:
    """ValueError when a body of the largest size allowed could never be taken."""
    if max_bytes_in_flight < max_bytes:
        raise ValueError(
            f"--max-body-bytes-in-flight ({max_bytes_in_flight:,}) is below --max-body-bytes ({max_bytes:,}): "
            "a body of the largest size allowed could never be taken"
        )


class BodyLimit:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_bytes_in_flight: int = DEFAULT_MAX_BODY_BYTES_IN_FLIGHT,
        read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S,
    ) -> None:
        check_budget(max_bytes, max_bytes_in_flight)
        self.app = app
        self.max_bytes = max_bytes
        self.budget = BodyBudget(max_bytes_in_flight)
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Request(scope).headers.get("content-length", "")
        # 0 for a chunked body, which declares none.
        declared = int(length) if length.isdigit() else 0
        if declared > self.max_bytes:
            await self._refuse(scope, receive, send, f"the request body is {declared:,} bytes")
            return
        held = 0
        try:
            chunks: list[bytes] = []
            size = 0
            more = True
            while more:
                try:
                    async with asyncio.timeout(self.read_timeout_s):
                        message = await receive()
                except TimeoutError:
                    why = (
                        f"the request body stopped arriving: nothing for {self.read_timeout_s:g} s after "
                        f"{size:,} bytes (--body-read-timeout)"
                    )
                    await self._close_with(scope, receive, send, 408, why, "request_timeout")
                    return
                if message["type"] == "http.disconnect":
                    # The client left before its body arrived: nobody to answer.
                    return
                chunk = message.get("body", b"")
                more = message.get("more_body", False)
                size += len(chunk)
                if size > self.max_bytes:
                    await self._refuse(scope, receive, send, f"the request body is over {self.max_bytes:,} bytes")
                    return
                # A declared body counts whole from its first byte, so that of a burst of large
                # bodies the first few go through rather than each holding a share and none
                # finishing; a chunked one as it arrives.
                due = max(size, declared)
                if due > max(held, SMALL_BODY_BYTES):
                    if not self.budget.take(due - held):
                        chunks.clear()
                        await self._busy(scope, receive, send, due, more)
                        return
                    held = due
                chunks.append(chunk)
            body = b"".join(chunks)
            chunks.clear()
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.budget.give(held)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        message = f"{what}; this gateway takes at most {self.max_bytes:,} (--max-body-bytes)"
        await self._close_with(scope, receive, send, 413, message, "request_too_large")

    async def _close_with(self, scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str) -> None:
        """Answers a request whose body is left unread, and closes its connection: the unread rest
        would otherwise be parsed as the next request."""
        error = GatewayError(status, message, code=code, headers={"Connection": "close"})
        await error.response(Request(scope))(scope, receive, send)

    async def _busy(self, scope: Scope, receive: Receive, send: Send, size: int, unread: bool) -> None:
        """unread: whether more of the body is to come (it is read and dropped first)."""
        held = self.budget.held
        while unread:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            unread = message.get("more_body", False)
        error = GatewayError(
            503,
            f"the gateway holds {held:,} bytes of request bodies in progress; with this one's "
            f"{size:,} that would pass --max-body-bytes-in-flight ({self.budget.limit:,}). Retry shortly",
            code="gateway_busy",
            headers={"Retry-After": "1"},
        )
        await error.response(Request(scope))(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the connection's own messages (its disconnect)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed
